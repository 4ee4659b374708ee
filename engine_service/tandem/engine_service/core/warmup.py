"""Kernel warm-up before an engine serves: synthetic requests through its own scheduler and kernels.

Why: Triton compiles a kernel the first time it runs with a new set of constexprs and
specialised integer arguments. Prefill steps of a hybrid or MoE model pick several of those from
the step's shape (the fused MoE's tile sizes from its token count, the attention kernels' split
counts, ...), so without a warm-up the first steps of each new shape class stall while kernels
compile, each for seconds on an H200 where a compiled prefill step of Qwen3-Next's layer shapes
takes ~12 ms (bench/NOTES.md has the figures). A user's first requests would wait those seconds. CUDA graphs cover the decode shapes; this covers the rest.

What runs: prompts of every power of two from 16 tokens up to a full step
(`max_num_batched_tokens`, bounded by the context), each also 7 tokens longer (off the
divisible-by-16 grid Triton specialises on), longest first, each once and then cycled until
they fill two full steps (at most twice `max_num_seqs` requests); all are
submitted at once, so the engine runs what a burst of traffic gives it: full prefill steps of
many requests, prefill chunks mixed with decodes, then decodes. Each asks for 4 tokens, one of
them with temperature, top-p and top-k (the sampling paths), the rest greedy. Afterwards every
request is finished (or aborted at the time bound), the prefix cache is emptied and the engine's
counters are zeroed, so the engine serves from the state it was built in: no block, state slot
or cached prefix is left, and STATS and metrics count only served requests.

Runs on CUDA only (the CPU path runs PyTorch ops, nothing to compile) unless forced (tests).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog

log = structlog.get_logger(__name__)

WARMUP_ID_PREFIX = "__tandem-warmup-"
OUTPUT_TOKENS = 4
OFF_GRID = 7  # added to each length: step sizes off Triton's divisible-by-16 specialisation
MIN_PROMPT = 16


@dataclass(frozen=True)
class WarmupReport:
    requests: int
    prompt_tokens: int
    steps: int
    seconds: float
    timed_out: bool
    checkpoint_saves: int  # state checkpoints the warm-up saved (then forgot): the hybrid path ran


def spanning_lengths(longest: int, cap: int, shortest: int = MIN_PROMPT) -> list[int]:
    """Prompt lengths spanning `[shortest, longest]`: the powers of two from `shortest` below
    `longest`, and `longest`, each also `OFF_GRID` tokens longer, none above `cap`; longest
    first (so a bound on the request count keeps the longest)."""
    lens = []
    n = shortest
    while n < longest:
        lens.append(n)
        n *= 2
    lens.append(longest)
    return sorted({min(m + d, cap) for m in lens for d in (0, OFF_GRID)}, reverse=True)


def lengths_filling_steps(lens: Sequence[int], step_tokens: int, min_count: int, max_count: int) -> list[int]:
    """`lens` cycled until they fill two steps of `step_tokens` tokens (what a burst of requests
    starts with: full prefill steps, then prefill mixed with decodes), at least `min_count` of
    them and at most `max_count`."""
    chosen: list[int] = []
    total = 0
    while len(chosen) < max_count and (len(chosen) < min_count or total < 2 * step_tokens):
        chosen.append(lens[len(chosen) % len(lens)])
        total += chosen[-1]
    return chosen


def warmup_prompts(vocab_size: int, max_num_batched_tokens: int, max_model_len: int, max_requests: int,
                   seed: int = 0) -> list[list[int]]:
    """The warm-up prompts (see the module docstring): at most `max_requests`, each leaving room
    for its output tokens within `max_model_len`, token ids drawn from a fixed seed."""
    longest = max(1, min(max_num_batched_tokens, max_model_len - OUTPUT_TOKENS))
    lens = spanning_lengths(longest, cap=longest)
    chosen = lengths_filling_steps(lens, max_num_batched_tokens, min_count=len(lens), max_count=max(1, max_requests))
    rng = np.random.default_rng(np.random.SeedSequence([0x7A, 0x4D, seed]))
    return [rng.integers(0, vocab_size, size=n).tolist() for n in chosen]


def warm_up(engine: Any, max_seconds: float, force: bool = False) -> WarmupReport | None:
    """Run the warm-up on `engine` (an `LLMEngine` with nothing in flight) for at most
    `max_seconds`; None when skipped (`max_seconds` <= 0, or not on CUDA and not `force`)."""
    from tandem.engine_service.sequence import SamplingParams

    if max_seconds <= 0 or (engine.runner.device.type != "cuda" and not force):
        return None
    if engine.has_work():
        raise RuntimeError("warm-up needs an idle engine")
    sc = engine.config.scheduler
    prompts = warmup_prompts(engine.runner.vocab_size, sc.max_num_batched_tokens, engine.max_model_len,
                             max_requests=min(2 * sc.max_num_seqs, sc.max_waiting_requests))
    t0 = time.monotonic()
    ids = []
    for i, prompt in enumerate(prompts):
        sampled = i == len(prompts) - 1
        params = SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True, temperature=0.8 if sampled else 0.0,
                                top_p=0.9 if sampled else 1.0, top_k=20 if sampled else 0,
                                seed=i if sampled else None)
        rid = f"{WARMUP_ID_PREFIX}{i}"
        engine.add_request(rid, prompt, params)
        ids.append(rid)
    steps, timed_out = 0, False
    while engine.has_work():
        if time.monotonic() - t0 > max_seconds:
            timed_out = True
            break
        engine.step()
        steps += 1
    if timed_out:
        engine.abort_and_settle(ids)
    saves = engine.stats().state_checkpoint_saves
    engine.reset_after_warmup()
    report = WarmupReport(len(prompts), sum(map(len, prompts)), steps, round(time.monotonic() - t0, 3), timed_out,
                          saves)
    log.info("engine warmed up", **vars(report))
    return report


def serving_engine(config: Any) -> Any:
    """An `LLMEngine` for `config`, warmed up for `config.model.warmup_seconds` (on CUDA): what
    `tandem serve` and `tandem engine` serve from, in the core process or on a thread."""
    from tandem.engine_service.core.engine import LLMEngine

    engine = LLMEngine(config)
    warm_up(engine, config.model.warmup_seconds)
    return engine
