"""The step plan and the worker's persistent rows.

1. A plan round-trips through msgpack bytes: the decoded plan equals the original, and applying
   either to a worker gives identical model inputs.
2. Old/new equivalence on randomized scheduling traces: a real scheduler, block manager and
   engine loop (overlap on and off, tiny pools that force preemption, chunked prefill, shared
   prefixes, aborts, reused ids, penalties, seeded sampling, stop tokens) drive a model stand-in;
   at every step the inputs the worker built from its rows (fed only decoded plan bytes) must
   equal what the Sequence-based builder (`prepare_host_inputs`, the runner's input path before
   the plan) produces from the scheduler's objects, and each sampled row must show the sampler
   the same tokens and parameters as its Sequence. The same traces run on a layout with two
   paged cache groups (full attention + a sliding window that gives blocks back mid-request) and
   a state group: every group's arrays must match, the rows' tables must equal the scheduler's
   entry for entry (a given-back entry is `NULL_BLOCK` in the row too, never a stale id of a block
   that may belong to another request by now), and the state slot must ride the plan into the row.
3. Bookkeeping: drops, preemption (blocks gone, tokens and generator kept), resume, reused ids,
   plans that name unknown rows.
"""

from __future__ import annotations

import random
import sys
import subprocess

import numpy as np
import pytest
import torch

from tandem.engine_service.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tandem.engine_service.core.engine import LLMEngine
from tandem.engine_service.worker.input_batch import HostInputs, prepare_host_inputs
from tandem.engine_service.cache.block_manager import NULL_BLOCK, first_needed_block
from tandem.engine_service.cache.memory_plan import GroupPlan, MemoryPlan
from tandem.engine_service.core.plan_builder import StepPlanBuilder
from tandem.engine_service.sequence import SamplingParams
from tandem.engine_service.step_plan import CachedRequests, NewRequest, StepPlan, decode_plan, encode_plan
from tandem.engine_service.worker.worker_rows import WorkerRows, host_inputs_from_rows

BLOCK_SIZE = 4
VOCAB = 64
HOST_FIELDS = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables",
               "logits_indices", "pending_dst", "pending_src")


def assert_same_inputs(a: HostInputs, b: HostInputs) -> None:
    for name in HOST_FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), name
    assert a.seq_lens_cpu == b.seq_lens_cpu and a.query_lens_cpu == b.query_lens_cpu
    assert len(a.extra_groups) == len(b.extra_groups)
    for g, (pair_a, pair_b) in enumerate(zip(a.extra_groups, b.extra_groups), start=1):
        for x, y in zip(pair_a, pair_b):
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), f"group {g}"


# -- 1. msgpack round trip ---------------------------------------------------------------------------


def _two_plans() -> list[StepPlan]:
    params = SamplingParams(max_tokens=7, temperature=0.7, top_k=5, seed=11, stop_token_ids=[3],
                            stop_token_sequences=[[4, 5]], logprobs=2, repetition_penalty=1.2)
    first = StepPlan(step_id=0, new_requests=[
        NewRequest(request_id="a", token_ids=[9, 8, 7, 6, 5], num_prompt_tokens=5, sampling_params=params,
                   eos_token_ids=[2], block_ids=[[4, 1]], num_computed_tokens=0, num_scheduled_tokens=5,
                   sample=True),
        NewRequest(request_id="b", token_ids=list(range(10, 19)), num_prompt_tokens=9,
                   sampling_params=SamplingParams(), eos_token_ids=[2, 5], block_ids=[[0, 2, 3]],
                   num_computed_tokens=4, num_scheduled_tokens=3, sample=False, state_slot=1),
    ])
    cached = CachedRequests()
    cached.append("b", None, num_computed_tokens=7, num_scheduled_tokens=2, sample=True)
    cached.append("a", [[6]], num_computed_tokens=5, num_scheduled_tokens=1, sample=True)
    second = StepPlan(step_id=1, cached_requests=cached, finished_req_ids=["gone"])
    return [first, second]


