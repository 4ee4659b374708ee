"""Decode step time with and without structured output: B requests decoding in steady state,
unconstrained, all constrained, and half and half, on one engine (overlap as `tandem serve` sets
it). Each mode admits its B requests, steps until every prompt is computed, then times `--steps`
engine steps (wall clock over the window, one device sync at each end) and checks that every
request was still decoding. Usage on the GPU:
  python3 -P bench/probes/structured_output_probe.py [MODEL] [--batches 1,16,64,256] [--steps 64]
The unconstrained figure compared across commits (this probe's `--modes unconstrained` at the
commit before structured output, 371af7e, and now) is the "unchanged unconstrained path" check;
the constrained ones add the per-step mask fill on the host and its application on the device."""
import argparse, json, os, time

import torch

from tandem.engine_service.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tandem.engine_service.core.engine import LLMEngine
from tandem.engine_service.sequence import SamplingParams

# No request can complete inside the window: at least 201 lowercase words (a token holds at most one
# word with its space, so 201+ tokens) before the grammar accepts anything, EOS included; a
# shorter minimum let requests of the H100 run at 759d105 sample EOS and end early.
REGEX = r"[a-z]{1,12}( [a-z]{1,12}){200,260}"

p = argparse.ArgumentParser()
p.add_argument("model", nargs="?", default="smollm2-135m-instruct")
p.add_argument("--batches", default="1,16,64,256")
p.add_argument("--steps", type=int, default=64)
p.add_argument("--prompt-len", type=int, default=128)
p.add_argument("--modes", default="unconstrained,constrained,half")
p.add_argument("--seeded", action="store_true", help="a seed per request (the sampler's per-row generators)")
p.add_argument("--tokenizer", help="a tokenizer.json (or its folder) for the constraints: dummy weights on a machine "
                                   "without the embedded model get a word-level tokenizer, which llguidance cannot read")
a = p.parse_args()
batches = [int(b) for b in a.batches.split(",")]
cfg = EngineConfig(ModelConfig(model=a.model, max_model_len=a.prompt_len + a.steps + 64),
                   CacheConfig(), SchedulerConfig(max_num_seqs=max(batches), max_num_batched_tokens=8192))
eng = LLMEngine(cfg)
has_so = hasattr(SamplingParams, "__struct_fields__") and "structured_output" in SamplingParams.__struct_fields__
if a.tokenizer and has_so:
    from tandem.engine_service.grammar.compiler import GrammarCompiler
    from tokenizers import Tokenizer

    path = a.tokenizer if a.tokenizer.endswith(".json") else f"{a.tokenizer}/tokenizer.json"
    # The model's EOS ids may lie beyond a borrowed tokenizer's vocabulary (Qwen3's 151645 against
    # SmolLM2's 49152), which llguidance refuses; the probe's requests ignore EOS, so the
    # tokenizer's own ids (or none) do.
    size = Tokenizer.from_file(path).get_vocab_size()
    eos = tuple(e for e in eng.eos_token_ids if e < size)
    eng._grammars = GrammarCompiler(path, eng.vocab_size, eos)
sync = torch.cuda.synchronize if eng.runner.device.type == "cuda" else (lambda: None)


def params(constrained: bool, seed: int) -> SamplingParams:
    # `--seeded` gives each request its own generator: the sampler draws each seeded row's noise on
    # the CPU (a vocabulary's worth per row and step), which is probably what made the seeded
    # steps of 3c65854's H200 run so slow (331 ms at batch 64). Unseeded is the batched path.
    kw = dict(max_tokens=a.steps + 32, temperature=1.0, seed=seed if a.seeded else None, ignore_eos=True)
    if constrained:
        from tandem.core_protocol import StructuredOutput, StructuredOutputKind
        kw["structured_output"] = StructuredOutput(kind=StructuredOutputKind.REGEX, spec=REGEX)
    return SamplingParams(**kw)


def run(mode: str, batch: int, tag: str) -> dict:
    rng = torch.Generator().manual_seed(batch)
    ids = []
    for i in range(batch):
        constrained = mode == "constrained" or (mode == "half" and i % 2 == 1)
        prompt = torch.randint(10, eng.vocab_size - 10, (a.prompt_len,), generator=rng).tolist()
        rid = f"{tag}-{mode}-{batch}-{i}"
        eng.add_request(rid, prompt, params(constrained, i))
        ids.append(rid)
    for _ in range(10_000):  # admit everything and compute every prompt
        eng.step()
        s = eng.scheduler
        if not s.waiting and not getattr(s, "compiling", None) and all(q.num_uncomputed_tokens <= 1 for q in s.running):
            break
    for _ in range(3):
        eng.step()
    sync()
    start = time.perf_counter()
    ended = 0
    for _ in range(a.steps):
        ended += sum(o.finished for o in eng.step())
    sync()
    ms = (time.perf_counter() - start) * 1e3 / a.steps
    # Every request must still be decoding, or the window timed a smaller batch (a constraint
    # that failed to compile ends its request at once).
    alive = [rid for rid in ids if (seq := eng.scheduler.get(rid)) is not None and not seq.is_finished]
    if len(alive) != batch:
        ended_early = next((eng.scheduler.get(rid) for rid in ids if rid not in alive), None)
        raise SystemExit(f"{mode} b={batch}: {batch - len(alive)} requests ended before the window's end "
                         f"({getattr(ended_early, 'stop_reason', None)}): no figure")
    eng.abort_and_settle(ids)
    return {"mode": mode, "batch": batch, "step_ms": round(ms, 3), "ended_in_window": ended}


rows = []
for batch in batches:
    for mode in a.modes.split(","):
        if mode != "unconstrained" and not has_so:
            continue
        run(mode, batch, "warm")  # first use: kernels, the compiler's vocabulary load
        rows.append(run(mode, batch, "timed"))
        print(json.dumps(rows[-1]), flush=True)
out = {"model": a.model, "device": str(eng.runner.device), "overlap": eng.overlap, "steps": a.steps,
       "prompt_len": a.prompt_len, "structured_output_in_tree": has_so, "rows": rows}
by = {(r["mode"], r["batch"]): r["step_ms"] for r in rows}
for batch in batches:
    base = by.get(("unconstrained", batch))
    for mode in ("constrained", "half"):
        if base and (mode, batch) in by:
            print(f"b={batch} {mode}: {by[(mode, batch)] / base:.2f}x the unconstrained step ({base} ms)")
os.makedirs(os.environ.get("OUT", "."), exist_ok=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), f"structured_output_probe-{a.model.split(':')[-1]}.json"), "w"),
          indent=1)
eng.close()
