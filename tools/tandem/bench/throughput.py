"""`tandem bench throughput`: offline throughput of the in-process engine against the HF peer.

One call, one model, one workload:

1. The engine (`LLMEngine`, dummy weights, with the serving warm-up of `warmup.py` on CUDA) warms up on
   unrelated requests spanning the workload's lengths, then runs
   the whole workload submitted at once: output tok/s and total tok/s, vLLM-style.
2. When the peer runs on a subset (`peer_num_prompts`, because transformers is slower), the
   engine runs that same subset too (prefix cache reset first), so the ratio compares equal
   work; the full-workload figure stays the headline.
3. The engine's caches are shrunk (KV pools, state pools), a Hugging Face model is built from
   the same config, the engine's weights are copied into it and checked on one prompt
   (`peer_check.py`: end to end, and layer by layer teacher-forced),
   the engine is freed, and the peer runs the same requests (`hf_peer.py`): through transformers'
   continuous batching, or, for models it cannot serve (hybrids), static `generate` batches; the
   result's `peer.mode` / `peer.mode_reason` say which and why.

ratio = engine output tok/s / peer output tok/s on the same requests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog

from tandem.bench.engine_run import reset_prefix_cache, run_engine, warm_up
from tandem.bench.results import BenchRecord, Deadline
from tandem.bench.workloads import BenchRequest, Workload, make_workload, warmup_filling_steps, warmup_prompt_lens, \
    warmup_requests

log = structlog.get_logger(__name__)


@dataclass
class ThroughputOptions:
    """Workload selection and the peer's share of the run."""

    workload: str = "nanovllm"
    num_prompts: int | None = None
    scale: float = 1.0
    peer: bool = True
    peer_num_prompts: int | None = None  # None: the whole workload
    warmup_requests: int = 8
    peer_cb_config: dict[str, Any] | None = None  # ContinuousBatchingConfig fields for the peer
    peer_static_batch_size: int = 64  # requests per generate batch, for models CB cannot serve
    engine_share: float = 0.45  # of the time left, for the engine's full-workload run (with a peer)


def engine_warmup(vocab_size: int, workload: Workload, count: int, max_model_len: int,
                  step_tokens: int) -> list[BenchRequest]:
    """Warm-up requests whose prompts span the workload's lengths from 32 tokens, on and off the
    16 grid (`warmup_prompt_lens`), and enough of them to fill two steps of `step_tokens`
    (`warmup_filling_steps`): the kernel variants of the timed run's shapes compile here, not
    inside it. Prompts stay within `max_model_len` with their 8 output tokens."""
    output_len = 8
    lens = warmup_prompt_lens(workload.requests, cap=max_model_len - output_len)
    return warmup_filling_steps(vocab_size, lens, count, step_tokens, output_len=output_len)


def engine_info(engine: Any) -> dict[str, Any]:
    """The engine as configured: runner path, KV capacity and scheduler limits."""
    from tandem.bench.roofline import describe_runner

    sc = engine.config.scheduler
    return {
        **describe_runner(engine.runner),
        "kv_capacity_tokens": engine.kv_capacity_tokens,
        "max_model_len": engine.max_model_len,
        "max_num_seqs": sc.max_num_seqs,
        "max_num_batched_tokens": sc.max_num_batched_tokens,
        "prefix_caching": engine.config.cache.enable_prefix_caching,
    }