def test_plan_round_trips_through_msgpack_bytes_to_identical_inputs() -> None:
    direct, via_bytes = WorkerRows(), WorkerRows()
    direct.apply(StepPlan(step_id=-1, new_requests=[NewRequest(
        request_id="gone", token_ids=[1], num_prompt_tokens=1, sampling_params=SamplingParams(), eos_token_ids=[],
        block_ids=[[5]], num_computed_tokens=0, num_scheduled_tokens=1, sample=True)]))
    via_bytes.apply(decode_plan(encode_plan(StepPlan(step_id=-1, new_requests=[NewRequest(
        request_id="gone", token_ids=[1], num_prompt_tokens=1, sampling_params=SamplingParams(), eos_token_ids=[],
        block_ids=[[5]], num_computed_tokens=0, num_scheduled_tokens=1, sample=True)]))))
    for step, plan in enumerate(_two_plans()):
        data = encode_plan(plan)
        assert isinstance(data, bytes) and b"torch" not in data
        decoded = decode_plan(data)
        assert decoded == plan
        assert decoded.new_requests == plan.new_requests  # sampling params included (a dataclass)
        batch_a, batch_b = direct.apply(plan), via_bytes.apply(decoded)
        assert batch_a.request_ids == batch_b.request_ids == plan.batch_request_ids()
        assert_same_inputs(host_inputs_from_rows(batch_a, BLOCK_SIZE), host_inputs_from_rows(batch_b, BLOCK_SIZE))
        if step == 0:  # the first step samples "a": its token arrives by the worker, not by the plan
            for batch in (batch_a, batch_b):
                batch.rows[0].mark_pending(0)
                batch.rows[0].confirm_token(33)
    assert "gone" not in direct and "gone" not in via_bytes
    assert direct.get("a").token_ids == via_bytes.get("a").token_ids == [9, 8, 7, 6, 5, 33]
    assert direct.get("a").block_ids == [[4, 1, 6]]
    assert direct.get("b").state_slot == 1


def test_decode_rejects_a_mistyped_plan() -> None:
    import msgspec

    bad = encode_plan(_two_plans()[0]).replace(b"num_prompt_tokens", b"num_prompt_tokenz")
    with pytest.raises(msgspec.ValidationError):
        decode_plan(bad)


