"""`tandem bench roofline`: decode step time and prefill MFU against ceilings measured in the same run.

1. Ceilings: HBM bandwidth (a large device-to-device copy, bytes read + written) and the bf16
   matmul rate (8192^3 on random data), medians of CUDA-event-timed runs.
2. The engine's own `ModelRunner` (dummy weights, the KV pool sized to what the sweep needs)
   runs fake batches built directly on the paged cache, driven as the engine drives it: a step
   plan (`step_plan.StepPlan`) of new requests, each with a consecutive range of block ids
   covering its context (the same table in every paged cache group; with a sliding window on
   every layer only the window's blocks, the entries before it `NULL_BLOCK`, as the block
   manager leaves them), applied to a `StepWorker`'s rows — no scheduler or block manager.
3. Decode: one new token per sequence at each (batch, context) point, timed through
   `StepWorker.execute` (host inputs from the rows + forward + logits; CUDA-graph replay when
   the runner does it). Floor = (weight bytes + KV bytes + state bytes) / measured bandwidth
   (`accounting.py`; windowed layers count only the window's K/V; MoE layers only the routed
   experts a batch is expected to touch under uniform routing, `E(1-(1-k/E)^B)`; hybrid models
   K/V of their attention layers only, and each sequence's state slot read and written back).
   In a hybrid model every sequence holds its own state slot (`fake_plan`'s `num_state_slots`);
   a decode continues whatever the slot holds, which does not change the work.
4. Prefill: one batch of fresh sequences (e.g. 8 x 1024 = 8k tokens); MFU = FLOPs / time /
   measured matmul rate.

A point whose KV does not fit the pool is recorded as skipped (or, with `kv_aliasing`, run
with sequences sharing blocks and flagged: the floor then counts bytes that caches may serve).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog
import torch

from tandem.bench.accounting import (
    attention_windows,
    decode_experts_read,
    decode_floor_s,
    decode_kv_bytes,
    decode_state_bytes,
    decode_weight_bytes,
    fp8_bytes_per_weight,
    kv_bytes_per_token,
    prefill_flops,
    shape_from_hf_config,
    state_bytes_per_request,
    total_params,
)
from tandem.bench.results import BenchRecord, Deadline
from tandem.bench.timing import cuda_time, require_cuda

log = structlog.get_logger(__name__)

GIB = 1 << 30


@dataclass
class RooflineOptions:
    """What to sweep and how long each measurement may take."""

    batches: list[int] = field(default_factory=lambda: [1, 16, 64, 128, 256])
    contexts: list[int] = field(default_factory=lambda: [1024, 8192])
    prefill_shapes: list[tuple[int, int]] = field(default_factory=lambda: [(8, 1024), (1, 8192)])
    copy_bytes: int = 2 * GIB  # per buffer; bytes moved per copy = 2x
    matmul_n: int = 8192
    point_seconds: float = 6.0  # timing budget of one decode/prefill point (warm-up included)
    ceiling_seconds: float = 8.0  # timing budget of each ceiling measurement
    reps: int = 30
    headroom_gib: float = 16.0  # device memory left free beside weights + KV (activations, graphs)
    kv_aliasing: bool = False
    seed: int = 0


# -- ceilings ------------------------------------------------------------------------------------


def measure_hbm_bandwidth(device: torch.device | str | None, nbytes: int = 2 * GIB, reps: int = 30,
                          budget_s: float = 8.0) -> dict[str, Any]:
    """Device-to-device copy of `nbytes` (clamped to a quarter of free memory each way):
    bandwidth = (bytes read + bytes written) / median time."""
    dev = require_cuda(device, "HBM bandwidth measurement")
    free, _ = torch.cuda.mem_get_info(dev)
    nbytes = int(min(nbytes, free // 4)) // 4096 * 4096
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=dev).normal_()
    dst = torch.empty_like(src)
    try:
        t = cuda_time(lambda: dst.copy_(src), dev, warmup=3, reps=reps, budget_s=budget_s)
    finally:
        del src, dst
        torch.cuda.empty_cache()
    moved = 2 * nbytes
    median_s = t.median_ms / 1e3
    return {
        "method": "device-to-device copy_ of a float32 buffer; bytes read + written",
        "buffer_bytes": nbytes,
        "bytes_moved": moved,
        "bytes_per_s": moved / median_s,
        "best_bytes_per_s": moved / (min(t.runs_ms) / 1e3),
        **t.as_dict(),
    }


def measure_matmul_rate(device: torch.device | str | None, n: int = 8192, dtype: torch.dtype = torch.bfloat16,
                        reps: int = 30, budget_s: float = 8.0) -> dict[str, Any]:
    """`n x n @ n x n` in `dtype` on random data: FLOP/s = 2 n^3 / median time."""
    dev = require_cuda(device, "matmul rate measurement")
    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    a = torch.randn(n, n, device=dev, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=dev, dtype=dtype, generator=gen)
    c = torch.empty(n, n, device=dev, dtype=dtype)
    try:
        t = cuda_time(lambda: torch.matmul(a, b, out=c), dev, warmup=5, reps=reps, budget_s=budget_s)
    finally:
        del a, b, c
        torch.cuda.empty_cache()
    flops = 2 * n**3
    return {
        "method": f"torch.matmul {n}x{n}x{n} {str(dtype).removeprefix('torch.')} random normal",
        "n": n,
        "flops": flops,
        "flops_per_s": flops / (t.median_ms / 1e3),
        "best_flops_per_s": flops / (min(t.runs_ms) / 1e3),
        **t.as_dict(),
    }


# -- fake batches on the paged cache ---------------------------------------------------------------


def live_blocks_per_seq(context: int, num_new_tokens: int, block_size: int, window: int | None) -> tuple[int, int]:
    """(table length, blocks a sequence holds) for `context` tokens whose last `num_new_tokens`
    run; with `window` (every layer windowed) the blocks before the first query's window are
    given back, as the block manager does."""
    width = -(-context // block_size)
    first = 0 if window is None else max(0, context - num_new_tokens - window + 1) // block_size
    return width, width - first


class StateSlotsExceeded(ValueError):
    """A fake batch has more sequences than the runner has state slots."""


def fake_plan(num_seqs: int, context: int, num_new_tokens: int, block_size: int, num_blocks: int,
              vocab_size: int, rng: np.random.Generator, alias: bool = False, tag: str = "",
              window: int | None = None, num_groups: int = 1, num_state_slots: int = 0) -> tuple[Any, bool]:
    """A step plan of `num_seqs` new requests of `context` tokens whose last `num_new_tokens`
    are to be run (the rest counted as computed).

    Request i owns blocks `[i*n, (i+1)*n)` with n = ceil(context / block_size) — with `window`
    (a model whose every layer is windowed) only the blocks its queries can see, the entries
    before them given back (`NULL_BLOCK`). Every one of `num_groups` paged groups gets the same
    table (the roofline sizes every group's pool alike). Returns the plan and whether blocks
    had to be shared (only with `alias`; otherwise a pool too small raises `ValueError`).

    A model with state groups (`num_state_slots` > 0, see `num_state_slots`) gets request i in
    state slot i: distinct slots, never shared (state is per request, so there is no aliasing);
    more sequences than slots raise `StateSlotsExceeded` (a `ValueError`). A decode request
    continues whatever its slot holds (`num_computed_tokens > 0`), which is fine for timing.
    """
    from tandem.core_protocol import SamplingParams
    from tandem.engine_service.cache.block_manager import NULL_BLOCK
    from tandem.engine_service.step_plan import NewRequest, StepPlan

    width, per_seq = live_blocks_per_seq(context, num_new_tokens, block_size, window)
    if per_seq > num_blocks:
        raise ValueError(f"one sequence of {context} tokens needs {per_seq} blocks; the pool has {num_blocks}")
    aliased = num_seqs * per_seq > num_blocks
    if aliased and not alias:
        raise ValueError(f"{num_seqs} x {context} tokens need {num_seqs * per_seq} blocks; the pool has {num_blocks}")
    if num_state_slots and num_seqs > num_state_slots:
        raise StateSlotsExceeded(f"{num_seqs} sequences need {num_seqs} state slots; the runner has {num_state_slots}")
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    requests = []
    for i in range(num_seqs):
        first = (i * per_seq) % num_blocks if aliased else i * per_seq
        if first + per_seq > num_blocks:
            first = 0
        table = [NULL_BLOCK] * (width - per_seq) + list(range(first, first + per_seq))
        requests.append(NewRequest(
            request_id=f"roofline{tag}-{i}",
            token_ids=rng.integers(0, vocab_size, size=context).tolist(),
            num_prompt_tokens=context,
            sampling_params=params,
            eos_token_ids=[],
            block_ids=[list(table) for _ in range(num_groups)],
            num_computed_tokens=context - num_new_tokens,
            num_scheduled_tokens=num_new_tokens,
            sample=True,
            state_slot=i if num_state_slots else None,
        ))
    return StepPlan(step_id=0, new_requests=requests, num_cache_groups=num_groups), aliased


class PlannedBatch:
    """A fake plan applied to a worker's rows for one measurement point; `release()` drops
    the rows again (with a plan of drops, as the engine would)."""

    def __init__(self, worker: Any, plan: Any) -> None:
        from tandem.engine_service.step_plan import StepPlan

        self.worker = worker
        self.batch = worker.rows.apply(plan)
        self._drop = StepPlan(step_id=plan.step_id + 1, finished_req_ids=plan.batch_request_ids(),
                              num_cache_groups=plan.num_cache_groups)

    def execute(self) -> torch.Tensor:
        return self.worker.execute(self.batch)

    def host_inputs(self) -> Any:
        from tandem.engine_service.worker.worker_rows import host_inputs_from_rows

        return host_inputs_from_rows(self.batch, self.worker.runner.block_size)

    def release(self) -> None:
        self.worker.rows.apply(self._drop)


def make_worker(runner: Any) -> Any:
    """The engine's worker over `runner`, with a row table per paged cache group (its sampler
    is never called here)."""
    from tandem.engine_service.worker.sampler import Sampler
    from tandem.engine_service.worker.worker import StepWorker

    return StepWorker(runner, Sampler(vocab_size=runner.vocab_size), num_paged_groups(runner))


# -- the runner ----------------------------------------------------------------------------------


def describe_runner(runner: Any) -> dict[str, Any]:
    """What `StepWorker.execute` runs: attention backend and the captured CUDA graphs, if any."""
    backend = getattr(runner, "attention_backend", None)
    if backend is None:
        for module in runner.model.modules():
            b = getattr(module, "backend", None)
            if b is not None:
                backend = getattr(b, "name", type(b).__name__)
                break
    graphs = getattr(runner, "cuda_graphs", None)
    return {
        "timed": "StepWorker.execute(batch): host inputs from the worker's rows + (graph replay | eager forward) "
                 "+ float32 logits; no sampling",
        "runner_class": f"{type(runner).__module__}.{type(runner).__qualname__}",
        "model_class": type(runner.model).__name__,
        "attention_backend": backend,
        "cuda_graph_sizes": list(getattr(graphs, "captured_sizes", [])) if graphs is not None else None,
        "block_size": runner.block_size,
        "num_blocks": runner.num_blocks,
        "memory_plan": runner.memory_plan.as_dict() if hasattr(runner, "memory_plan") else None,
        "max_model_len": getattr(runner, "max_model_len", None),
        "dtype": str(runner.dtype).removeprefix("torch."),
    }


def decode_path(runner: Any, planned: PlannedBatch) -> str:
    """`cuda graph replay` when the runner will replay a graph for this batch, else `eager`."""
    graphs = getattr(runner, "cuda_graphs", None)
    if graphs is None:
        return "eager"
    try:
        return "cuda graph replay" if graphs.can_run(planned.host_inputs()) else "eager"
    except Exception:  # noqa: BLE001 - informative only
        return "unknown"


def replay_only(runner: Any, planned: PlannedBatch) -> Callable[[], None] | None:
    """The bare `graph.replay` of this batch's bucket (buffers filled by one `execute` first):
    the step's GPU time without host input preparation. None without a captured graph."""
    graphs = getattr(runner, "cuda_graphs", None)
    if graphs is None:
        return None
    try:
        from tandem.engine_service.worker.cuda_graphs import bucket_for

        bucket = bucket_for(len(planned.batch), list(graphs.captured_sizes))
        graph = getattr(graphs, "_graphs", {}).get(bucket)
    except Exception:  # noqa: BLE001 - the figure is optional
        return None
    if graph is None:
        return None
    planned.execute()
    return graph.replay


