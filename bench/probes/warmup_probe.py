import json, os, time
from tandem.engine_service.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tandem.engine_service.core.warmup import serving_engine
from tandem.bench.engine_run import run_engine
from tandem.bench.workloads import make_workload
out = {}
for model in ("dummy:qwen3-next-80b-a3b", "dummy:qwen3-30b-a3b"):
    for ws in (60.0, 0.0):
        t0 = time.monotonic()
        cfg = EngineConfig(ModelConfig(model=model, max_model_len=4096, warmup_seconds=ws), CacheConfig(), SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192))
        eng = serving_engine(cfg)
        built = time.monotonic() - t0
        w = make_workload("nanovllm", eng.vocab_size, 128, 0.25, max_model_len=4096)  # a fresh engine each: nothing cached
        s = run_engine(eng, w.requests).summary()
        out[f"{model} warmup={ws}"] = {"build_and_warmup_s": round(built, 2), "slowest_steps_ms": s["slowest_steps_ms"], "step_p50_ms": s["step_ms"]["p50"], "ttft_p50_ms": s["ttft_ms"]["p50"], "out_tok_s": s["output_tokens_per_s"]}
        print(model, ws, json.dumps(out[f"{model} warmup={ws}"]), flush=True)
        del eng
        import torch, gc; gc.collect(); torch.cuda.empty_cache()
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "warmup_probe.json"), "w"), indent=1)