def test_step_plan_module_does_not_import_torch() -> None:
    code = ("import sys; import tandem.engine_service.step_plan as m; "
            "assert 'torch' not in sys.modules, 'torch imported'; print(m.StepPlan.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "StepPlan", out.stderr


# -- 2. old/new equivalence on randomized traces -----------------------------------------------------


class TraceRunner:
    """A model stand-in with the runner's interface: random logits from its own generator. At
    every forward it checks the worker's inputs against the Sequence-based builder's."""

    def __init__(self, num_blocks: int, max_model_len: int, seed: int, memory_plan: MemoryPlan | None = None) -> None:
        self.num_blocks, self.block_size, self.max_model_len = num_blocks, BLOCK_SIZE, max_model_len
        self.vocab_size, self.eos_token_ids, self.device = VOCAB, (2,), torch.device("cpu")
        if memory_plan is not None:  # the engine builds its block manager from it
            self.memory_plan = memory_plan
        self.gen = torch.Generator().manual_seed(seed)
        self.engine: LLMEngine | None = None
        self.expected: list = []  # the step's ScheduledSeq entries, in plan batch order
        self.steps = self.pending_steps = self.preemptions = self.resumes = 0
        self.null_marks = self.new_with_null = self.window_checks = 0
        self.state_copies = 0

    def copy_state_slots(self, pairs: list[tuple[int, int]]) -> None:
        """State checkpoint restores / saves (checked for content in test_hybrid_prefix_cache.py)."""
        self.state_copies += len(pairs)

    def forward(self, host: HostInputs, previous_tokens: torch.Tensor | None = None) -> torch.Tensor:
        engine = self.engine
        old = prepare_host_inputs(self.expected, BLOCK_SIZE)
        assert_same_inputs(host, old)
        for item in self.expected:
            seq, row = item.seq, engine.worker.rows.get(item.seq.request_id)
            # Entry for entry, every group (given-back entries are NULL_BLOCK in both).
            assert row is not None and row.block_ids == seq.block_tables
            assert row.state_slot == seq.state_slot
            assert row.num_computed_tokens == seq.num_computed_tokens and row.num_tokens == seq.num_tokens
            for g, pool in enumerate(engine.block_manager.pools):
                if pool.window is None:
                    assert NULL_BLOCK not in row.block_ids[g]
                    continue
                # Every block a query of this step can see (or write) is live and this request's.
                first = first_needed_block(seq.num_computed_tokens, pool.window, BLOCK_SIZE)
                live = row.block_ids[g][first:]
                assert NULL_BLOCK not in live and all(pool.blocks[b].ref_count > 0 for b in live)
                self.window_checks += 1
            if item.sample:  # what the sampler reads
                assert row.params == seq.params and row.eos_token_ids == seq.eos_token_ids
                assert row.num_generated_tokens == seq.num_generated_tokens
                assert row.output_token_ids == seq.output_token_ids
                assert row.prompt_token_ids == seq.prompt_token_ids
                assert (row.generator is None) == (seq.params.seed is None)
        if host.pending_dst.size:
            assert previous_tokens is not None and int(host.pending_src.max()) < previous_tokens.shape[0]
            self.pending_steps += 1
        self.steps += 1
        return torch.randn(int(host.logits_indices.shape[0]), VOCAB, generator=self.gen) * 3


def _random_params(rng: random.Random) -> SamplingParams:
    kind = rng.random()
    params = SamplingParams(max_tokens=rng.randint(1, 14), temperature=0.0 if kind < 0.5 else 0.9,
                            ignore_eos=rng.random() < 0.5, min_tokens=rng.randint(0, 3))
    if rng.random() < 0.3:
        params.stop_token_ids = [rng.randrange(VOCAB)]
    if rng.random() < 0.2:
        params.seed = rng.randrange(1000)
    if rng.random() < 0.15:
        params.repetition_penalty = 1.3  # forces the step in flight to finish first
    if rng.random() < 0.1:
        params.top_k = 8
    return params


WINDOW = 6  # tokens: with 4-token blocks a request keeps about 3 blocks of the windowed group


def _windowed_plan(num_blocks: int, num_slots: int) -> MemoryPlan:
    """Two paged groups (full attention, a 6-token sliding window) and a state group."""
    return MemoryPlan(BLOCK_SIZE, (
        GroupPlan("full_attention", "full_attention", (0,), num_blocks=num_blocks),
        GroupPlan(f"sliding_window_{WINDOW}", "sliding_window", (1,), num_blocks=num_blocks, sliding_window=WINDOW),
        # State hits need a checkpoint (one every block here, see CacheConfig below).
        GroupPlan("state", "state", (2,), num_slots=num_slots, num_checkpoint_slots=6),
    ))


def _run_trace(seed: int, overlap: str, windowed: bool = False) -> TraceRunner:
    rng = random.Random(seed)
    num_blocks = rng.choice([12, 16, 40] if windowed else [10, 14, 40])
    memory_plan = _windowed_plan(num_blocks, rng.choice([2, 3, 8])) if windowed else None
    runner = TraceRunner(num_blocks, max_model_len=48, seed=seed, memory_plan=memory_plan)
    config = EngineConfig(
        ModelConfig(model="unused"),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks, state_checkpoint_stride=BLOCK_SIZE),
        SchedulerConfig(max_num_seqs=rng.choice([2, 4, 8]), max_num_batched_tokens=rng.choice([6, 16, 64]),
                        overlap_scheduling=overlap),
    )
    engine = LLMEngine(config, runner=runner)
    runner.engine = engine
    build = engine.plan_builder.build

    def build_and_ship(out):
        planned = build(out)
        runner.expected = planned.scheduled
        runner.resumes += sum(planned.plan.cached_requests.resumed)
        runner.null_marks += sum(n is not None for n in planned.plan.cached_requests.num_null_blocks)
        runner.new_with_null += sum(NULL_BLOCK in r.block_ids[-1] for r in planned.plan.new_requests)
        # The worker only ever sees the plan's bytes.
        planned.plan = decode_plan(encode_plan(planned.plan))
        return planned

    engine.plan_builder.build = build_and_ship
    # A shared prefix of 4 blocks (windowed): a hit after it needs only the window's blocks.
    shared = [rng.randrange(3, VOCAB) for _ in range(17 if windowed else 9)]
    live: set[str] = set()
    next_id = 0
    for step in range(400):
        if step < 60 and rng.random() < 0.4:
            rid = f"r{next_id % 12}"  # ids come back after their request ends: reused ids
            next_id += 1
            if rid not in live:
                prefix = shared[: rng.randint(0, len(shared))] if rng.random() < 0.5 else []
                prompt = prefix + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 16 if windowed else 20))]
                engine.add_request(rid, prompt, _random_params(rng))
                live.add(rid)
        if live and rng.random() < 0.05:
            rid = rng.choice(sorted(live))
            engine.abort(rid)
            live.discard(rid)
        for o in engine.step():
            if o.finished:
                live.discard(o.request_id)
        if step >= 60 and not engine.has_work():
            break
    assert not engine.has_work()
    assert len(engine.worker.rows) == 0 and engine.plan_builder.num_known == 0
    assert engine.block_manager.num_used_blocks == 0
    if windowed:
        assert engine.block_manager.state_slots.num_free == engine.block_manager.state_slots.num_slots
    runner.preemptions = engine.scheduler.num_preemptions
    runner.prefix_hits = engine.block_manager.prefix_hits
    return runner


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_worker_rows_match_sequence_inputs_on_random_traces(overlap: str) -> None:
    runners = [_run_trace(seed, overlap) for seed in range(12)]
    assert sum(r.steps for r in runners) > 300
    assert sum(r.preemptions for r in runners) > 0, "no trace preempted: the test lost its teeth"
    assert sum(r.resumes for r in runners) > 0
    if overlap == "on":
        assert sum(r.pending_steps for r in runners) > 50


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_worker_rows_match_sequence_inputs_with_a_sliding_window_group(overlap: str) -> None:
    """Two paged groups (one gives blocks back behind a window) and state slots, through the
    plan: the same old/new equivalence, with the given-back entries marked in the rows."""
    runners = [_run_trace(seed, overlap, windowed=True) for seed in range(12)]
    assert sum(r.steps for r in runners) > 300
    assert sum(r.preemptions for r in runners) > 0, "no trace preempted: the test lost its teeth"
    assert sum(r.resumes for r in runners) > 0
    assert sum(r.prefix_hits for r in runners) > 0, "no prefix hit"
    assert sum(r.state_copies for r in runners) > 0, "no state checkpoint saved or restored"
    assert sum(r.null_marks for r in runners) > 0, "no running request had entries given back"
    assert sum(r.new_with_null for r in runners) > 0, "no prefix hit over given-back window blocks"
    assert sum(r.window_checks for r in runners) > 300
    if overlap == "on":
        assert sum(r.pending_steps for r in runners) > 50


