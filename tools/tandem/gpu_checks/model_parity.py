"""Whole-model parity of the engine's GPU path against its PyTorch reference, and decode timing.

Usage: ``python -P -m tandem.gpu_checks.model_parity --out DIR [--model dummy:qwen3-0.6b]``.

Hybrid models (Gated DeltaNet + attention) run the same parts: e.g. ``--model dummy:tiny-qwen3.5``
or ``dummy:qwen3-next-80b-a3b``; the Triton engines then also run the GDN kernels (conv1d, gated
delta rule, gated norm) and decode through CUDA graphs with fixed state-slot buffers, against
the PyTorch twins of the reference engine.

Three engines are built on the same seeded dummy weights (bf16, CUDA):

* ``reference``     — PyTorch reference attention and layers, eager;
* ``triton_graphs`` — Triton attention + fused layers, decode through CUDA graphs (the default);
* ``triton_eager``  — the same without graphs (tells a kernel problem from a capture problem).

They are fed the same 8 prompts (random token ids, lengths 20..200, seed 0; chunked prefill
with a 256-token budget, so prefill chunks, mixed batches and pure decodes all occur) and decode
greedily, 64 tokens each, in lockstep. At every step the logits of every sampled sequence are
compared pairwise: a row passes when ``max|Δlogit| <= 0.1 · max|reference logit|`` and is finite.
Tokens must be identical except at near-ties: where they differ, the reference's logit gap
between its token and the other engine's must be below ``max(0.02 · max|logit|, 2 · max|Δlogit|)``
of that row (twice the measured error is exactly what can flip an argmax). A near-tie is reported
and that sequence is not compared any further (its continuations differ legitimately).

Then: a host-sync check (one mixed step and one decode step of each Triton engine, forward and
sampler launch, under ``torch.cuda.set_sync_debug_mode("error")``); an overlapped-scheduling
check (the Triton + graphs runner drives 64 greedy requests with overlap off and on: identical
tokens required, wall time of each reported); and decode-step timing at batch 1 and 8 with a
512-token context for every engine (CUDA events; ``median_ms`` per synchronised step including
host work, ``pipelined_ms`` per step when steps are issued back to back).

Every part catches its own exceptions into the report. Writes ``DIR/model_parity.json`` and prints
a short table last; exits 1 when anything failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tandem.engine_service.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tandem.engine_service.core.engine import LLMEngine
from tandem.engine_service.worker.input_batch import prepare_host_inputs
from tandem.engine_service.worker.model_runner import ModelRunner
from tandem.engine_service.core.scheduler import ScheduledSeq
from tandem.engine_service.sequence import SamplingParams, Sequence
from tandem.engine_service.worker.worker import StepWorker, WorkerStep
from tandem.engine_service.worker.worker_rows import StepBatch, host_inputs_from_rows
from tandem.gpu_checks.divergence import TOP_LOGPROBS, judge_divergence

DEVICE = "cuda"
BLOCK_SIZE = 16
NUM_BLOCKS = 768  # fixed: three engines share one GPU, none may size its pool from free memory
MAX_MODEL_LEN = 1024
MAX_NUM_SEQS = 16
MAX_BATCHED_TOKENS = 256
NUM_PROMPTS = 8
MAX_TOKENS = 64
LOGIT_TOL = 0.1
TIE_REL = 0.02
TIMING_CONTEXT = 512
TIMING_BATCHES = (1, 8)
OVERLAP_REQUESTS = 64
OVERLAP_PROMPT_LEN = 128
OVERLAP_OUTPUT_LEN = 256

VARIANTS: dict[str, dict[str, Any]] = {
    "reference": {"attention_backend": "torch", "enforce_eager": True},
    "triton_graphs": {"attention_backend": "triton", "enforce_eager": False},
    "triton_eager": {"attention_backend": "triton", "enforce_eager": True},
}
PAIRS = [("reference", "triton_graphs"), ("reference", "triton_eager"), ("triton_eager", "triton_graphs")]


class Recorder:
    """Wraps an engine worker's `execute`: keeps the last step's logits rows by request id, and
    counts the steps that went through a CUDA graph. `execute` runs the hand-built,
    Sequence-shaped batches of the timing parts straight through the runner's forward."""

    def __init__(self, runner: ModelRunner, worker: StepWorker) -> None:
        self.runner = runner
        self.execute = lambda batch: runner.forward(prepare_host_inputs(batch, runner.block_size))
        self._worker_execute = worker.execute  # the unwrapped method
        self.last: dict[str, torch.Tensor] = {}
        self.steps = 0
        self.graph_steps = 0
        self.piecewise_steps = 0  # steps with prefill rows replayed in pieces
        worker.execute = self  # type: ignore[method-assign]

    @torch.inference_mode()
    def __call__(self, batch: StepBatch, previous: WorkerStep | None = None) -> torch.Tensor:
        graphs, pieces = self.runner.cuda_graphs, self.runner.piecewise_graphs
        host = host_inputs_from_rows(batch, self.runner.block_size)
        if graphs is not None and graphs.can_run(host):
            self.graph_steps += 1
        elif pieces is not None and pieces.can_run(host):
            self.piecewise_steps += 1
        self.steps += 1
        logits = self._worker_execute(batch, previous)
        ids = [row.request_id for row in batch.sampling_rows]
        self.last = {rid: logits[i] for i, rid in enumerate(ids)}
        return logits