def run_throughput(record: BenchRecord, engine_config: Any, options: ThroughputOptions, deadline: Deadline) -> None:
    """Fill `record.results` with the engine's figures, the peer's and their ratio."""
    from tandem.engine_service.core.warmup import serving_engine

    res = record.results
    res["options"] = dict(vars(options))
    engine = None
    with record.stage("build_engine"):
        t0 = time.monotonic()
        engine = serving_engine(engine_config)  # warmed up as `tandem serve` warms it (CUDA)
        res["engine"] = {**engine_info(engine), "build_s": round(time.monotonic() - t0, 2)}
    if engine is None:
        return
    workload = make_workload(options.workload, engine.vocab_size, options.num_prompts, options.scale,
                             max_model_len=engine.max_model_len)
    res["workload"] = workload.describe()
    peer_workload = workload
    if options.peer and options.peer_num_prompts is not None and options.peer_num_prompts < len(workload.requests):
        peer_workload = workload.head(options.peer_num_prompts)

    with record.stage("warmup"):
        warm = engine_warmup(engine.vocab_size, workload, options.warmup_requests, engine.max_model_len,
                             engine.config.scheduler.max_num_batched_tokens)
        res["engine"]["warmup"] = warm_up(engine, warm, deadline.sub(fraction=0.2))
    with record.stage("engine"):
        run = run_engine(engine, workload.requests, deadline=deadline.sub(fraction=options.engine_share if options.peer else 1.0))
        res["ours"] = run.summary()
        record.incomplete |= run.timed_out
    ours_matched = res.get("ours")
    if peer_workload is not workload:
        with record.stage("engine_on_peer_subset"):
            reset_prefix_cache(engine)
            run = run_engine(engine, peer_workload.requests, deadline=deadline.sub(fraction=0.35), id_prefix="subset")
            res["ours_on_peer_subset"] = {**run.summary(), "workload": peer_workload.describe()}
            ours_matched = res["ours_on_peer_subset"]
            record.incomplete |= run.timed_out

    if not options.peer:
        res["peer"] = {"status": "not run (--no-peer)"}
        return
    hf = _prepare_peer(record, engine, engine_config)
    del engine
    if hf is None:
        return
    from tandem.bench.hf_peer import release_device_memory, run_hf_peer

    release_device_memory()
    with record.stage("peer"):
        cb = options.peer_cb_config
        if cb is None and hf.device.type == "cpu":
            cb = _small_cb_config(peer_workload)  # auto-sizing from host RAM is slow and pointless here
        peer = run_hf_peer(hf, peer_workload.requests, deadline,
                           warmup_requests(peer_workload.params["vocab_size"], min(options.warmup_requests, 4)), cb,
                           static_batch_size=options.peer_static_batch_size)
        peer["workload"] = peer_workload.describe()
        peer["subset_of_workload"] = peer_workload is not workload
        res["peer"] = {**res.get("peer", {}), **peer}
        record.incomplete |= peer["timed_out"]
        if ours_matched and peer["output_tokens_per_s"] > 0:
            res["ratio"] = {
                "output_tokens_per_s": ours_matched["output_tokens_per_s"] / peer["output_tokens_per_s"],
                "total_tokens_per_s": ours_matched["total_tokens_per_s"] / peer["total_tokens_per_s"],
                "on": "peer subset" if peer_workload is not workload else "full workload",
                "num_requests": len(peer_workload.requests),
                "comparable": not (ours_matched.get("timed_out") or peer["timed_out"]),
            }
    del hf
    release_device_memory()