# -- 3. bookkeeping ----------------------------------------------------------------------------------


def test_both_sides_keep_pending_tokens_and_seeded_streams_alike() -> None:
    """The scheduler's Sequence and the worker's RequestRow share one pending-token bookkeeping
    and one seeded generator (tandem.engine_service.pending): the same calls give the same
    counts, tokens and random draws, and both refuse a confirm with nothing pending."""
    from tandem.engine_service.core.scheduler import ScheduledSeq, SchedulerOutput
    from tandem.engine_service.pending import PendingTokens, seeded_generator
    from tandem.engine_service.sequence import Sequence

    seq = Sequence("s", [5, 6, 7], SamplingParams(seed=11), eos_token_ids=(2,))
    seq.block_table = [1]
    row = WorkerRows().apply(StepPlanBuilder().build(SchedulerOutput(scheduled=[ScheduledSeq(seq, 3, True)])).plan).rows[0]
    assert isinstance(seq, PendingTokens) and isinstance(row, PendingTokens)
    for side in (seq, row):
        side.mark_pending(4)
        side.mark_pending(9)
    assert [(x.num_pending_tokens, x.pending_row, x.num_tokens, x.num_generated_tokens) for x in (seq, row)] == [
        (2, 9, 5, 2)] * 2
    for side in (seq, row):
        side.confirm_token(40)
        side.confirm_token(41)
        with pytest.raises(RuntimeError, match="no pending token to confirm"):
            side.confirm_token(42)
    assert seq.token_ids == row.token_ids == [5, 6, 7, 40, 41] and seq.num_pending_tokens == row.num_pending_tokens == 0
    draws = [torch.empty(6).exponential_(generator=g) for g in (seq.generator, row.generator, seeded_generator(
        SamplingParams(seed=11)))]
    assert torch.equal(draws[0], draws[1]) and torch.equal(draws[1], draws[2])
    assert seeded_generator(SamplingParams()) is None
    assert Sequence("u", [1], SamplingParams()).generator is None