@dataclasses.dataclass
class Variant:
    """One engine under test."""

    name: str
    engine: LLMEngine
    recorder: Recorder


def _guarded(report: dict[str, Any], part: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one part; its result (or its exception) goes into `report["parts"][part]`."""
    start = time.monotonic()
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - one failing part must not hide the others
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    result["seconds"] = round(time.monotonic() - start, 2)
    report["parts"][part] = result
    return result


def _environment() -> dict[str, Any]:
    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda}
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception as exc:  # noqa: BLE001
        env["triton"] = f"unavailable: {exc}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(device=props.name, sms=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1))
    return env


def _config(args: argparse.Namespace, overrides: dict[str, Any], overlap: str) -> EngineConfig:
    return EngineConfig(
        ModelConfig(model=args.model, dtype="bfloat16", device=DEVICE, max_model_len=MAX_MODEL_LEN, seed=0,
                    **overrides),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS),
        SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_BATCHED_TOKENS,
                        overlap_scheduling=overlap),
    )


def _build(args: argparse.Namespace, name: str, overrides: dict[str, Any]) -> Variant:
    # Overlap off: each step's logits and its tokens come from the same step() call, which the
    # per-step comparison below relies on (part_overlap checks the overlapped engine).
    config = _config(args, overrides, "off")
    config.validate()
    runner = ModelRunner(config)
    engine = LLMEngine(config, runner=runner)
    return Variant(name, engine, Recorder(runner, engine.worker))


def part_build(args: argparse.Namespace, variants: dict[str, Variant]) -> dict[str, Any]:
    info: dict[str, Any] = {}
    for name, overrides in VARIANTS.items():
        start = time.monotonic()
        try:
            variants[name] = _build(args, name, overrides)
        except Exception as exc:  # noqa: BLE001
            info[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            continue
        runner = variants[name].recorder.runner
        graphs = runner.cuda_graphs
        info[name] = {
            "attention_backend": runner.attention_backend,
            "cuda_graph_sizes": graphs.captured_sizes if graphs is not None else None,
            "cuda_graph_splits": graphs.num_splits if graphs is not None else None,
            "piecewise_graph_sizes": runner.piecewise_graphs.captured_sizes if runner.piecewise_graphs else None,
            "seconds": round(time.monotonic() - start, 1),
        }
    # Same seed, same parameter order: every engine must hold bit-identical weights.
    sums = {n: _weight_fingerprint(v.recorder.runner.model) for n, v in variants.items()}
    info["weight_fingerprints"] = sums
    same_weights = len({tuple(s) for s in sums.values()}) <= 1
    graphs_ok = "triton_graphs" in variants and variants["triton_graphs"].recorder.runner.cuda_graphs is not None
    info["memory_allocated_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
    info["ok"] = len(variants) == len(VARIANTS) and same_weights and graphs_ok
    if not graphs_ok:
        info["problem"] = "triton_graphs captured no CUDA graphs (see the engine log)"
    if not same_weights:
        info["problem"] = "engines hold different weights"
    return info


@torch.no_grad()
def _weight_fingerprint(model: torch.nn.Module) -> list[float]:
    """Sums of a few weights, among them slices of the fused path's merged q/k/v and gate/up."""
    names = ("model.embed_tokens.weight", "model.layers.0.self_attn.k_proj.weight",
             "model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.q_norm.weight",
             # hybrid models: a GDN layer (Qwen3.5 / Qwen3-Next projections) and an attention one
             "model.layers.0.linear_attn.in_proj_qkv.weight", "model.layers.0.linear_attn.in_proj_qkvz.weight",
             "model.layers.0.linear_attn.A_log", "model.layers.3.self_attn.q_proj.weight")
    params = dict(model.named_parameters())
    return [round(float(params[n].double().sum()), 6) for n in names if n in params]


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(20, 201, (NUM_PROMPTS,), generator=gen).tolist()
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def _compare_rows(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, bool]:
    ref, other = a.float(), b.float()
    delta = float((ref - other).abs().max())
    scale = float(ref.abs().max())
    finite = bool(torch.isfinite(other).all())
    return delta, scale, finite and delta <= LOGIT_TOL * scale


def part_parity(variants: dict[str, Variant]) -> dict[str, Any]:
    missing = [n for n in VARIANTS if n not in variants]
    if missing:
        return {"ok": False, "error": f"engines not built: {missing}"}
    vocab = variants["reference"].recorder.runner.vocab_size
    prompts = _prompts(vocab)
    for v in variants.values():
        for i, prompt in enumerate(prompts):
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
            v.engine.add_request(f"p{i}", prompt, params)
    pairs: dict[str, dict[str, Any]] = {
        f"{a}~{b}": {"steps": [], "near_ties": [], "mismatches": [], "identical_tokens": 0, "ok": True}
        for a, b in PAIRS
    }
    stopped: dict[str, set[str]] = {key: set() for key in pairs}
    step = 0
    limit = MAX_TOKENS + 4 * NUM_PROMPTS * 200 // MAX_BATCHED_TOKENS + 8
    while any(v.engine.has_work() for v in variants.values()) and step < limit:
        for v in variants.values():
            # A step that runs nothing (it only tells the worker of endings) records no rows.
            v.recorder.last = {}
        outputs = {n: {o.request_id: o for o in v.engine.step()} for n, v in variants.items()}
        for a, b in PAIRS:
            key = f"{a}~{b}"
            rows_a, rows_b = variants[a].recorder.last, variants[b].recorder.last
            if rows_a.keys() != rows_b.keys():
                pairs[key]["ok"] = False
                pairs[key]["schedule_mismatch"] = {"step": step, a: sorted(rows_a), b: sorted(rows_b)}
                continue
            worst_delta, worst_scale, worst_rel, rows_ok, compared = 0.0, 0.0, 0.0, True, 0
            for rid in sorted(rows_a):
                if rid in stopped[key]:
                    continue
                compared += 1
                delta, scale, ok = _compare_rows(rows_a[rid], rows_b[rid])
                rows_ok &= ok
                rel = delta / scale if scale > 0 else float("inf")
                if rel >= worst_rel:
                    worst_delta, worst_scale, worst_rel = delta, scale, rel
                token_a = outputs[a][rid].new_token_ids[-1]
                token_b = outputs[b][rid].new_token_ids[-1]
                if token_a == token_b:
                    pairs[key]["identical_tokens"] += 1
                    continue
                ref_row = rows_a[rid].float()
                top2 = ref_row.topk(2).values
                gap = float(ref_row[token_a] - ref_row[token_b])
                threshold = max(TIE_REL * scale, 2 * delta)
                event = {"step": step, "request": rid, a: token_a, b: token_b, "ref_top2_gap": float(top2[0] - top2[1]),
                         "ref_gap_between_tokens": gap, "threshold": threshold, "max_abs_delta": delta}
                stopped[key].add(rid)  # continuations differ from here on
                pairs[key]["near_ties" if gap <= threshold else "mismatches"].append(event)
            pairs[key]["steps"].append({"step": step, "compared": compared, "max_abs": worst_delta,
                                        "max_ref": worst_scale, "rel": worst_rel, "ok": rows_ok})
            pairs[key]["ok"] &= rows_ok
        step += 1
    for key, result in pairs.items():
        result["ok"] = result["ok"] and not result["mismatches"]
        result["worst_rel"] = max((s["rel"] for s in result["steps"]), default=None)
        result["num_steps"] = len(result["steps"])
    unfinished = [n for n, v in variants.items() if v.engine.has_work()]
    graph_steps = {n: [v.recorder.graph_steps, v.recorder.steps] for n, v in variants.items()}
    piecewise_steps = {n: v.recorder.piecewise_steps for n, v in variants.items()}
    used_graphs = graph_steps["triton_graphs"][0] > 0
    # Models whose steps with prefill rows can be captured in pieces must have replayed some.
    graphs_runner = variants["triton_graphs"].recorder.runner
    used_pieces = graphs_runner.piecewise_graphs is None or piecewise_steps["triton_graphs"] > 0
    ok = all(p["ok"] for p in pairs.values()) and not unfinished and used_graphs and used_pieces
    return {"ok": ok, "pairs": pairs, "engine_steps": step, "graph_steps_of_steps": graph_steps,
            "piecewise_steps": piecewise_steps,
            "unfinished": unfinished, "prompt_lengths": [len(p) for p in prompts]}


def _decode_batch(engine: LLMEngine, batch: int, context: int, seed: int) -> list[ScheduledSeq]:
    """`batch` sequences of `context` tokens, all but the last one computed (K/V contents are
    whatever the blocks hold: timing does not depend on them), blocks from the engine's pool."""
    gen = torch.Generator().manual_seed(seed)
    items = []
    for i in range(batch):
        seq = Sequence(f"t{seed}-{i}", torch.randint(0, engine.vocab_size, (context,), generator=gen).tolist(),
                       SamplingParams(max_tokens=1, temperature=0.0))
        if not engine.block_manager.allocate(seq, context):
            raise RuntimeError("not enough free KV blocks for the timing batch")
        seq.num_computed_tokens = context - 1
        items.append(ScheduledSeq(seq, 1, True))
    return items


def _release(engine: LLMEngine, items: list[ScheduledSeq]) -> None:
    for item in items:
        engine.block_manager.free(item.seq)


def part_sync_check(variants: dict[str, Variant]) -> dict[str, Any]:
    result: dict[str, Any] = {"ok": True}
    for name in ("triton_graphs", "triton_eager"):
        if name not in variants:
            result[name] = "engine not built"
            result["ok"] = False
            continue
        engine, execute = variants[name].engine, variants[name].recorder.execute
        decodes = _decode_batch(engine, 4, 300, seed=1)
        prefill = _decode_batch(engine, 1, 100, seed=2)
        prefill[0].seq.num_computed_tokens = 0
        prefill[0] = ScheduledSeq(prefill[0].seq, 100, True)
        checks = {}
        try:
            for label, batch in (("mixed", decodes + prefill), ("decode", decodes)):
                execute(batch)  # first call compiles what this shape needs, outside the check
                torch.cuda.synchronize()
                seqs = [item.seq for item in batch if item.sample]
                torch.cuda.set_sync_debug_mode("error")
                try:
                    engine.sampler.sample_async(execute(batch), seqs)
                    checks[label] = "no host sync"
                except RuntimeError as exc:
                    checks[label] = f"synchronised: {exc}"
                    result["ok"] = False
                finally:
                    torch.cuda.set_sync_debug_mode(0)
                torch.cuda.synchronize()
        finally:
            _release(engine, decodes + prefill)
        result[name] = checks
    return result


def _time_steps(execute: Callable[[list[ScheduledSeq]], torch.Tensor], batch: list[ScheduledSeq],
                iters: int) -> dict[str, float]:
    for _ in range(3):
        execute(batch)
    torch.cuda.synchronize()
    synced = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        execute(batch)
        end.record()
        end.synchronize()
        synced.append(start.elapsed_time(end))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        execute(batch)
    end.record()
    end.synchronize()
    return {"median_ms": round(statistics.median(synced), 4), "min_ms": round(min(synced), 4),
            "pipelined_ms": round(start.elapsed_time(end) / iters, 4)}


def part_timing(variants: dict[str, Variant], iters: int) -> dict[str, Any]:
    result: dict[str, Any] = {"context": TIMING_CONTEXT, "ok": True}
    for batch_size in TIMING_BATCHES:
        row: dict[str, Any] = {}
        for name, v in variants.items():
            items = _decode_batch(v.engine, batch_size, TIMING_CONTEXT, seed=100 + batch_size)
            try:
                graphs = v.recorder.runner.cuda_graphs
                host = prepare_host_inputs(items, v.recorder.runner.block_size)
                row[name] = {**_time_steps(v.recorder.execute, items, iters),
                             "cuda_graph": graphs is not None and graphs.can_run(host)}
            except Exception as exc:  # noqa: BLE001
                row[name] = {"error": f"{type(exc).__name__}: {exc}"}
                result["ok"] = False
            finally:
                _release(v.engine, items)
        result[f"batch_{batch_size}"] = row
    return result


def part_overlap(args: argparse.Namespace, variants: dict[str, Variant]) -> dict[str, Any]:
    """The Triton + CUDA-graph runner driven with overlapped scheduling off and on, and the wall
    time of each run. Requests end by length only, but a finished request's row frees one step
    later with overlap, so later requests are admitted (and their prompts chunked) in other
    steps: for dense models the tokens have come out identical; a divergence is accepted only as
    a near tie (`divergence.judge_divergence`, the off run's log-probabilities), since hybrid
    models' chunked state and batch-shape-dependent matmuls round differently."""
    if "triton_graphs" not in variants:
        return {"ok": False, "error": "triton_graphs engine not built"}
    runner = variants["triton_graphs"].recorder.runner
    vocab = runner.vocab_size
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, vocab, (OVERLAP_PROMPT_LEN,), generator=gen).tolist() for _ in range(OVERLAP_REQUESTS)]
    result: dict[str, Any] = {"requests": OVERLAP_REQUESTS, "prompt_len": OVERLAP_PROMPT_LEN,
                              "output_len": OVERLAP_OUTPUT_LEN}
    tokens: dict[str, dict[str, list[int]]] = {}
    top_logprobs: dict[str, dict[str, list[dict[int, float]]]] = {}
    for mode in ("off", "on", "off", "on"):  # twice each: the first of each pays for warm-up
        engine = LLMEngine(_config(args, VARIANTS["triton_graphs"], mode), runner=runner)
        params = SamplingParams(max_tokens=OVERLAP_OUTPUT_LEN, temperature=0.0, ignore_eos=True,
                                logprobs=TOP_LOGPROBS)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"o{i}", prompt, params)
        got: dict[str, list[int]] = {f"o{i}": [] for i in range(len(prompts))}
        tops: dict[str, list[dict[int, float]]] = {rid: [] for rid in got}
        torch.cuda.synchronize()
        start = time.perf_counter()
        steps = 0
        while engine.has_work():
            for o in engine.step():
                got[o.request_id].extend(o.new_token_ids)
                tops[o.request_id].extend(dict(lp.top) if lp is not None else {} for lp in o.new_logprobs)
            steps += 1
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        tokens[mode] = got
        top_logprobs[mode] = tops
        result[f"overlap_{mode}"] = {"seconds": round(seconds, 4), "steps": steps, "engine_overlap": engine.overlap,
                                     "output_tok_per_s": round(sum(map(len, got.values())) / seconds, 1),
                                     "kv_blocks_used_after": engine.block_manager.num_used_blocks}
    verdicts = {rid: judge_divergence(tokens["off"][rid], tokens["on"][rid], top_logprobs["off"][rid])
                for rid in tokens["off"]}
    diverged = {rid: v for rid, v in verdicts.items() if v is not None}
    mismatched = [rid for rid, v in diverged.items() if not v["near_tie"]]
    result["identical_requests"] = len(verdicts) - len(diverged)
    result["near_tie_requests"] = [rid for rid, v in diverged.items() if v["near_tie"]]
    result["mismatched_requests"] = mismatched
    result["first_divergences"] = [
        {"request": rid, "position": v["position"], "gap_nats": v["gap_nats"], "near_tie": v["near_tie"]}
        for rid, v in list(diverged.items())[:12]
    ]
    result["speedup"] = round(result["overlap_off"]["seconds"] / result["overlap_on"]["seconds"], 3)
    complete = all(len(t) == OVERLAP_OUTPUT_LEN for t in tokens["on"].values())
    result["ok"] = (not mismatched and complete and result["overlap_on"]["engine_overlap"]
                    and result["overlap_on"]["kv_blocks_used_after"] == 0)
    return result


