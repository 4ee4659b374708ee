"""Does an idle gap before a request slow its first step? In-process, no gRPC: the same
requests one at a time, with no pause or with a pause before each (what the served engine core
sees at concurrency 1 while the answer travels back and the next request comes in).

Usage: python idle_gap.py [--model dummy:qwen3-0.6b] [--device cuda] [--gaps-ms 0,3,0,3,0,1]
Prints, per pass, the p50 / mean time from add_request to the step call that returned the first
token. The engine is built on the main thread and stepped on another, as the core process does.
"""

import argparse
import statistics as st
import threading
import time

from tandem.bench.engine_run import greedy_params
from tandem.bench.workloads import make_workload
from tandem.engine_service.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tandem.engine_service.core.engine import LLMEngine


def passes(engine: LLMEngine, gaps_ms: list[float], n: int, scale: float) -> None:
    requests = make_workload("nanovllm", engine.runner.vocab_size, n, scale, max_model_len=4096).requests
    for k, gap in enumerate(gaps_ms):
        ttfts = []
        for i, r in enumerate(requests):
            rid = f"gap{k}-{i}"
            if gap:
                time.sleep(gap / 1000.0)
            t0 = time.perf_counter()
            engine.add_request(rid, list(r.prompt_token_ids), greedy_params(min(r.output_len, 8)))
            first = None
            while engine.has_work():
                for o in engine.step():
                    if o.request_id == rid and o.new_token_ids and first is None:
                        first = time.perf_counter()
            ttfts.append((first - t0) * 1e3)
        print(f"gap {gap:g} ms: first token p50 {st.median(ttfts):.3f} ms, mean {st.mean(ttfts):.3f} ms", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="dummy:tiny-qwen3")
    p.add_argument("--device", default="auto")
    p.add_argument("--gaps-ms", default="0,3,0,3,0,1")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--scale", type=float, default=0.1)
    a = p.parse_args()
    engine = LLMEngine(EngineConfig(ModelConfig(model=a.model, device=a.device), CacheConfig(num_blocks=4096),
                                    SchedulerConfig(max_num_seqs=8)))
    gaps = [float(g) for g in a.gaps_ms.split(",")]
    t = threading.Thread(target=passes, args=(engine, [0.0] + gaps, a.requests, a.scale))  # first pass: warm-up
    t.start()
    t.join()


if __name__ == "__main__":
    main()
