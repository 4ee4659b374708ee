"""`Sampler.sample` end to end with the top-k/top-p/min-p filter on the Triton kernel against the
same sampler on its PyTorch twin (sort), at vocab 151936 on the GPU: first the tokens of both
(same sampler seed, same per-request seeds) on bfloat16-valued logits, then CUDA-event medians of
whole `sample` calls (host work, the pinned copies and the wait for the tokens included).
Usage on the GPU: python3 -P bench/probes/sampler_probe.py [--batches 1,64,256]; JSON to $OUT."""
import argparse, json, os, sys

import torch

from tandem.bench.timing import cuda_time
from tandem.engine_service.sequence import SamplingParams, Sequence
from tandem.engine_service.worker.sampler import Sampler, _filter_top_k_top_p_min_p

VOCAB = 151936
# Sampling settings per row; "mixed" cycles through every other one and greedy.
PROFILES = {
    "qwen3 default (T0.6 k20 p0.95)": dict(temperature=0.6, top_k=20, top_p=0.95),
    "top-p 0.9": dict(temperature=1.0, top_p=0.9),
    "top-k 50": dict(temperature=0.8, top_k=50),
    "min-p 0.05": dict(temperature=1.0, min_p=0.05),
    "T1 no filter": dict(temperature=1.0),
}


def rows_for(profile: str, batch: int, seeded: bool = False) -> list[Sequence]:
    cycle = list(PROFILES.values()) + [dict(temperature=0.0)]
    params = [PROFILES[profile] if profile != "mixed" else cycle[i % len(cycle)] for i in range(batch)]
    return [Sequence(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=8, seed=(1000 + i) if seeded else None, **p))
            for i, p in enumerate(params)]


def logits_for(batch: int, seed: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(batch, VOCAB, device=device, generator=gen) * 3).bfloat16().float()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,64,256")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    device = torch.device("cuda")
    out = {"vocab": VOCAB, "device": torch.cuda.get_device_name(device), "correctness": [], "timing": []}
    profiles = list(PROFILES) + ["mixed"]

    # Correctness: kept sets of the filter alone, then whole sampled tokens (unseeded rows share
    # the sampler's generator, seeded rows draw their own noise on the CPU).
    for batch in batches:
        for profile in profiles:
            for seeded in ((False, True) if batch <= 64 else (False,)):
                mism_tokens = mism_rows = 0
                for trial in range(3):
                    logits = logits_for(batch, 10 * batch + trial, device)
                    params = [s.params for s in rows_for(profile, batch)]
                    scaled = logits / torch.tensor([max(p.temperature, 1e-6) for p in params], device=device)[:, None]
                    a = _filter_top_k_top_p_min_p(scaled.clone(), params, True)
                    b = _filter_top_k_top_p_min_p(scaled.clone(), params, False)
                    mism_rows += int((torch.isfinite(a) != torch.isfinite(b)).any(dim=1).sum())
                    on = Sampler(seed=trial, filter_kernel=True).sample(logits, rows_for(profile, batch, seeded)).token_ids
                    off = Sampler(seed=trial, filter_kernel=False).sample(logits, rows_for(profile, batch, seeded)).token_ids
                    mism_tokens += sum(x != y for x, y in zip(on, off))
                out["correctness"].append({"batch": batch, "profile": profile, "seeded": seeded, "trials": 3,
                                           "rows_kept_set_differs": mism_rows, "tokens_differ": mism_tokens})
    # Timing: whole sample() calls, fresh logits each batch size, unseeded rows (a seeded row adds
    # the same CPU draw to both paths).
    for batch in batches:
        logits = logits_for(batch, batch, device)
        for profile in profiles:
            point = {"batch": batch, "profile": profile}
            # "kernel": the sampler as the engine builds it (the kernel where it is wired).
            for label, flag in (("kernel", None), ("torch", False)):
                sampler = Sampler(seed=0, filter_kernel=flag)
                seqs = rows_for(profile, batch)
                t = cuda_time(lambda: sampler.sample(logits, seqs), device, warmup=5, reps=40, budget_s=2.0)
                point[f"{label}_ms"] = t.median_ms
                point[f"{label}_timing"] = t.as_dict()
            point["speedup"] = point["torch_ms"] / point["kernel_ms"]
            out["timing"].append(point)
    bad = [c for c in out["correctness"] if c["rows_kept_set_differs"] or c["tokens_differ"]]
    out["ok"] = not bad
    path = os.path.join(os.environ.get("OUT", "."), "sampler_probe.json")
    json.dump(out, open(path, "w"), indent=1)
    print(f"sampler probe: {len(out['correctness'])} correctness cases, {len(bad)} with differences: {bad}")
    print(f"{'batch':>5} {'profile':<32} {'kernel ms':>9} {'torch ms':>9} {'speedup':>7}")
    for p in out["timing"]:
        print(f"{p['batch']:>5} {p['profile']:<32} {p['kernel_ms']:>9.3f} {p['torch_ms']:>9.3f} {p['speedup']:>6.2f}x")
    sys.exit(0 if out["ok"] else 1)


if __name__ == "__main__":
    main()