def num_paged_groups(runner: Any) -> int:
    """The runner's paged cache groups (stand-in runners without a memory plan: one)."""
    plan = getattr(runner, "memory_plan", None)
    return len(plan.paged_groups) if plan is not None else 1


def num_state_slots(runner: Any) -> int:
    """The runner's request state slots (0 for a model without state groups, or a stand-in
    runner without a memory plan): what `fake_plan`'s `num_state_slots` takes."""
    plan = getattr(runner, "memory_plan", None)
    return plan.num_state_slots if plan is not None else 0


def module_param_count(model: torch.nn.Module) -> int:
    """Parameters of the built module, tied ones once."""
    return sum(p.numel() for p in model.parameters())


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _fp8_block(model: torch.nn.Module) -> tuple[int, int] | None:
    """The block of the model's FP8 weights (`--quantization`), None when none is FP8."""
    from tandem.engine_service.layers.fp8 import scale_of

    return next((found[1] for found in map(scale_of, model.parameters()) if found is not None), None)


def _matmul_bytes(model: torch.nn.Module, shape: Any) -> float | None:
    """Bytes per projection weight as the model stores them: FP8 plus its scales, or None (the
    model dtype), for the floor's weight bytes."""
    block = _fp8_block(model)
    return None if block is None else fp8_bytes_per_weight(block, shape.hidden_size)


