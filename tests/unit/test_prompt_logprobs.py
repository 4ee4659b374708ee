"""Prompt logprobs in the engine (tiny dummy model, CPU): computed during prefill, chunk by chunk.

The reference is the engine's own generated-token logprobs: a greedy continuation's tokens,
sent back as part of a prompt, must get the same logprob, rank and top alternatives as when they
were sampled. Chunking (5 tokens a step), overlap, preemption and a warm prefix cache must not
change them; parity with transformers over gRPC is tests/integration/test_prompt_logprobs.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from tandem.core_protocol import TokenLogprobs
from tandem.engine_service.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tandem.engine_service.core.engine import LLMEngine
from tandem.engine_service.worker.model_runner import ModelRunner
from tandem.engine_service.sequence import SamplingParams

MODEL = "dummy:tiny-qwen3"
VOCAB = 320


def config(prefill_cap: int = 0, overlap: str = "off", num_blocks: int = 96) -> EngineConfig:
    return EngineConfig(
        ModelConfig(model=MODEL, attention_backend="torch", max_model_len=128),
        CacheConfig(block_size=4, num_blocks=num_blocks),
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, overlap_scheduling=overlap,
                        max_prefill_tokens_per_seq=prefill_cap),
    )


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(config())


def prompt(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, VOCAB, size=n)]


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]):
    """Drives `engine` until idle: per request (tokens, logprobs, prompt logprobs, outputs
    carrying prompt logprobs, cached prompt tokens)."""
    for rid, (tokens, params) in requests.items():
        engine.add_request(rid, tokens, params)
    out = {rid: ([], [], [], 0, 0) for rid in requests}
    for _ in range(500):
        if not engine.has_work():
            return out
        for o in engine.step():
            toks, lps, plps, pieces, cached = out[o.request_id]
            toks.extend(o.new_token_ids)
            lps.extend(o.new_logprobs)
            plps.extend(o.new_prompt_logprobs)
            out[o.request_id] = (toks, lps, plps, pieces + bool(o.new_prompt_logprobs), o.num_cached_prompt_tokens)
    raise AssertionError("engine did not go idle")


def same(a: TokenLogprobs, b: TokenLogprobs) -> None:
    assert (a.token_id, a.rank) == (b.token_id, b.rank)
    assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-4)


def test_prompt_logprobs_equal_the_logprobs_of_the_same_tokens_when_generated(runner):
    base = prompt(1, 9)
    gen = run(LLMEngine(config(), runner=runner),
              {"g": (base, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3))})
    generated, generated_lps = gen["g"][0], gen["g"][1]
    full = base + generated
    for cap, overlap in ((0, "off"), (5, "off"), (5, "on")):
        got = run(LLMEngine(config(cap, overlap), runner=runner),
                  {"p": (full, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=3))})["p"]
        plps, pieces = got[2], got[3]
        assert [e.token_id for e in plps] == full[1:]  # positions 1 .. P-1, in order, once each
        for lp, expected in zip(plps[len(base) - 1:], generated_lps):
            same(lp, expected)
        assert all(len(e.top) == 3 and e.rank >= 1 for e in plps)
        # One piece per chunk: 20 prompt tokens in chunks of 5 report in 4 outputs.
        assert pieces == (1 if cap == 0 else 4)


def test_top_zero_and_requests_without_prompt_logprobs(runner):
    p = prompt(2, 11)
    got = run(LLMEngine(config(5), runner=runner), {
        "zero": (p, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=0)),
        "none": (p, SamplingParams(max_tokens=2, temperature=0.0)),
    })
    assert [e.token_id for e in got["zero"][2]] == p[1:] and all(e.top == [] for e in got["zero"][2])
    assert got["none"][2] == []
    assert got["zero"][0] == got["none"][0]  # asking for them changes no generated token


def test_a_warm_prefix_cache_is_not_used_and_positions_are_not_repeated_after_preemption(runner):
    p = prompt(3, 30)
    reference = run(LLMEngine(config(), runner=runner),
                    {"r": (p, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2))})["r"][2]
    engine = LLMEngine(config(5), runner=runner)
    warm = run(engine, {"w": (p, SamplingParams(max_tokens=1, temperature=0.0))})
    assert warm["w"][4] == 0
    again = run(engine, {
        "plain": (p, SamplingParams(max_tokens=1, temperature=0.0)),
        "asks": (p, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)),
    })
    assert again["plain"][4] > 0  # the cache is warm
    assert again["asks"][4] == 0  # ...but the request asking for prompt logprobs computes it all
    for a, b in zip(again["asks"][2], reference, strict=True):
        same(a, b)

    # A pool too small for two long requests: one is preempted and recomputed mid-way.
    tight = LLMEngine(config(5, num_blocks=14), runner=ModelRunner(config(5, num_blocks=14)))
    long_a, long_b = prompt(4, 24), prompt(5, 24)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    got = run(tight, {"a": (long_a, params), "b": (long_b, params)})
    assert tight.scheduler.num_preemptions > 0
    for rid, tokens in (("a", long_a), ("b", long_b)):
        assert [e.token_id for e in got[rid][2]] == tokens[1:]