def _table(report: dict[str, Any]) -> str:
    parts = report["parts"]
    lines = [f"{'part':<34} {'ok':<6} detail", "-" * 96]
    for name in ("build", "parity", "sync_check", "timing", "overlap"):
        part = parts.get(name, {})
        detail = part.get("error", "") or part.get("problem", "")
        lines.append(f"{name:<34} {str(part.get('ok')):<6} {detail}"[:160])
    for key, pair in parts.get("parity", {}).get("pairs", {}).items():
        worst = pair.get("worst_rel")
        lines.append(
            f"  {key:<32} {str(pair['ok']):<6} steps={pair['num_steps']} worst_rel="
            f"{worst if worst is None else round(worst, 5)} same_tokens={pair['identical_tokens']} "
            f"near_ties={len(pair['near_ties'])} mismatches={len(pair['mismatches'])}"
        )
    sync = parts.get("sync_check", {})
    for name in ("triton_graphs", "triton_eager"):
        if isinstance(sync.get(name), dict):
            lines.append(f"  sync {name:<27} {'':<6} {sync[name]}"[:160])
    timing = parts.get("timing", {})
    for batch_size in TIMING_BATCHES:
        row = timing.get(f"batch_{batch_size}", {})
        cells = [
            f"{n}={r['median_ms']:.3f}ms (pipelined {r['pipelined_ms']:.3f}{', graph' if r.get('cuda_graph') else ''})"
            if "median_ms" in r else f"{n}=error" for n, r in row.items()
        ]
        lines.append(f"  decode batch {batch_size:<3} ctx {TIMING_CONTEXT:<14} {'':<6} " + "; ".join(cells))
    overlap = parts.get("overlap", {})
    if "speedup" in overlap:
        lines.append(
            f"  overlap {overlap['requests']}x{overlap['prompt_len']}+{overlap['output_len']} greedy: off "
            f"{overlap['overlap_off']['output_tok_per_s']:.0f} tok/s, on {overlap['overlap_on']['output_tok_per_s']:.0f} "
            f"tok/s ({overlap['speedup']}x), identical {overlap['identical_requests']}, near ties "
            f"{len(overlap['near_tie_requests'])}, mismatched {len(overlap['mismatched_requests'])}"
        )
    lines.append(f"overall ok: {report['ok']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for model_parity.json")
    parser.add_argument("--model", default="dummy:qwen3-0.6b")
    parser.add_argument("--timing-iters", type=int, default=30)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        from tandem.logging_setup import configure_logging

        configure_logging("warning", json=False)
    except Exception:  # noqa: BLE001 - logging set-up is a nicety here
        pass

    report: dict[str, Any] = {"model": args.model, "environment": _environment(), "parts": {},
                              "tolerances": {"logit_rel": LOGIT_TOL, "near_tie_rel": TIE_REL}}
    variants: dict[str, Variant] = {}
    if not torch.cuda.is_available():
        report["parts"]["build"] = {"ok": False, "error": "no CUDA device visible to torch"}
    else:
        _guarded(report, "build", lambda: part_build(args, variants))
        _guarded(report, "parity", lambda: part_parity(variants))
        _guarded(report, "sync_check", lambda: part_sync_check(variants))
        _guarded(report, "timing", lambda: part_timing(variants, args.timing_iters))
        _guarded(report, "overlap", lambda: part_overlap(args, variants))
        report["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    report["ok"] = all(p.get("ok") for p in report["parts"].values()) and len(report["parts"]) == 5
    (args.out / "model_parity.json").write_text(json.dumps(report, indent=2, default=str))
    print(_table(report), flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