def uniform_window(shape: Any) -> int | None:
    """The window when every attention layer attends over the same one (so whole blocks can be
    given back), else None."""
    windows = set(attention_windows(shape))
    return windows.pop() if len(windows) == 1 else None


def plan_num_blocks(shape: Any, dtype_bytes: int, block_size: int, options: RooflineOptions,
                    free_bytes: int, max_model_len: int, num_state_slots: int = 0,
                    weight_bytes: int | None = None) -> dict[str, int]:
    """KV blocks to allocate (per paged group): enough for the largest point, at most what memory
    allows once the weights (`weight_bytes`; None: every parameter in the model dtype), the
    headroom and `num_state_slots` request state slots (plus the scratch slot) are set aside."""
    per_block = kv_bytes_per_token(shape, dtype_bytes) * block_size
    contexts = [c for c in options.contexts if c <= max_model_len]
    window = uniform_window(shape)
    need = max([b * live_blocks_per_seq(c, 1, block_size, window)[1] for b in options.batches for c in contexts]
               + [n * -(-L // block_size) for n, L in options.prefill_shapes] + [2])
    weights = total_params(shape) * dtype_bytes if weight_bytes is None else weight_bytes
    state = (num_state_slots + 1) * state_bytes_per_request(shape, dtype_bytes) if num_state_slots else 0
    budget = free_bytes - weights - state - int(options.headroom_gib * GIB)
    fit = max(budget // per_block, 0)
    return {"needed_blocks": need, "fit_blocks": int(fit), "num_blocks": int(max(min(need, fit), 2)),
            "bytes_per_block": per_block, "state_pool_bytes": state, "weight_bytes": int(weights)}


# -- the sweep -----------------------------------------------------------------------------------


def run_roofline(record: BenchRecord, engine_config: Any, options: RooflineOptions, deadline: Deadline) -> None:
    """Fill `record.results` with ceilings, decode points and prefill points (errors recorded)."""
    from tandem.engine_service.worker.loader import planned_weight_bytes, resolve_model
    from tandem.engine_service.worker.model_runner import ModelRunner, resolve_device

    device = require_cuda(resolve_device(engine_config.model.device), "tandem bench roofline")
    res = record.results
    res["options"] = {k: v for k, v in vars(options).items()}

    with record.stage("bandwidth"):
        res["bandwidth"] = measure_hbm_bandwidth(device, options.copy_bytes, options.reps, options.ceiling_seconds)
    with record.stage("matmul"):
        res["matmul"] = measure_matmul_rate(device, options.matmul_n, torch.bfloat16, options.reps,
                                            options.ceiling_seconds)
    bandwidth = res.get("bandwidth", {}).get("bytes_per_s")
    matmul_rate = res.get("matmul", {}).get("flops_per_s")

    resolved = resolve_model(engine_config.model.model, engine_config.model.cache_dir)
    shape = shape_from_hf_config(resolved.config)
    dtype_name = engine_config.model.dtype
    dtype = {"float32": torch.float32, "float16": torch.float16}.get(dtype_name, torch.bfloat16)
    dtype_bytes = _dtype_bytes(dtype)
    max_len = engine_config.model.max_model_len or resolved.config.get("max_position_embeddings", 1 << 30)
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    engine_config.scheduler.max_num_seqs = max(engine_config.scheduler.max_num_seqs, max(options.batches))
    engine_config.scheduler.max_num_batched_tokens = max(
        engine_config.scheduler.max_num_batched_tokens, max(n * L for n, L in options.prefill_shapes))
    # Fake batches never hit the prefix cache: a model with state would only lose memory to
    # state checkpoint slots (and the state slots, one per max_num_seqs, are planned for below).
    engine_config.cache.enable_prefix_caching = False
    slots = engine_config.scheduler.max_num_seqs if state_bytes_per_request(shape, dtype_bytes) else 0
    # The weights as they will be built: FP8 layers (`--quantization`) take about half.
    weights = planned_weight_bytes(resolved, device, dtype, engine_config.model.attention_backend,
                                   engine_config.model.quantization)
    plan = plan_num_blocks(shape, dtype_bytes, engine_config.cache.block_size, options, free, max_len, slots,
                           weights)
    res["kv_plan"] = {**plan, "free_bytes_before_model": free, "device_total_bytes": total,
                      "prefix_caching": "off (fake batches; no state checkpoint slots)"}
    if engine_config.cache.num_blocks is None:  # --num-kv-blocks, when given, wins
        engine_config.cache.num_blocks = plan["num_blocks"]
    res["kv_plan"]["allocated_blocks"] = engine_config.cache.num_blocks

    runner = None
    with record.stage("build_runner", reraise=False):
        t0 = time.monotonic()
        runner = ModelRunner(engine_config)
        res["runner"] = describe_runner(runner)
        res["runner"]["build_s"] = round(time.monotonic() - t0, 2)
        built = module_param_count(runner.model)
        res["accounting"] = {
            "shape": {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for k, v in vars(shape).items()},
            "dtype_bytes": dtype_bytes,
            "params_from_config": total_params(shape),
            "params_in_module": built,
            "kv_bytes_per_token": kv_bytes_per_token(shape, dtype_bytes),
            "state_bytes_per_request": state_bytes_per_request(shape, dtype_bytes),
            "fp8_block": _fp8_block(runner.model),
            "matmul_bytes_per_weight": _matmul_bytes(runner.model, shape),
            "decode_weight_bytes_batch1": decode_weight_bytes(shape, 1, dtype_bytes,
                                                              _matmul_bytes(runner.model, shape)),
        }
        if built != total_params(shape):
            log.warning("parameter count differs from the config's", module=built, config=total_params(shape))
    if runner is None:
        return
    dtype_bytes = _dtype_bytes(runner.dtype)
    rng = np.random.default_rng(options.seed)
    worker = make_worker(runner)

    # Time for the prefill points is set aside, so a slow decode sweep cannot starve them.
    reserve = len(options.prefill_shapes) * options.point_seconds
    decode_deadline = Deadline(max(deadline.remaining() - reserve, 0.0)) if math.isfinite(deadline.end) else deadline
    res["decode"] = []
    for context in options.contexts:
        for batch in options.batches:
            res["decode"].append(_decode_point(worker, shape, dtype_bytes, batch, context, bandwidth, options,
                                               decode_deadline, rng, max_len, record,
                                               _matmul_bytes(runner.model, shape)))
    res["prefill"] = []
    for num_seqs, seq_len in options.prefill_shapes:
        res["prefill"].append(_prefill_point(worker, shape, num_seqs, seq_len, matmul_rate, options, deadline, rng,
                                             max_len, record))
    if any(p.get("status") == "skipped" and p.get("reason", "").startswith("time") for p in
           res["decode"] + res["prefill"]):
        record.incomplete = True


def _point_base(**kw: Any) -> dict[str, Any]:
    return {"status": "ok", **kw}


def _decode_point(worker: Any, shape: Any, dtype_bytes: int, batch: int, context: int,
                  bandwidth: float | None, options: RooflineOptions, deadline: Deadline, rng: np.random.Generator,
                  max_len: int, record: BenchRecord, matmul_bytes: float | None = None) -> dict[str, Any]:
    weight_bytes = decode_weight_bytes(shape, batch, dtype_bytes, matmul_bytes)
    kv_bytes = decode_kv_bytes(shape, batch, context, dtype_bytes)
    state_bytes = decode_state_bytes(shape, batch, dtype_bytes)
    point = _point_base(batch=batch, context=context, weight_bytes=weight_bytes, kv_bytes=kv_bytes)
    if state_bytes:  # models with recurrent state: each slot read and written back
        point["state_bytes"] = state_bytes
    experts = decode_experts_read(shape, batch)
    if experts is not None:  # MoE: the floor counts these routed experts per sparse layer
        point["experts_read_per_layer"] = round(experts, 2)
    if bandwidth:
        point["floor_ms"] = decode_floor_s(weight_bytes, kv_bytes, bandwidth, state_bytes) * 1e3
    if context > max_len:
        return {**point, "status": "skipped", "reason": f"context {context} > max_model_len {max_len}"}
    if deadline.remaining() < 1.0:
        return {**point, "status": "skipped", "reason": "time budget (--max-seconds) spent"}
    runner = worker.runner
    try:
        plan, aliased = fake_plan(batch, context, 1, runner.block_size, runner.num_blocks, runner.vocab_size, rng,
                                  alias=options.kv_aliasing, tag=f"-d{batch}x{context}", window=uniform_window(shape),
                                  num_groups=num_paged_groups(runner), num_state_slots=num_state_slots(runner))
    except StateSlotsExceeded as exc:
        return {**point, "status": "skipped", "reason": f"state slots: {exc}"}
    except ValueError as exc:
        need = batch * context * kv_bytes_per_token(shape, dtype_bytes)
        return {**point, "status": "skipped",
                "reason": f"KV does not fit: {exc} ({need / 1e9:.1f} GB of KV); --kv-aliasing runs it with shared blocks"}
    planned = PlannedBatch(worker, plan)
    try:
        return _time_decode(runner, planned, point, aliased, batch, context, weight_bytes + kv_bytes + state_bytes,
                            options, deadline, record)
    finally:
        planned.release()


def _time_decode(runner: Any, planned: PlannedBatch, point: dict[str, Any], aliased: bool, batch: int, context: int,
                 step_bytes: int, options: RooflineOptions, deadline: Deadline, record: BenchRecord) -> dict[str, Any]:
    point["kv_aliased"] = aliased
    point["path"] = decode_path(runner, planned)
    budget = min(options.point_seconds, max(deadline.remaining(), 0.5))
    try:
        t = cuda_time(planned.execute, runner.device, warmup=3, reps=options.reps, budget_s=budget)
    except Exception as exc:  # noqa: BLE001 - one failing point must not end the sweep
        record.add_error(f"decode b={batch} ctx={context}", exc)
        _release_after_failure()
        return {**point, "status": "error", "error": f"{type(exc).__name__}: {exc}"}
    point.update(t.as_dict())
    point["tokens_per_s"] = batch / (t.median_ms / 1e3)
    point["achieved_bytes_per_s"] = step_bytes / (t.median_ms / 1e3)
    if "floor_ms" in point:
        point["floor_pct"] = 100.0 * point["floor_ms"] / t.median_ms
    try:
        replay = replay_only(runner, planned)
        if replay is not None:
            r = cuda_time(replay, runner.device, warmup=2, reps=options.reps, budget_s=budget / 2)
            point["replay_only_ms"] = r.median_ms
            if "floor_ms" in point:
                point["floor_pct_replay_only"] = 100.0 * point["floor_ms"] / r.median_ms
    except Exception as exc:  # noqa: BLE001 - the execute figure above stands on its own
        record.add_error(f"decode replay-only b={batch} ctx={context}", exc)
    log.info("decode point", batch=batch, context=context, path=point["path"], median_ms=round(t.median_ms, 3),
             floor_pct=round(point.get("floor_pct", math.nan), 1))
    return point


def _prefill_point(worker: Any, shape: Any, num_seqs: int, seq_len: int, matmul_rate: float | None,
                   options: RooflineOptions, deadline: Deadline, rng: np.random.Generator, max_len: int,
                   record: BenchRecord) -> dict[str, Any]:
    flops = prefill_flops(shape, [seq_len] * num_seqs)
    point = _point_base(shape=f"{num_seqs}x{seq_len}", num_seqs=num_seqs, seq_len=seq_len, tokens=num_seqs * seq_len,
                        flops=flops)
    if seq_len > max_len:
        return {**point, "status": "skipped", "reason": f"sequence {seq_len} > max_model_len {max_len}"}
    if deadline.remaining() < 1.0:
        return {**point, "status": "skipped", "reason": "time budget (--max-seconds) spent"}
    runner = worker.runner
    planned = None
    try:
        plan, _ = fake_plan(num_seqs, seq_len, seq_len, runner.block_size, runner.num_blocks, runner.vocab_size,
                            rng, alias=False, tag=f"-p{num_seqs}x{seq_len}", num_groups=num_paged_groups(runner),
                            num_state_slots=num_state_slots(runner))
        planned = PlannedBatch(worker, plan)
        t = cuda_time(planned.execute, runner.device, warmup=2, reps=options.reps,
                      budget_s=min(options.point_seconds, max(deadline.remaining(), 0.5)))
    except Exception as exc:  # noqa: BLE001
        record.add_error(f"prefill {num_seqs}x{seq_len}", exc)
        _release_after_failure()
        return {**point, "status": "error", "error": f"{type(exc).__name__}: {exc}"}
    finally:
        if planned is not None:
            planned.release()
    seconds = t.median_ms / 1e3
    point.update(t.as_dict())
    point["flops_per_s"] = flops["total"] / seconds
    point["tokens_per_s"] = point["tokens"] / seconds
    if matmul_rate:
        point["mfu"] = flops["total"] / seconds / matmul_rate
    log.info("prefill point", shape=point["shape"], median_ms=round(t.median_ms, 2), mfu=point.get("mfu"))
    return point


def _release_after_failure() -> None:
    # An OOM leaves cached blocks behind; give them back before the next point.
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def short_table(results: dict[str, Any]) -> list[str]:
    """A few plain-text lines for the terminal: ceilings, then one line per point."""
    lines = []
    bw, mm = results.get("bandwidth", {}), results.get("matmul", {})
    if bw:
        lines.append(f"HBM copy bandwidth: {bw['bytes_per_s'] / 1e12:.2f} TB/s   "
                     f"bf16 matmul: {mm.get('flops_per_s', math.nan) / 1e12:.0f} TFLOP/s")
    lines.append(f"{'batch':>6} {'ctx':>6} {'step ms':>9} {'replay ms':>9} {'floor ms':>9} {'floor%':>7}  status")
    for p in results.get("decode", []):
        lines.append(f"{p['batch']:>6} {p['context']:>6} {p.get('median_ms', math.nan):>9.3f} "
                     f"{p.get('replay_only_ms', math.nan):>9.3f} "
                     f"{p.get('floor_ms', math.nan):>9.3f} {p.get('floor_pct', math.nan):>6.1f}%  "
                     f"{p['status']} {p.get('path', '')}{' (kv aliased)' if p.get('kv_aliased') else ''}")
    for p in results.get("prefill", []):
        lines.append(f"prefill {p['shape']:>10}: {p.get('median_ms', math.nan):.2f} ms  "
                     f"MFU {100 * p.get('mfu', math.nan):.1f}%  {p['status']}")
    return lines
