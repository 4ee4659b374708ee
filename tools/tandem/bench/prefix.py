"""`tandem bench prefix`: prefix caching of a hybrid model (state checkpoints), two figures.

1. **Hit rate on a shared-prefix workload.** `num_prefixes` prefixes of `prefix_len` tokens, each
   followed by `requests_per_prefix` requests (prefix + a unique `suffix_len`-token tail),
   shuffled and run closed-loop at `concurrency`. Measured for the model (a hybrid one: hits end
   at the last state checkpoint) and for `compare_model`, a full-attention model of the same
   depth (for the hybrid dummy configs, `dummy:<name>-full-attention`: every layer full
   attention). Reported per model: hit rate = prompt tokens served from the cache / prompt
   tokens looked up, the K/V-only hit rate (what the blocks alone would give), and the ceilings
   at block and at checkpoint granularity (every request after the first of its prefix reusing
   the whole prefix rounded down to a block, or to a checkpoint position).
2. **Cost on a no-reuse workload.** `noreuse_requests` random prompts (nothing shared), all
   submitted at once, run with prefix caching on and off, `repeats` times each, alternating (on,
   off, on, off...), each run on a fresh engine alone on the device (so each gets the memory it
   would get in production: with caching off, the checkpoints' share goes to KV blocks).
   cost = 1 - (best throughput with caching on) / (best with caching off),
   for output and total tokens/s. With caching on a hybrid model saves checkpoints (copies after
   chunks that end on a checkpoint position, and chunks cut there), so this is what they cost
   when nothing is ever reused. Goal: <= 3 %.

Each engine is warmed up first (prefix cache reset after). Results go under `results["prefix"]`.
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass
from typing import Any

import structlog

from tandem.bench.engine_run import reset_prefix_cache, run_engine, warm_up
from tandem.bench.results import BenchRecord, Deadline
from tandem.bench.workloads import BenchRequest, warmup_filling_steps

log = structlog.get_logger(__name__)


@dataclass
class PrefixOptions:
    """The two workloads, and the full-attention model to compare hit rates with."""

    compare_model: str | None = None  # None: dummy:<name>-full-attention when it exists
    num_prefixes: int = 8
    prefix_len: int = 2000
    suffix_len: int = 100
    requests_per_prefix: int = 8
    output_len: int = 16
    concurrency: int = 16
    noreuse_requests: int = 256
    noreuse_prompt_len: int = 1000
    noreuse_output_len: int = 128
    repeats: int = 2
    warmup_requests: int = 8
    seed: int = 0


def default_compare_model(model: str) -> str | None:
    """`dummy:<name>-full-attention` when that dummy config exists, else None."""
    from tandem.engine_service.dummy_configs import FULL_ATTENTION_SUFFIX, dummy_config_names

    if model.startswith("dummy:") and f"{model[len('dummy:'):]}{FULL_ATTENTION_SUFFIX}" in dummy_config_names():
        return model + FULL_ATTENTION_SUFFIX
    return None


def shared_prefix_requests(vocab: int, opts: PrefixOptions, max_model_len: int) -> list[BenchRequest]:
    """Prefix i + a unique tail, `requests_per_prefix` per prefix, shuffled (seeded)."""
    rng = random.Random(opts.seed)
    prefix_len = min(opts.prefix_len, max_model_len - opts.suffix_len - opts.output_len)
    if prefix_len < 1:
        raise ValueError(f"max_model_len {max_model_len} leaves no room for a prefix")
    prefixes = [[rng.randrange(vocab) for _ in range(prefix_len)] for _ in range(opts.num_prefixes)]
    reqs = [BenchRequest(p + [rng.randrange(vocab) for _ in range(opts.suffix_len)], opts.output_len)
            for p in prefixes for _ in range(opts.requests_per_prefix)]
    rng.shuffle(reqs)
    return reqs


def noreuse_requests(vocab: int, opts: PrefixOptions, max_model_len: int) -> list[BenchRequest]:
    rng = random.Random(opts.seed + 1)
    prompt_len = min(opts.noreuse_prompt_len, max_model_len - opts.noreuse_output_len)
    return [BenchRequest([rng.randrange(vocab) for _ in range(prompt_len)], opts.noreuse_output_len)
            for _ in range(opts.noreuse_requests)]


def hit_ceilings(requests: list[BenchRequest], prefix_len: int, block_size: int, stride: int) -> dict[str, float]:
    """Best possible hit rates if every request after the first of its prefix reused the prefix,
    rounded down to a block (full attention) or to a checkpoint position (hybrid)."""
    seen: set[tuple[int, ...]] = set()
    total = by_block = by_checkpoint = 0
    for r in requests:
        key = tuple(r.prompt_token_ids[:prefix_len])
        total += len(r.prompt_token_ids)
        if key in seen:
            # At least the last prompt token is computed, so the usable prefix is < the prompt.
            usable = min(prefix_len, len(r.prompt_token_ids) - 1)
            by_block += usable - usable % block_size
            by_checkpoint += usable - usable % stride
        seen.add(key)
    return {"block": by_block / max(total, 1), "checkpoint": by_checkpoint / max(total, 1)}


def _engine(config: Any, model: str | None = None, prefix_caching: bool | None = None) -> Any:
    from tandem.engine_service.core.warmup import serving_engine

    mc, cc = config.model, config.cache
    if model is not None:
        mc = dataclasses.replace(mc, model=model)
    if prefix_caching is not None:
        cc = dataclasses.replace(cc, enable_prefix_caching=prefix_caching)
    return serving_engine(dataclasses.replace(config, model=mc, cache=cc))  # warmed up as served (CUDA)


def _with_engine(config: Any, model: str | None, prefix_caching: bool, fn: Any) -> Any:
    """`fn(engine)` on a fresh engine that is the only one on the device, released afterwards
    (a second engine alive at once would size its cache from what the first left free)."""
    from tandem.bench.hf_peer import release_device_memory

    engine = _engine(config, model, prefix_caching)
    try:
        return fn(engine)
    finally:
        del engine
        release_device_memory()


def _warm(engine: Any, opts: PrefixOptions, deadline: Deadline) -> None:
    """Prompts from 64 tokens up to the no-reuse length, on and off the 16 grid
    (`warmup.spanning_lengths`), enough to fill two full steps (`warmup_filling_steps`: the
    timed runs' step shapes compile their kernel variants here); a seed of their own, so nothing
    they leave in the cache is ever hit."""
    from tandem.engine_service.core.warmup import spanning_lengths

    cap = max(1, engine.max_model_len - 8)
    lens = spanning_lengths(min(opts.noreuse_prompt_len, cap), cap=cap, shortest=min(64, cap))
    warm_up(engine, warmup_filling_steps(engine.vocab_size, lens, opts.warmup_requests,
                                         engine.config.scheduler.max_num_batched_tokens, seed=opts.seed + 2), deadline)


def hit_rate_run(engine: Any, requests: list[BenchRequest], opts: PrefixOptions, deadline: Deadline) -> dict[str, Any]:
    """Run the shared-prefix workload once; hit rates from the block manager's counters."""
    bm = engine.block_manager
    q0, h0, kv0 = bm.prefix_queries, bm.prefix_hits, bm.prefix_kv_hits
    saves0 = bm.checkpoints.num_saved if bm.checkpoints is not None else 0
    result = run_engine(engine, requests, concurrency=opts.concurrency, deadline=deadline, id_prefix="prefix")
    queries = bm.prefix_queries - q0
    out = {
        "architecture": engine.runner.architecture,
        "state_groups": [g.name for g in engine.runner.memory_plan.state_groups],
        "kv_blocks": bm.num_blocks,
        "checkpoint_slots": bm.checkpoints.num_slots if bm.checkpoints is not None else 0,
        "checkpoint_stride": bm.checkpoint_stride,
        "queried_tokens": queries,
        "hit_tokens": bm.prefix_hits - h0,
        "kv_hit_tokens": bm.prefix_kv_hits - kv0,
        "hit_rate": (bm.prefix_hits - h0) / max(queries, 1),
        "kv_hit_rate": (bm.prefix_kv_hits - kv0) / max(queries, 1),
        "checkpoint_saves": (bm.checkpoints.num_saved if bm.checkpoints is not None else 0) - saves0,
        "preemptions": engine.scheduler.num_preemptions,
        "run": result.summary(),
    }
    return out


def throughput_run(engine: Any, requests: list[BenchRequest], deadline: Deadline) -> dict[str, Any]:
    reset_prefix_cache(engine)
    result = run_engine(engine, requests, deadline=deadline, id_prefix="noreuse")
    s = result.summary()
    return {k: s[k] for k in ("elapsed_s", "steps", "output_tokens_per_s", "total_tokens_per_s", "timed_out",
                              "completed", "prefix_cache_hits")}


def run_prefix(record: BenchRecord, config: Any, opts: PrefixOptions, deadline: Deadline) -> None:
    """Both figures (see the module docstring) into `record.results["prefix"]`."""
    compare = opts.compare_model or default_compare_model(config.model.model)
    res: dict[str, Any] = {"options": dataclasses.asdict(opts) | {"compare_model": compare}}
    record.results["prefix"] = res
    # 1. Hit rates: the model, then the full-attention one, on the same requests.
    hits: dict[str, Any] = {}
    res["hit_rate"] = hits
    for label, model in (("model", config.model.model), ("full_attention", compare)):
        if model is None:
            record.add_error("prefix.hit_rate", ValueError("no full-attention model to compare with: pass "
                                                           "--compare-model"))
            continue
        if deadline.expired():
            record.add_error(f"prefix.hit_rate.{label}", TimeoutError("out of time"))
            continue

        def shared(engine: Any) -> dict[str, Any]:
            _warm(engine, opts, deadline)
            requests = shared_prefix_requests(engine.vocab_size, opts, engine.max_model_len)
            prefix_len = len(requests[0].prompt_token_ids) - opts.suffix_len
            run = hit_rate_run(engine, requests, opts, deadline)
            stride = engine.block_manager.checkpoint_stride or engine.block_manager.block_size
            run["ceiling"] = hit_ceilings(requests, prefix_len, engine.block_manager.block_size, stride)
            return run | {"model": model}

        hits[label] = _with_engine(config, model, True, shared)
    # 2. No-reuse throughput, prefix caching on vs off, alternating, a fresh engine per run.
    runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    res["noreuse"] = {"runs": runs}

    def noreuse(engine: Any) -> dict[str, Any]:
        _warm(engine, opts, deadline)
        requests = noreuse_requests(engine.vocab_size, opts, engine.max_model_len)
        out = throughput_run(engine, requests, deadline)
        return out | {"kv_blocks": engine.block_manager.num_blocks,
                      "checkpoint_slots": engine.block_manager.checkpoints.num_slots
                      if engine.block_manager.checkpoints is not None else 0}

    for _ in range(opts.repeats):
        for mode in ("on", "off"):
            if deadline.expired():
                record.add_error("prefix.noreuse", TimeoutError("out of time"))
                break
            t0 = time.perf_counter()
            runs[mode].append(_with_engine(config, None, mode == "on", noreuse))
            log.info("prefix noreuse run", prefix_caching=mode, seconds=round(time.perf_counter() - t0, 2))
    if runs["on"] and runs["off"]:
        best = {mode: {k: max(r[k] for r in runs[mode]) for k in ("output_tokens_per_s", "total_tokens_per_s")}
                for mode in runs}
        res["noreuse"]["best"] = best
        if all(best["off"][k] > 0 for k in best["off"]):
            res["noreuse"]["cost"] = {k: 1.0 - best["on"][k] / best["off"][k] for k in best["on"]}
        else:  # the deadline stopped the runs without prefix caching before any token: nothing to compare
            res["noreuse"]["cost_unavailable"] = "no token without prefix caching (out of time)"
            record.incomplete = True


def short_table(results: dict[str, Any]) -> list[str]:
    res = results.get("prefix", {})
    lines = ["| model | hit rate | K/V-only hit rate | ceiling (block / checkpoint) | checkpoint saves |",
             "|---|---|---|---|---|"]
    for label, r in res.get("hit_rate", {}).items():
        c = r["ceiling"]
        lines.append(f"| {label}: {r['model']} | {r['hit_rate']:.3f} | {r['kv_hit_rate']:.3f} | "
                     f"{c['block']:.3f} / {c['checkpoint']:.3f} | {r['checkpoint_saves']} |")
    cost = res.get("noreuse", {}).get("cost")
    if cost:
        best = res["noreuse"]["best"]
        lines.append(f"no-reuse output tok/s: on {best['on']['output_tokens_per_s']:.1f}, off "
                     f"{best['off']['output_tokens_per_s']:.1f}; cost {100 * cost['output_tokens_per_s']:.2f} % "
                     f"(total tok/s: {100 * cost['total_tokens_per_s']:.2f} %)")
    return lines