def _prepare_peer(record: BenchRecord, engine: Any, engine_config: Any) -> Any:
    """Free the engine's caches, build the HF twin, copy weights, check logits; returns it."""
    from tandem.bench.hf_peer import build_hf_model, copy_weights_to_hf, release_device_memory
    from tandem.bench.peer_check import capture_engine_layers, compare_logits, hf_last_logits, is_routed, \
        teacher_forced_check, verdict
    from tandem.bench.roofline import PlannedBatch, fake_plan, make_worker, num_paged_groups, num_state_slots
    from tandem.engine_service.worker.loader import resolve_model

    res = record.results
    runner = engine.runner
    prompt_len = 16
    small_blocks = -(-prompt_len // runner.block_size) + 1
    with record.stage("peer_release_engine_kv"):
        # The pool took most free memory; the HF model and its own cache need it back. The
        # captured graphs hold the pool (and their own memory pool) too: they go first.
        if getattr(runner, "cuda_graphs", None) is not None:
            runner.cuda_graphs = None
        if getattr(runner, "piecewise_graphs", None) is not None:
            runner.piecewise_graphs = None
        res.setdefault("engine", {})["caches_after_peer_release"] = shrink_engine_caches(runner, small_blocks, 1)
        release_device_memory()
    hf = None
    with record.stage("peer_build"):
        resolved = resolve_model(engine_config.model.model, engine_config.model.cache_dir)
        t0 = time.monotonic()
        hf = build_hf_model(resolved.config, runner.device, runner.dtype)
        copied = copy_weights_to_hf(runner.model, hf)
        res["peer"] = {"weights": {**copied, "source": "engine model tensors copied into the HF model"},
                       "build_s": round(time.monotonic() - t0, 2),
                       "dtype": str(runner.dtype).removeprefix("torch.")}
    if hf is None:
        return None
    with record.stage("peer_verify"):
        rng = np.random.default_rng(1234)
        plan, _ = fake_plan(1, prompt_len, prompt_len, runner.block_size, runner.num_blocks, runner.vocab_size, rng,
                            num_groups=num_paged_groups(runner), num_state_slots=num_state_slots(runner))
        planned = PlannedBatch(make_worker(runner), plan)
        ours, states = capture_engine_layers(runner.model.model.layers, planned.execute)
        planned.release()
        prompt = plan.new_requests[0].token_ids
        check = compare_logits(ours[0], hf_last_logits(hf, prompt), runner.dtype)
        layers = teacher_forced_check(hf, prompt, states, ours[0], runner.dtype)
        judged = verdict(check, layers, is_routed(resolved.config))
        res["peer"]["weights"].update(logits_check=check, layer_check=layers, **judged)
        if not judged["verified"]:
            raise AssertionError(f"engine and HF disagree on the same weights ({judged['rule']}): "
                                 f"end to end {check}, layers {layers}")
    return hf


def shrink_engine_caches(runner: Any, num_blocks: int, num_slots: int) -> dict[str, Any]:
    """Replace every cache tensor of `runner` by a small zeroed one, so the HF peer gets the memory
    back: paged K/V (`[2, blocks, ...]`) and latent (`[blocks, ...]`) tensors keep `num_blocks`
    blocks (the last one is then the scratch block), state pools `num_slots` request slots plus
    the scratch slot (no checkpoint slots); layers without a cache stay None. The memory plan is
    replaced to match, so `num_state_slots(runner)` and the scratch slot describe what is left.
    Only for a runner whose CUDA graphs are already dropped (they hold the old tensors)."""
    import dataclasses

    import torch

    tensors = runner.cache_tensors

    def small(t: torch.Tensor, dim: int, n: int) -> torch.Tensor:
        shape = list(t.shape)
        shape[dim] = n
        return torch.zeros(shape, dtype=t.dtype, device=t.device)

    runner.kv_caches = [None if t is None else small(t, 1, num_blocks) for t in runner.kv_caches]
    tensors.latent = {layer: small(t, 0, num_blocks) for layer, t in tensors.latent.items()}
    tensors.state = {group: {layer: [small(t, 0, num_slots + 1) for t in pools] for layer, pools in layers.items()}
                     for group, layers in tensors.state.items()}
    plan = getattr(runner, "memory_plan", None)
    if plan is not None:
        groups = tuple(dataclasses.replace(g, num_blocks=num_blocks - 1) if g.paged
                       else dataclasses.replace(g, num_slots=num_slots, num_checkpoint_slots=0) for g in plan.groups)
        runner.memory_plan = dataclasses.replace(plan, groups=groups)
    runner.num_blocks = runner.scratch_block = num_blocks - 1
    return {"blocks_per_paged_group": num_blocks, "state_slots": num_slots if tensors.state else 0,
            "bytes": tensors.total_bytes()}


def _small_cb_config(workload: Workload) -> dict[str, Any]:
    block = 32
    blocks = sum(-(-(len(r.prompt_token_ids) + r.output_len) // block) for r in workload.requests) + 4
    return {"block_size": block, "num_blocks": blocks, "max_batch_tokens": 512}


def short_table(results: dict[str, Any]) -> list[str]:
    """Terminal summary: engine and peer throughput and their ratio."""
    lines = []
    w = results.get("workload", {})
    lines.append(f"workload {w.get('name')}: {w.get('num_requests')} requests, {w.get('input_tokens')} input / "
                 f"{w.get('output_tokens')} output tokens")
    peer_label = {"generate_static_batches": "HF generate (static)"}.get(
        results.get("peer", {}).get("mode"), "HF continuous batching")
    for key, label in (("ours", "tandem engine"), ("ours_on_peer_subset", "tandem (peer subset)"),
                       ("peer", peer_label)):
        r = results.get(key)
        if not r or "output_tokens_per_s" not in r:
            continue
        lines.append(f"{label:<24} {r['requests_per_s']:8.2f} req/s {r['total_tokens_per_s']:10.1f} total tok/s "
                     f"{r['output_tokens_per_s']:10.1f} output tok/s  ({r['completed']}/{r['num_requests']} done"
                     f"{', TIMED OUT' if r.get('timed_out') else ''})")
    ratio = results.get("ratio")
    if ratio:
        lines.append(f"ratio (ours / peer, output tok/s, {ratio['on']}): {ratio['output_tokens_per_s']:.2f}x"
                     f"{'' if ratio['comparable'] else '  (not comparable: a side timed out)'}")
    else:
        lines.append(f"ratio: not measured ({results.get('peer', {}).get('status', 'peer failed')})")
    return lines
