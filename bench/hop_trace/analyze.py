"""Per-hop TTFT breakdown from a $HOP_FILE written at concurrency 1 (see README.md).

Requests are told apart by the client's send stamp (one request at a time); the first `skip`
requests (default 8) are left out. Prints, per stamp, its median offset from the client's send
and the median / p90 / max of the hop from the stamp before it (stamps ordered by median
offset), then TTFT, the core's first step and TTFT minus that step.
Usage: python analyze.py HOP_FILE [skip]
"""

import statistics as st
import sys


def main(path: str, skip: int = 8) -> None:
    events = []
    for line in open(path):
        t, _pid, name = line.split()
        events.append((int(t), name))
    events.sort()
    reqs, cur = [], None
    for t, name in events:
        if name == "c0_client_send":
            cur = {name: t}
            reqs.append(cur)
        elif cur is not None and name not in cur:
            cur[name] = t
    reqs = [r for r in reqs if "c9_client_first" in r][skip:]
    names = set().union(*reqs)
    offset = {n: st.median([(r[n] - r["c0_client_send"]) / 1e6 for r in reqs if n in r]) for n in names}
    print(f"{len(reqs)} requests; median offset from the client's send (ms), then the hop from the line above")
    prev = None
    for n in sorted(names, key=offset.get):
        if prev is None:
            print(f"{n:24s} {offset[n]:8.3f}")
        else:
            d = sorted((r[n] - r[prev]) / 1e6 for r in reqs if n in r and prev in r)
            print(f"{n:24s} {offset[n]:8.3f}   hop p50 {st.median(d):7.3f}  p90 {d[int(0.9 * len(d))]:7.3f}  max {d[-1]:7.3f}")
        prev = n
    ttft = [(r["c9_client_first"] - r["c0_client_send"]) / 1e6 for r in reqs]
    step = [(r["k3_step_end"] - r["k2_step_start"]) / 1e6 for r in reqs if "k3_step_end" in r]
    rest = sorted((r["c9_client_first"] - r["c0_client_send"] - (r["k3_step_end"] - r["k2_step_start"])) / 1e6
                  for r in reqs if "k3_step_end" in r)
    print(f"TTFT p50 {st.median(ttft):.3f}  core's first step p50 {st.median(step) if step else float('nan'):.3f}  "
          f"TTFT minus that step p50 {st.median(rest) if rest else float('nan'):.3f}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 8)
