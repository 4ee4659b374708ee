"""Which Triton kernels compile when: a fresh TRITON_CACHE_DIR, an engine (warmed up as `tandem
serve` does), then a burst of requests; every cache entry's kernel, specialisation and mtime
against the phases. Usage on the GPU: TRITON_CACHE_DIR=$(mktemp -d) python3 -P bench/probes/compile_probe.py MODEL"""
import glob, json, os, sys, time
from tandem.bench.engine_run import run_engine
from tandem.bench.workloads import make_workload
from tandem.engine_service.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tandem.engine_service.core.warmup import serving_engine

model = sys.argv[1]
phases = {"start": time.time()}
cfg = EngineConfig(ModelConfig(model=model, max_model_len=4096, warmup_seconds=float(sys.argv[2]) if len(sys.argv) > 2 else 60.0),
                   CacheConfig(), SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192))
eng = serving_engine(cfg)
phases["engine_ready"] = time.time()
w = make_workload("nanovllm", eng.vocab_size, 128, 0.25, max_model_len=4096)
t = []
orig = eng.step
def timed():
    a = time.time(); r = orig(); t.append((a, time.time())); return r
eng.step = timed
s = run_engine(eng, w.requests).summary()
phases["run_done"] = time.time()
entries = []
for f in glob.glob(os.path.join(os.environ["TRITON_CACHE_DIR"], "*", "*.json")):
    if os.path.basename(f).startswith("__grp__"):
        continue
    try:
        meta = json.load(open(f))
    except Exception:
        continue
    if "name" not in meta:
        continue
    entries.append({"name": meta.get("name"), "mtime": os.path.getmtime(f) - phases["start"],
                    "num_warps": meta.get("num_warps"),
                    "constants": {k: v for k, v in meta.items() if k not in ("name", "hash", "target", "shared", "global_scratch_size", "global_scratch_align", "profile_scratch_size", "profile_scratch_align", "tmem_size", "ptx_version", "ptx_options", "ir_override", "enable_fp_fusion", "launch_cooperative_grid", "launch_pdl", "supported_fp8_dtypes", "deprecated_fp8_dot_operand_dtypes", "default_dot_input_precision", "allowed_dot_input_precisions", "max_num_imprecise_acc_default", "extern_libs", "debug", "backend_name", "sanitize_overflow", "arch", "instrumentation_mode")}})
    ttir = glob.glob(os.path.join(os.path.dirname(f), "*.ttir"))
    if ttir:
        sig = next((line for line in open(ttir[0]) if "tt.func public" in line), "")
        entries[-1]["signature"] = sig.strip()[:700]
entries.sort(key=lambda e: e["mtime"])
slow = [(i, round((b - a) * 1e3, 1), round(a - phases["start"], 2)) for i, (a, b) in enumerate(t) if b - a > 0.3]
res = {"model": model, "phases": {k: round(v - phases["start"], 2) for k, v in phases.items()}, "slow_steps": slow,
       "compiled_during_run": [e for e in entries if e["mtime"] > phases["engine_ready"] - phases["start"]],
       "num_compiled_before_run": sum(e["mtime"] <= phases["engine_ready"] - phases["start"] for e in entries),
       "ttft_p50_ms": s["ttft_ms"]["p50"]}
print(json.dumps({k: v for k, v in res.items() if k != "compiled_during_run"}))
for e in res["compiled_during_run"]:
    print(round(e["mtime"], 2), e["name"], e["num_warps"], json.dumps(e["constants"], default=str)[:200], e.get("signature", "")[:400])
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), f"compile_probe-{model.split(':')[-1]}.json"), "w"), indent=1, default=str)