def test_preemption_keeps_tokens_and_generator_and_resume_replaces_blocks() -> None:
    from tandem.engine_service.core.scheduler import ScheduledSeq, SchedulerOutput
    from tandem.engine_service.sequence import Sequence

    builder, rows = StepPlanBuilder(), WorkerRows()
    seq = Sequence("a", [5, 6, 7, 8, 9], SamplingParams(seed=3), eos_token_ids=(2,))
    seq.block_table = [3, 4]
    plan = builder.build(SchedulerOutput(scheduled=[ScheduledSeq(seq, 5, True)])).plan
    assert [r.request_id for r in plan.new_requests] == ["a"] and not plan.cached_requests
    row = rows.apply(plan).rows[0]
    generator = row.generator
    draw_before = torch.empty(4).exponential_(generator=generator)
    seq.num_computed_tokens = 5
    row.mark_pending(0)
    seq.mark_pending(0)

    # Preempted while its token is pending: blocks go, the token still arrives.
    seq.block_table, seq.num_computed_tokens = [], 0
    plan = builder.build(SchedulerOutput(preempted=[seq])).plan
    assert plan.preempted_req_ids == ["a"] and not plan.has_work
    assert len(rows.apply(plan)) == 0 and row.block_ids == [[]] and row.num_computed_tokens == 0
    row.confirm_token(44)
    seq.confirm_token(44)
    assert row.token_ids == seq.token_ids == [5, 6, 7, 8, 9, 44]

    # Resumed with a prefix hit: the new table replaces the row's, computed count from the plan.
    seq.block_table, seq.num_computed_tokens = [3, 8], 4
    plan = builder.build(SchedulerOutput(scheduled=[ScheduledSeq(seq, 2, True)])).plan
    delta = plan.cached_requests
    assert delta.request_ids == ["a"] and delta.resumed == [True]
    assert delta.new_block_ids == [[[3, 8]]] and delta.num_computed_tokens == [4]
    assert delta.state_slots == [None]
    batch = rows.apply(plan)
    assert batch.rows == [row] and row.block_ids == [[3, 8]] and row.generator is generator
    assert batch.block_tables(0) == [[3, 8]]
    assert_same_inputs(host_inputs_from_rows(batch, BLOCK_SIZE),
                       prepare_host_inputs([ScheduledSeq(seq, 2, True)], BLOCK_SIZE))
    assert not torch.equal(torch.empty(4).exponential_(generator=generator), draw_before)  # the stream goes on

    # A later delta sends only the new block; a drop goes with the next plan, once.
    seq.num_computed_tokens, seq.block_table = 6, [3, 8, 9]
    plan = builder.build(SchedulerOutput(scheduled=[ScheduledSeq(seq, 1, True)])).plan
    assert plan.cached_requests.new_block_ids == [[[9]]] and plan.cached_requests.resumed == [False]
    rows.apply(plan)
    assert row.block_ids == [[3, 8, 9]]
    seq.num_computed_tokens = 7  # a decode that needs no new block sends none
    plan = builder.build(SchedulerOutput(scheduled=[ScheduledSeq(seq, 1, True)])).plan
    assert plan.cached_requests.new_block_ids == [None]
    rows.apply(plan)
    assert row.block_ids == [[3, 8, 9]] and row.num_computed_tokens == 7
    builder.drop("a")
    builder.drop("a")
    plan = builder.build(SchedulerOutput()).plan
    assert plan.finished_req_ids == ["a"]
    rows.apply(plan)
    assert "a" not in rows and not rows.holds(row)
    assert builder.build(SchedulerOutput()).plan.finished_req_ids == []


