"""Overlapped scheduling: step N+1 is scheduled and launched before step N's tokens are read
back, its decode inputs taken on the device from step N's sampled tokens.

The contract is that overlap changes *when* tokens reach the host, never *which* tokens: every
test runs the same requests through an engine with overlap off and one with overlap on (same
model, same weights, CPU) and compares tokens, logprobs and endings, under the conditions that
make the pipeline tricky — early stops while the next token is already computed, length limits,
penalties (which force the in-flight step to finish first), preemption, aborts mid-flight,
prefix sharing and chunked prefill — and then checks that nothing leaked.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.engine_service.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tandem.engine_service.worker.cuda_graphs import DecodeCudaGraphs
from tandem.engine_service.core.engine import LLMEngine
from tandem.engine_service.worker.input_batch import PENDING_PLACEHOLDER, PinnedStaging, prepare_host_inputs
from tandem.engine_service.worker.model_runner import ModelRunner
from tandem.engine_service.sequence import FinishReason, SamplingParams

MODEL = "dummy:tiny-qwen3"
BLOCK_SIZE = 4
VOCAB = 320


def make_config(overlap: str, num_blocks: int = 96, max_num_seqs: int = 8, max_batched: int = 64,
                backend: str = "torch") -> EngineConfig:
    return EngineConfig(
        ModelConfig(model=MODEL, attention_backend=backend, max_model_len=128),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks),
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched, overlap_scheduling=overlap),
    )


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(make_config("off"))


def prompt(i: int, n: int) -> list[int]:
    g = np.random.default_rng(100 + i)
    return [int(t) for t in g.integers(3, VOCAB, size=n)]


def run_all(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams]], abort_after: dict | None = None):
    """Drive `engine` until idle; returns {request_id: (tokens, logprobs, finish_reason, stop_reason)}."""
    for rid, tokens, params in requests:
        engine.add_request(rid, tokens, params)
    results = {rid: ([], [], None, None) for rid, _, _ in requests}
    steps = 0
    while engine.has_work():
        for o in engine.step():
            toks, lps, _, _ = results[o.request_id]
            toks.extend(o.new_token_ids)
            lps.extend(o.new_logprobs)
            if o.finished:
                results[o.request_id] = (toks, lps, o.finish_reason, o.stop_reason)
        steps += 1
        for rid, at in (abort_after or {}).items():
            if steps == at and engine.abort(rid) is not None:
                toks, lps, _, _ = results[rid]
                results[rid] = (toks, lps, FinishReason.ABORT, None)
        assert steps < 2000
    return results


def assert_idle(engine: LLMEngine) -> None:
    bm = engine.block_manager
    assert engine.scheduler.num_running == 0 and engine.scheduler.num_waiting == 0
    assert bm.num_used_blocks == 0, "blocks leaked"
    assert engine._in_flight is None


def both(runner: ModelRunner, requests, **config_kwargs):
    off = LLMEngine(make_config("off", **config_kwargs), runner=runner)
    on = LLMEngine(make_config("on", **config_kwargs), runner=runner)
    assert not off.overlap and on.overlap
    got_off, got_on = run_all(off, requests), run_all(on, requests)
    assert_idle(off)
    assert_idle(on)
    return got_off, got_on


def compare(got_off: dict, got_on: dict) -> None:
    assert got_off.keys() == got_on.keys()
    for rid in got_off:
        toks_off, lps_off, reason_off, stop_off = got_off[rid]
        toks_on, lps_on, reason_on, stop_on = got_on[rid]
        assert toks_on == toks_off, rid
        assert (reason_on, stop_on) == (reason_off, stop_off), rid
        for a, b in zip(lps_off, lps_on, strict=True):
            if a is None:
                assert b is None
            else:
                assert (b.token_id, b.rank, [t for t, _ in b.top]) == (a.token_id, a.rank, [t for t, _ in a.top])
                assert b.logprob == pytest.approx(a.logprob, abs=1e-5)


def test_pending_input_token_is_a_placeholder_with_its_source_row() -> None:
    from tandem.engine_service.core.scheduler import ScheduledSeq
    from tandem.engine_service.sequence import Sequence

    known = Sequence("k", [5, 6, 7], SamplingParams())
    known.block_table, known.num_computed_tokens = [0], 2
    pending = Sequence("p", [8, 9], SamplingParams())
    pending.block_table, pending.num_computed_tokens = [1], 2
    pending.mark_pending(row=3)
    assert pending.num_tokens == 3 and pending.num_known_tokens == 2 and pending.token_ids == [8, 9]
    host = prepare_host_inputs([ScheduledSeq(known, 1, True), ScheduledSeq(pending, 1, True)], BLOCK_SIZE)
    assert host.input_ids.tolist() == [7, PENDING_PLACEHOLDER]
    assert host.pending_dst.tolist() == [1] and host.pending_src.tolist() == [3]
    pending.confirm_token(42)
    assert pending.num_pending_tokens == 0 and pending.output_token_ids == [42]
    host = prepare_host_inputs([ScheduledSeq(pending, 1, True)], BLOCK_SIZE)
    assert host.input_ids.tolist() == [42] and host.pending_dst.size == 0
    with pytest.raises(RuntimeError):
        pending.confirm_token(1)  # nothing pending any more


def test_step_reports_the_previous_launch(runner) -> None:
    engine = LLMEngine(make_config("on"), runner=runner)
    engine.add_request("a", prompt(0, 9), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert engine.step() == []  # the prefill is launched; its token is not back yet
    seq = engine.scheduler.get("a")
    assert seq.num_pending_tokens == 1 and seq.output_token_ids == []
    first = engine.step()  # launches the first decode (input read on the device), reports token 1
    assert [o.new_token_ids for o in first] == [[seq.output_token_ids[0]]]
    assert seq.num_pending_tokens == 1
    outs = [o for _ in range(4) if engine.has_work() for o in engine.step()]
    assert sum(len(o.new_token_ids) for o in outs) == 2 and outs[-1].finished
    assert engine.counters.steps == 3  # the length limit is seen before a 4th step is launched
    assert_idle(engine)


def test_greedy_logprobs_and_lengths_match(runner) -> None:
    requests = [
        (f"r{i}", prompt(i, 5 + 3 * i), SamplingParams(max_tokens=4 + 5 * i, temperature=0.0, ignore_eos=True,
                                                     logprobs=2 if i % 2 else None))
        for i in range(6)
    ]
    # One request ends at the model's context length (128) rather than at max_tokens.
    requests.append(("long", prompt(7, 119), SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)))
    got_off, got_on = both(runner, requests)
    compare(got_off, got_on)
    assert len(got_on["long"][0]) == 9 and got_on["long"][2] == FinishReason.LENGTH


def test_stop_tokens_ending_mid_pipeline_match(runner) -> None:
    # Learn each request's free-running tokens, then stop each at a different token: the stop
    # is seen while the next token is already being computed, which must be dropped.
    free = [(f"r{i}", prompt(i, 6 + i), SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
            for i in range(6)]
    reference = run_all(LLMEngine(make_config("off"), runner=runner), free)
    requests = []
    for i, (rid, tokens, _) in enumerate(free):
        stop_at = reference[rid][0][2 + i]
        requests.append((rid, tokens, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                     stop_token_ids=[stop_at], min_tokens=i % 3)))
    got_off, got_on = both(runner, requests)
    compare(got_off, got_on)
    # min_tokens masks the stop token early on and so may steer a request away from it; the
    # others must all have stopped at their stop token.
    assert all(got_on[rid][2] == FinishReason.STOP for i, (rid, _, _) in enumerate(free) if i % 3 == 0)


def test_seeded_sampling_min_p_top_k_match(runner) -> None:
    requests = [
        (f"r{i}", prompt(i, 7), SamplingParams(max_tokens=12, temperature=0.8, top_k=20, top_p=0.9, min_p=0.02,
                                               seed=7 + i, ignore_eos=True, logprobs=1))
        for i in range(4)
    ]
    compare(*both(runner, requests))


def test_penalties_finish_the_step_in_flight_first(runner) -> None:
    requests = [
        ("plain", prompt(1, 6), SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)),
        ("rep", prompt(2, 6), SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, repetition_penalty=1.3)),
        ("freq", prompt(3, 6), SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                              frequency_penalty=0.7, presence_penalty=0.4)),
    ]
    compare(*both(runner, requests))


def test_preemption_with_a_tiny_pool_matches(runner) -> None:
    requests = [(f"r{i}", prompt(i, 10), SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
                for i in range(6)]
    small = ModelRunner(make_config("off", num_blocks=16))  # the runner sizes the pool
    off = LLMEngine(make_config("off"), runner=small)
    on = LLMEngine(make_config("on"), runner=small)
    compare(run_all(off, requests), run_all(on, requests))
    assert on.scheduler.num_preemptions > 0
    assert_idle(on)


def test_prefix_sharing_and_chunked_prefill_match(runner) -> None:
    shared = prompt(9, 21)
    requests = [(f"r{i}", shared + prompt(i, 1 + i), SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True))
                for i in range(5)]
    got_off, got_on = both(runner, requests, max_batched=8)  # prompts arrive in chunks of <= 8 tokens
    compare(got_off, got_on)


def test_abort_mid_flight_frees_everything(runner) -> None:
    requests = [(f"r{i}", prompt(i, 8), SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
                for i in range(4)]
    reference = run_all(LLMEngine(make_config("off"), runner=runner), requests)
    engine = LLMEngine(make_config("on"), runner=runner)
    got = run_all(engine, requests, abort_after={"r1": 3, "r3": 6})
    assert_idle(engine)
    for rid in ("r0", "r2"):
        assert got[rid][0] == reference[rid][0]
    for rid in ("r1", "r3"):
        assert got[rid][2] == FinishReason.ABORT
        assert got[rid][0] == reference[rid][0][: len(got[rid][0])] and len(got[rid][0]) < 16


def test_padded_graph_buffers_read_pending_tokens() -> None:
    """The CUDA-graph path (run eagerly on CPU here, Triton kernels interpreted) fills pending
    inputs in its fixed buffers."""
    config = make_config("on", backend="triton")
    plain_runner = ModelRunner(make_config("off", backend="triton"))
    graph_runner = ModelRunner(config)
    graphs = DecodeCudaGraphs(
        graph_runner.model, graph_runner.kv_caches, sizes=[1, 2, 4, 8], block_size=BLOCK_SIZE,
        max_blocks_per_seq=graph_runner.max_model_len // BLOCK_SIZE, scratch_block=graph_runner.scratch_block,
        num_kv_heads=2, device=torch.device("cpu"), capture_graphs=False,
    )
    graphs.capture()
    graph_runner.cuda_graphs = graphs
    graph_runner._staging = PinnedStaging(torch.device("cpu"))
    requests = [(f"r{i}", prompt(i, 5 + i), SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
                for i in range(3)]
    reference = run_all(LLMEngine(make_config("off", backend="triton"), runner=plain_runner), requests)
    engine = LLMEngine(config, runner=graph_runner)
    calls = []
    original = graphs.run
    graphs.run = lambda host, *a: calls.append(host.pending_dst.size) or original(host, *a)
    compare(reference, run_all(engine, requests))
    assert calls and max(calls) > 0  # decode steps went through the graph runner with pending inputs


def test_length_limited_requests_batch_exactly_as_without_overlap(runner) -> None:
    """A sequence whose pending token ends it gives up its slot at once: with more requests than
    `max_num_seqs`, every launched batch is the same as without overlap (the GPU check relies on
    this to demand identical tokens), only the empty wind-down steps differ."""
    requests = [(f"r{i}", prompt(i, 6 + i % 3), SamplingParams(max_tokens=3 + i % 4, temperature=0.0, ignore_eos=True))
                for i in range(10)]
    batches = {}
    for mode in ("off", "on"):
        log = batches[mode] = []
        engine = LLMEngine(make_config(mode, max_num_seqs=3, max_batched=16), runner=runner)
        original = engine.worker.launch

        def recording(plan, previous=None, _log=log, _original=original):
            cached = plan.cached_requests
            entries = [*zip(cached.request_ids, cached.num_scheduled_tokens),
                       *((r.request_id, r.num_scheduled_tokens) for r in plan.new_requests)]
            if entries:
                _log.append(entries)
            return _original(plan, previous)

        engine.worker.launch = recording
        run_all(engine, requests)
        assert_idle(engine)
    assert batches["on"] == batches["off"] and len(batches["off"]) > 5
