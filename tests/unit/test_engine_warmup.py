"""The engine's kernel warm-up (`tandem/engine_service/core/warmup.py`), on CPU (forced: it runs on CUDA only).

- the prompts span powers of two on and off the 16 grid up to a full step, fill two steps, stay
  within the context and the request bound;
- after a warm-up of a hybrid model (state slots, checkpoints, prefix caching) nothing is left:
  no block, state slot, checkpoint, cached prefix, and every STATS total is zero;
- on/off equivalence: a warmed-up engine gives a fresh engine's greedy tokens and logprobs;
- the time bound aborts what is left, and still leaves nothing behind;
- skipped on CPU unless forced, and with 0 seconds; negative seconds are refused.
"""

from __future__ import annotations

import pytest
import torch

from tandem.core_protocol import SamplingParams
from tandem.engine_service.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tandem.engine_service.core.engine import LLMEngine
from tandem.engine_service.core.warmup import OFF_GRID, OUTPUT_TOKENS, warm_up, warmup_prompts

TOTALS = ("prompt_tokens_total", "generation_tokens_total", "steps_total", "finished_requests_total",
          "aborted_requests_total", "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_kv_hits",
          "num_preemptions", "state_checkpoint_saves")


def _engine(model: str = "dummy:tiny-qwen3-next", warmup_seconds: float = 60.0) -> LLMEngine:
    return LLMEngine(EngineConfig(
        ModelConfig(model=model, device="cpu", dtype="float32", attention_backend="torch", max_model_len=256,
                    warmup_seconds=warmup_seconds),
        CacheConfig(block_size=4, num_blocks=256, state_checkpoint_stride=8, state_checkpoint_memory_fraction=0.5),
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=96)))


def test_prompts_span_the_step_on_and_off_the_grid() -> None:
    prompts = warmup_prompts(320, max_num_batched_tokens=96, max_model_len=256, max_requests=64)
    lens = [len(p) for p in prompts]
    assert set(lens) == {16, 16 + OFF_GRID, 32, 32 + OFF_GRID, 64, 64 + OFF_GRID, 96}
    assert lens[0] == 96  # longest first: a bound on requests never drops the full step
    assert sum(lens) >= 2 * 96 and len(prompts) <= 64
    assert all(0 <= t < 320 for p in prompts for t in p)
    assert warmup_prompts(320, 96, 256, 64) == prompts  # a fixed seed
    # The context bounds the longest prompt (with room for the output); the request bound holds
    # and keeps the longest.
    short = warmup_prompts(320, max_num_batched_tokens=8192, max_model_len=100, max_requests=5)
    assert max(map(len, short)) == 100 - OUTPUT_TOKENS and len(short) == 5


def test_nothing_is_left_after_a_warmup(one_torch_thread) -> None:
    engine = _engine()
    report = warm_up(engine, 60.0, force=True)
    assert report is not None and not report.timed_out
    assert report.prompt_tokens >= 2 * 96 and report.steps >= 4
    assert not engine.has_work()
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.state_slots_used == 0 and stats.state_checkpoints_used == 0
    assert {k: getattr(stats, k) for k in TOTALS} == dict.fromkeys(TOTALS, 0)
    assert report.checkpoint_saves > 0  # the hybrid path (state checkpoints) did run, and was forgotten


def _greedy(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, tuple[list[int], list[float]]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0))
    out: dict[str, tuple[list[int], list[float]]] = {f"r{i}": ([], []) for i in range(len(prompts))}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id][0].extend(o.new_token_ids)
            out[o.request_id][1].extend(lp.logprob for lp in o.new_logprobs)
    return out


@pytest.mark.parametrize("model", ["dummy:tiny-qwen3-next", "dummy:tiny-qwen3"])
def test_warmed_up_engine_gives_a_fresh_engines_tokens(model: str, one_torch_thread) -> None:
    prompts = [list(range(3, 40)), [7, 8, 9, 10, 11], list(range(100, 190, 3))]
    fresh = _greedy(_engine(model), prompts)
    warmed_engine = _engine(model)
    assert warm_up(warmed_engine, 60.0, force=True) is not None
    warmed = _greedy(warmed_engine, prompts)
    assert {k: v[0] for k, v in warmed.items()} == {k: v[0] for k, v in fresh.items()}
    for k in fresh:
        torch.testing.assert_close(torch.tensor(warmed[k][1]), torch.tensor(fresh[k][1]), atol=1e-5, rtol=0)
    assert warmed_engine.stats().prefix_cache_hits == 0  # the warm-up cached nothing a request can hit


def test_the_time_bound_aborts_and_leaves_nothing(one_torch_thread) -> None:
    engine = _engine()
    report = warm_up(engine, 1e-9, force=True)
    assert report is not None and report.timed_out
    assert not engine.has_work()
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.state_slots_used == 0
    assert stats.aborted_requests_total == 0 and stats.num_running == 0 and stats.num_waiting == 0


def test_skipped_on_cpu_and_at_zero_seconds_refused_below() -> None:
    engine = _engine()
    assert warm_up(engine, 60.0) is None  # CPU: nothing to compile
    assert warm_up(engine, 0.0, force=True) is None
    assert engine.stats().steps_total == 0
    with pytest.raises(ValueError, match="warmup_seconds"):
        ModelConfig(warmup_seconds=-1.0).validate()