def test_reused_id_gets_a_fresh_row_and_the_old_token_is_not_appended() -> None:
    from tandem.engine_service.core.scheduler import ScheduledSeq, SchedulerOutput
    from tandem.engine_service.sequence import Sequence

    builder, rows = StepPlanBuilder(), WorkerRows()
    old = Sequence("x", [1, 2, 3], SamplingParams())
    old.block_table = [0]
    old_row = rows.apply(builder.build(SchedulerOutput(scheduled=[ScheduledSeq(old, 3, True)])).plan).rows[0]
    old_row.mark_pending(0)
    builder.drop("x")  # aborted while its token is in flight
    new = Sequence("x", [7, 7], SamplingParams())
    new.block_table = [1]
    plan = builder.build(SchedulerOutput(scheduled=[ScheduledSeq(new, 2, True)])).plan
    assert plan.finished_req_ids == ["x"] and [r.request_id for r in plan.new_requests] == ["x"]
    (row,) = rows.apply(plan).rows
    assert row is not old_row and row.token_ids == [7, 7]
    assert rows.holds(row) and not rows.holds(old_row)
    old_row.confirm_token(5)  # the old step's token, read back late (StepWorker.collect)
    assert row.token_ids == [7, 7] and row.num_pending_tokens == 0


def test_plans_naming_unknown_or_duplicate_rows_are_rejected() -> None:
    def delta(rid: str, blocks, computed: int, n: int) -> CachedRequests:
        cached = CachedRequests()
        cached.append(rid, blocks, num_computed_tokens=computed, num_scheduled_tokens=n, sample=True)
        return cached

    rows = WorkerRows()
    with pytest.raises(ValueError, match="does not hold"):
        rows.apply(StepPlan(step_id=0, cached_requests=delta("ghost", None, 0, 1)))
    with pytest.raises(ValueError, match="does not hold"):
        rows.apply(StepPlan(step_id=0, preempted_req_ids=["ghost"]))
    new = NewRequest(request_id="a", token_ids=[1, 2], num_prompt_tokens=2, sampling_params=SamplingParams(),
                     eos_token_ids=[], block_ids=[[0]], num_computed_tokens=0, num_scheduled_tokens=2, sample=True)
    rows.apply(StepPlan(step_id=0, new_requests=[new]))
    with pytest.raises(ValueError, match="already holds"):
        rows.apply(StepPlan(step_id=1, new_requests=[new]))
    with pytest.raises(ValueError, match="cache groups"):
        rows.apply(StepPlan(step_id=2, num_cache_groups=2))
    with pytest.raises(ValueError, match="cannot run"):
        host_inputs_from_rows(rows.apply(StepPlan(step_id=3, cached_requests=delta("a", None, 2, 1))), BLOCK_SIZE)
    with pytest.raises(ValueError, match="cache groups"):
        rows.apply(StepPlan(step_id=4, cached_requests=delta("a", [[1], [2]], 0, 1)))
    slotted = StepPlan(step_id=7, new_requests=[NewRequest(
        request_id="s", token_ids=[1, 2, 3], num_prompt_tokens=3, sampling_params=SamplingParams(), eos_token_ids=[],
        block_ids=[[4]], num_computed_tokens=0, num_scheduled_tokens=3, sample=True, state_slot=2)])
    rows.apply(slotted)
    assert rows.get("s").state_slot == 2
    rows.apply(StepPlan(step_id=8, preempted_req_ids=["s"]))
    assert rows.get("s").state_slot is None and rows.get("s").block_ids == [[]]
    resume = CachedRequests()
    resume.append("s", [[6]], num_computed_tokens=0, num_scheduled_tokens=3, sample=True, resumed=True, state_slot=5)
    back = rows.apply(decode_plan(encode_plan(StepPlan(step_id=9, cached_requests=resume))))
    assert back.rows[0].state_slot == 5 and back.rows[0].block_ids == [[6]]
    ragged = delta("a", None, 0, 1)
    ragged.sample.append(True)
    with pytest.raises(ValueError, match="differ in length"):
        rows.apply(StepPlan(step_id=6, cached_requests=ragged))
    with pytest.raises(ValueError, match="blocks cannot hold"):
        host_inputs_from_rows(rows.apply(StepPlan(step_id=5, cached_requests=delta("a", None, 0, 2))), 1)


def test_given_back_window_entries_are_marked_in_the_rows() -> None:
    """A sliding-window group's given-back entries reach the row as NULL_BLOCK (and the row's
    arrays then match the scheduler's), whether or not blocks were appended in the same plan;
    counts that do not fit the row are rejected."""
    rows = WorkerRows(2)
    rows.apply(StepPlan(step_id=0, num_cache_groups=2, new_requests=[NewRequest(
        request_id="w", token_ids=list(range(3, 13)), num_prompt_tokens=10, sampling_params=SamplingParams(),
        eos_token_ids=[], block_ids=[[0, 1, 2], [5, 6, 7]], num_computed_tokens=0, num_scheduled_tokens=10,
        sample=True)]))
    marks = CachedRequests()
    marks.append("w", None, num_computed_tokens=10, num_scheduled_tokens=1, sample=False, num_null_blocks=[0, 1])
    rows.get("w").token_ids.append(20)
    batch = rows.apply(decode_plan(encode_plan(StepPlan(step_id=1, num_cache_groups=2, cached_requests=marks))))
    assert rows.get("w").block_ids == [[0, 1, 2], [NULL_BLOCK, 6, 7]]
    host = host_inputs_from_rows(batch, BLOCK_SIZE)
    assert host.block_tables.tolist() == [[0, 1, 2]] and host.extra_groups[0][0].tolist() == [[0, 6, 7]]
    assert host.slot_mapping.tolist() == [2 * BLOCK_SIZE + 2] and host.extra_groups[0][1].tolist() == [7 * BLOCK_SIZE + 2]
    grow = CachedRequests()
    grow.append("w", [[3], [8]], num_computed_tokens=11, num_scheduled_tokens=1, sample=False, num_null_blocks=[0, 2])
    rows.apply(StepPlan(step_id=2, num_cache_groups=2, cached_requests=grow))
    assert rows.get("w").block_ids == [[0, 1, 2, 3], [NULL_BLOCK, NULL_BLOCK, 7, 8]]
    bad = CachedRequests()
    bad.append("w", None, num_computed_tokens=11, num_scheduled_tokens=1, sample=False, num_null_blocks=[0, 9])
    with pytest.raises(ValueError, match="given-back entries"):
        rows.apply(StepPlan(step_id=3, num_cache_groups=2, cached_requests=bad))
    one = CachedRequests()
    one.append("w", None, num_computed_tokens=11, num_scheduled_tokens=1, sample=False, num_null_blocks=[2])
    with pytest.raises(ValueError, match="cache groups"):
        rows.apply(StepPlan(step_id=4, num_cache_groups=2, cached_requests=one))


# -- 4. old/new end to end on a real (tiny) model ---------------------------------------------------


def _sequence_path_tokens(runner, execute, config: EngineConfig, requests) -> dict[str, list[int]]:
    """The engine loop as it was before the plan: the runner and the sampler read the scheduler's
    Sequences directly (no overlap)."""
    from tandem.engine_service.cache.block_manager import BlockManager
    from tandem.engine_service.worker.sampler import Sampler
    from tandem.engine_service.core.scheduler import Scheduler
    from tandem.engine_service.sequence import Sequence
    from tandem.engine_service.core.stopping import check_stop

    bm = BlockManager(runner.num_blocks, runner.block_size, enable_prefix_caching=True)
    scheduler = Scheduler(config.scheduler, bm, runner.max_model_len)
    sampler = Sampler(vocab_size=runner.vocab_size)
    seqs = {rid: Sequence(rid, tokens, params, eos_token_ids=tuple(runner.eos_token_ids))
            for rid, tokens, params in requests}
    for seq in seqs.values():
        scheduler.add(seq)
    while scheduler.has_work():
        out = scheduler.schedule()
        if out.scheduled:
            logits = execute(runner, out.scheduled)
            sampling = [item.seq for item in out.scheduled if item.sample]
            for seq, token in zip(sampling, sampler.sample(logits, sampling).token_ids):
                seq.append_token(token)
                check_stop(seq, runner.max_model_len)
        scheduler.update(out)
    assert scheduler.num_preemptions > 0
    return {rid: seq.output_token_ids for rid, seq in seqs.items()}


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_engine_through_plans_matches_the_sequence_path_on_a_real_model(overlap: str, execute) -> None:
    from tandem.engine_service.worker.model_runner import ModelRunner

    def config(mode: str) -> EngineConfig:
        return EngineConfig(
            ModelConfig(model="dummy:tiny-qwen3", max_model_len=96),
            CacheConfig(block_size=BLOCK_SIZE, num_blocks=20),  # small: preemptions happen
            SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=12, overlap_scheduling=mode),
        )

    runner = ModelRunner(config("off"))
    rng = random.Random(5)
    shared = [rng.randrange(3, 300) for _ in range(8)]
    requests = []
    for i in range(7):
        # Greedy or seeded only: unseeded rows share one generator, whose draws depend on batch order.
        params = SamplingParams(max_tokens=10 + i, temperature=0.0 if i % 2 else 0.9, top_k=30 if i % 3 else 0,
                                top_p=0.9, seed=None if i % 2 else 100 + i, ignore_eos=True,
                                min_tokens=2, stop_token_ids=[7] if i == 3 else [],
                                repetition_penalty=1.2 if i == 2 else 1.0,
                                frequency_penalty=0.5 if i == 4 else 0.0)
        prompt = (shared if i % 2 else []) + [rng.randrange(3, 300) for _ in range(5 + 2 * i)]
        requests.append((f"r{i}", prompt, params))
    expected = _sequence_path_tokens(runner, execute, config("off"), requests)
    engine = LLMEngine(config(overlap), runner=runner)
    for rid, tokens, params in requests:
        engine.add_request(rid, tokens, params)
    got = {rid: [] for rid, _, _ in requests}
    while engine.has_work():
        for o in engine.step():
            got[o.request_id].extend(o.new_token_ids)
    assert engine.scheduler.num_preemptions > 0 and len(engine.worker.rows) == 0
    assert got == expected
    assert any(len(t) > 5 for t in got.values())
