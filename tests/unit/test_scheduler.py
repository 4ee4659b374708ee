"""Scheduler: token budget, chunked prefill, ordering, preemption, aborts, prefix hits.

A fake model stands in for the runner: its "KV cache" stores (position, token id) per slot, so
every step checks that the context a sequence attends to (prefix hits included) really holds
that sequence's tokens, and that no step writes into a block another sequence shares.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from tandem.engine_service.config import SchedulerConfig
from tandem.engine_service.cache.block_manager import BlockManager
from tandem.engine_service.core.scheduler import (
    EXCEEDS_MAX_MODEL_LEN,
    KV_CACHE_TOO_SMALL,
    Scheduler,
    ScheduledSeq,
    SchedulerOutput,
)
from tandem.engine_service.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus

BS = 4


def fake_token(seq: Sequence) -> int:
    """Deterministic next token, a function of the request id and output index only."""
    return (sum(map(ord, seq.request_id)) * 7 + seq.num_output_tokens * 13) % 50 + 1000


class FakeModel:
    """Writes (position, token) into the slots of scheduled tokens and checks the context."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.kv: dict[int, tuple[int, int]] = {}

    def execute(self, scheduled: list[ScheduledSeq]) -> None:
        written: set[int] = set()
        for item in scheduled:
            seq = item.seq
            tokens = seq.token_ids
            start = seq.num_computed_tokens
            assert start + item.num_new_tokens <= seq.num_tokens
            assert len(seq.block_table) * BS >= start + item.num_new_tokens
            for p in range(start):
                assert self.kv.get(self.bm.slot(seq, p)) == (p, tokens[p]), (seq, p)
            for p in range(start, start + item.num_new_tokens):
                slot = self.bm.slot(seq, p)
                assert slot not in written
                assert self.bm.blocks[slot // BS].ref_count == 1, "writing into a shared block"
                written.add(slot)
                self.kv[slot] = (p, tokens[p])


class Driver:
    """schedule -> fake model -> append tokens, stop like check_stop (length only) -> update."""

    def __init__(
        self,
        num_blocks: int = 64,
        budget: int = 64,
        max_num_seqs: int = 16,
        chunked: bool = True,
        caching: bool = True,
        max_model_len: int | None = None,
        prefill_cap: int = 0,
        policy: str = "fcfs",
    ) -> None:
        self.config = SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
            max_prefill_tokens_per_seq=prefill_cap, scheduling_policy=policy,
        )
        # Without chunked prefill the scheduler requires max_model_len <= the step budget.
        self.max_model_len = max_model_len or (10_000 if chunked else budget)
        self.bm = BlockManager(num_blocks, BS, enable_prefix_caching=caching)
        self.sched = Scheduler(self.config, self.bm, self.max_model_len)
        self.model = FakeModel(self.bm)
        self.seqs: dict[str, Sequence] = {}
        # Called for each sequence ending here, before the scheduler frees it (the engine's
        # place for the KV connector to lease a prefill leg's blocks).
        self.on_finished = lambda seq: None

    def add(self, rid: str, prompt: list[int], max_tokens: int = 4) -> Sequence:
        seq = Sequence(rid, prompt, SamplingParams(max_tokens=max_tokens))
        self.seqs[rid] = seq
        self.sched.add(seq)
        return seq

    def expected_len(self, seq: Sequence) -> int:
        return min(seq.params.max_tokens, self.max_model_len - seq.num_prompt_tokens)

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled)
        assert out.num_batched_tokens <= self.config.max_num_batched_tokens
        assert len({id(s.seq) for s in out.scheduled}) == len(out.scheduled)
        for item in out.scheduled:
            assert item.num_new_tokens > 0
            assert item.sample == (item.seq.num_computed_tokens + item.num_new_tokens == item.seq.num_tokens)
        self.model.execute(out.scheduled)
        ended = []
        for item in out.scheduled:
            seq = item.seq
            if item.sample:
                seq.append_token(fake_token(seq))
                if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
                    seq.finish(FinishReason.LENGTH)
                    ended.append(seq)
        self.sched.begin_step(out)  # with end_step: update(out), the ending hook in between
        for seq in ended:
            self.on_finished(seq)
        self.sched.end_step(out)
        assert self.sched.num_running <= self.config.max_num_seqs
        return out

    def run(self, max_steps: int = 1000) -> int:
        for n in range(max_steps):
            if not self.sched.has_work():
                return n
            self.step()
        raise AssertionError("scheduler did not drain")


def expected_outputs(seq: Sequence, n: int) -> list[int]:
    probe = Sequence(seq.request_id, [0], SamplingParams())
    out = []
    for _ in range(n):
        t = fake_token(probe)
        probe.append_token(t)
        out.append(t)
    return out


def check_invariants(d: Driver) -> None:
    bm, sched = d.bm, d.sched
    holders: Counter[int] = Counter()
    for seq in sched.running:
        assert seq.status == SequenceStatus.RUNNING
        assert len(set(seq.block_table)) == len(seq.block_table)
        assert len(seq.block_table) * BS >= seq.num_computed_tokens
        holders.update(seq.block_table)
        for i, h in enumerate(seq.block_hashes):
            blk = bm.blocks[seq.block_table[i]]
            assert blk.hash in (None, h)  # unhashed only for a duplicate of a cached block
    for seq in sched.waiting:
        assert seq.status == SequenceStatus.WAITING
        assert seq.block_table == [] and seq.num_computed_tokens == 0
    for blk in bm.blocks:
        assert blk.ref_count == holders[blk.block_id]
        if holders[blk.block_id] > 1:
            assert blk.hash is not None, "a block is shared only through the prefix cache"
    assert sum(b.ref_count for b in bm.blocks) == sum(len(s.block_table) for s in sched.running)
    assert bm.num_free_blocks == sum(1 for b in bm.blocks if b.ref_count == 0)
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks


def test_chunked_prefill_samples_only_on_last_chunk() -> None:
    d = Driver(budget=4)
    seq = d.add("a", list(range(10)), max_tokens=2)
    plan = []
    while d.sched.has_work():
        out = d.step()
        plan.append([(s.num_new_tokens, s.sample) for s in out.scheduled])
    assert plan == [[(4, False)], [(4, False)], [(2, True)], [(1, True)]]
    assert seq.output_token_ids == expected_outputs(seq, 2)
    assert seq.num_cached_prompt_tokens == 0
    assert d.bm.num_used_blocks == 0


def test_budget_fully_used_when_work_allows() -> None:
    d = Driver(budget=7, caching=False)
    rng = random.Random(0)
    for i in range(6):
        d.add(f"s{i}", [rng.randrange(100) for _ in range(rng.randint(3, 20))], max_tokens=rng.randint(1, 5))
    while d.sched.has_work():
        pending = sum(s.num_uncomputed_tokens for s in d.seqs.values() if not s.is_finished)
        out = d.step()
        assert out.num_batched_tokens == min(7, pending)
    for s in d.seqs.values():
        assert s.output_token_ids == expected_outputs(s, d.expected_len(s))


def test_running_decodes_before_new_prefills() -> None:
    d = Driver(budget=8)
    a = d.add("a", [1, 2, 3], max_tokens=5)
    d.step()
    b = d.add("b", list(range(20)), max_tokens=1)
    out = d.step()
    assert [(s.seq, s.num_new_tokens, s.sample) for s in out.scheduled] == [(a, 1, True), (b, 7, False)]


def test_max_num_seqs() -> None:
    d = Driver(max_num_seqs=2)
    a = d.add("a", [1, 2], max_tokens=1)
    b = d.add("b", [3, 4], max_tokens=3)
    c = d.add("c", [5, 6], max_tokens=1)
    out = d.step()
    assert [s.seq for s in out.scheduled] == [a, b]
    assert d.sched.num_waiting == 1 and d.sched.num_running == 1  # a finished at max_tokens=1
    out = d.step()
    assert [s.seq for s in out.scheduled] == [b, c]
    d.run()
    assert all(s.output_token_ids == expected_outputs(s, d.expected_len(s)) for s in (a, b, c))


def test_priority_policy_admits_a_high_priority_request_before_queued_low_ones() -> None:
    def run(policy: str) -> list[str]:
        d = Driver(max_num_seqs=1, policy=policy)
        order: list[str] = []
        for rid, priority in (("low-1", 5), ("low-2", 5), ("low-3", 5)):
            seq = Sequence(rid, [1, 2, 3], SamplingParams(max_tokens=2, priority=priority))
            d.seqs[rid] = seq
            d.sched.add(seq)
        d.step()  # low-1 runs (max_num_seqs 1); low-2 and low-3 queue behind it
        urgent = Sequence("urgent", [4, 5, 6], SamplingParams(max_tokens=2, priority=-1))
        d.seqs["urgent"] = urgent
        d.sched.add(urgent)
        same = Sequence("low-4", [7, 8], SamplingParams(max_tokens=2, priority=5))
        d.seqs["low-4"] = same
        d.sched.add(same)
        for _ in range(100):
            if not d.sched.has_work():
                break
            for item in d.step().scheduled:
                if item.seq.request_id not in order:
                    order.append(item.seq.request_id)
        return order

    assert run("priority") == ["low-1", "urgent", "low-2", "low-3", "low-4"]  # ties keep arrival order
    assert run("fcfs") == ["low-1", "low-2", "low-3", "urgent", "low-4"]  # the priority field is ignored


def test_without_chunked_prefill_whole_prompts_only() -> None:
    d = Driver(budget=10, chunked=False)
    a = d.add("a", list(range(6)), max_tokens=3)
    b = d.add("b", list(range(50, 56)), max_tokens=2)
    too_long = d.add("c", list(range(100, 111)), max_tokens=1)
    out = d.step()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 6)]  # b does not fit in 4
    out = d.step()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 6)]
    # c reached the head of the queue; it is longer than max_model_len (= the budget here).
    assert out.finished == [too_long]
    assert too_long.finish_reason == FinishReason.ERROR and too_long.stop_reason == EXCEEDS_MAX_MODEL_LEN
    d.run()
    assert a.num_output_tokens == 3 and b.num_output_tokens == 2
    assert d.bm.num_used_blocks == 0


def test_unchunked_budget_must_cover_max_model_len() -> None:
    config = SchedulerConfig(max_num_batched_tokens=16, enable_chunked_prefill=False)
    with pytest.raises(ValueError):
        Scheduler(config, BlockManager(8, BS), max_model_len=17)
    Scheduler(config, BlockManager(8, BS), max_model_len=16)


def test_preempts_latest_arrivals_first() -> None:
    d = Driver(num_blocks=4)
    a = d.add("a", list(range(7)), max_tokens=4)
    b = d.add("b", [9, 8, 7], max_tokens=3)
    c = d.add("c", [6, 5, 4], max_tokens=3)
    d.step()  # all prefill: 2 + 1 + 1 blocks, pool full
    d.step()  # all decode inside their last block
    late = d.add("late", [1, 2], max_tokens=1)
    out = d.step()
    # a needs a third block: c (the latest) yields. Then b needs a second block and is itself
    # the latest running sequence left, so it yields too.
    assert [s.seq for s in out.scheduled] == [a]
    assert out.preempted == [c, b]
    assert list(d.sched.waiting) == [b, c, late]  # back in arrival order, ahead of new work
    for s in (b, c):
        assert s.status == SequenceStatus.WAITING
        assert s.block_table == [] and s.num_computed_tokens == 0 and s.num_preemptions == 1
    assert d.sched.num_preemptions == 2
    d.run()
    for s in (a, b, c, late):
        assert s.output_token_ids == expected_outputs(s, d.expected_len(s))
    assert d.bm.num_used_blocks == 0


def test_no_admission_in_a_step_that_preempted() -> None:
    d = Driver(num_blocks=4, budget=9, caching=False)
    a = d.add("a", list(range(4)), max_tokens=3)
    b = d.add("b", list(range(10, 22)), max_tokens=2)
    out = d.step()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 4), (b, 5)]
    out = d.step()
    # a takes the last free block; b's next chunk needs another and b is the latest: it
    # yields. Its two freed blocks would hold an 8-token chunk, but memory is tight: no one
    # is admitted this step.
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1)]
    assert out.preempted == [b]
    assert d.bm.num_used_blocks == 2
    d.run()
    assert b.output_token_ids == expected_outputs(b, 2)


def test_preempts_itself_when_latest() -> None:
    d = Driver(num_blocks=3)
    a = d.add("a", list(range(6)), max_tokens=3)
    b = d.add("b", [9, 8, 7], max_tokens=3)
    d.step()
    d.step()
    out = d.step()  # b crosses into a second block first; it is the latest, so it yields
    assert [s.seq for s in out.scheduled] == [a]
    assert out.preempted == [b]
    d.run()
    assert a.output_token_ids == expected_outputs(a, 3)
    assert b.output_token_ids == expected_outputs(b, 3)


@pytest.mark.parametrize("caching", [True, False])
def test_tiny_pool_with_preemption_completes(caching: bool) -> None:
    d = Driver(num_blocks=8, budget=12, caching=caching)
    rng = random.Random(7)
    shared = [rng.randrange(30) for _ in range(8)]
    for i in range(8):
        prompt = shared[: rng.randint(0, 8)] + [rng.randrange(30) for _ in range(rng.randint(1, 8))]
        d.add(f"r{i}", prompt, max_tokens=rng.randint(4, 12))
    while d.sched.has_work():
        d.step()
        check_invariants(d)
    assert d.sched.num_preemptions > 0
    for s in d.seqs.values():
        assert s.finish_reason == FinishReason.LENGTH
        assert s.output_token_ids == expected_outputs(s, d.expected_len(s))
    assert d.bm.num_used_blocks == 0 and d.bm.num_free_blocks == 8


def test_sequence_larger_than_pool_is_ended() -> None:
    d = Driver(num_blocks=2, max_model_len=100)
    big = d.add("big", list(range(12)))
    out = d.step()
    assert out.scheduled == [] and out.finished == [big]
    assert big.finish_reason == FinishReason.ERROR and big.stop_reason == KV_CACHE_TOO_SMALL
    assert not d.sched.has_work()

    # Fits at first, outgrows the pool while alone: ended, not preempted forever.
    grows = d.add("grows", list(range(6)), max_tokens=10)
    outs = [d.step() for _ in range(4)]
    assert outs[-1].finished == [grows] and outs[-1].preempted == []
    assert grows.finish_reason == FinishReason.ERROR
    assert grows.num_output_tokens == 3  # 9 tokens: the K/V of the 9th would need a 3rd block
    assert not d.sched.has_work() and d.bm.num_used_blocks == 0


def test_abort_frees_blocks() -> None:
    d = Driver(budget=8, max_num_seqs=1)
    a = d.add("a", list(range(10)))
    b = d.add("b", list(range(5)))
    d.step()
    assert d.bm.num_used_blocks == 2
    assert d.sched.abort("a") is a
    assert a.finish_reason == FinishReason.ABORT and a.block_table == []
    assert d.bm.num_used_blocks == 0
    assert d.sched.get("a") is None and d.sched.abort("a") is None
    assert d.sched.abort("b") is b and not d.sched.has_work()
    assert d.sched.abort("nope") is None


def test_abort_between_schedule_and_update() -> None:
    d = Driver()
    a = d.add("a", list(range(10)))
    b = d.add("b", list(range(20, 30)))
    out = d.sched.schedule()
    d.sched.abort("a")
    b.append_token(1)
    d.sched.update(out)
    assert a.block_table == [] and a.num_computed_tokens == 0
    assert b.num_computed_tokens == 10
    check_invariants(d)


def test_prefix_hits_reduce_scheduled_tokens() -> None:
    d = Driver()
    first = d.add("first", list(range(20)), max_tokens=1)
    d.run()
    assert first.num_cached_prompt_tokens == 0
    b = d.add("b", list(range(16)) + [90, 91, 92, 93])
    same = d.add("same", list(range(20)))
    out = d.step()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(b, 4), (same, 4)]
    assert b.num_cached_prompt_tokens == 16
    assert same.num_cached_prompt_tokens == 16  # not 20: the last token must be computed
    assert d.bm.prefix_hits == 32


def test_update_requires_appended_token() -> None:
    d = Driver()
    d.add("a", [1, 2, 3])
    out = d.sched.schedule()
    with pytest.raises(RuntimeError):
        d.sched.update(out)


def test_waiting_tokens_and_duplicate_ids() -> None:
    d = Driver(max_num_seqs=1)
    d.add("a", list(range(5)))
    d.add("b", list(range(7)))
    assert d.sched.waiting_tokens == 12
    d.step()
    assert d.sched.waiting_tokens == 7
    with pytest.raises(ValueError):
        d.add("b", [1])


@pytest.mark.parametrize(
    "chunked,caching,budget,cap",
    [(True, True, 16, 0), (True, False, 16, 0), (False, True, 32, 0), (False, False, 32, 0), (True, True, 16, 3),
     (True, False, 12, 5)],
)
def test_randomized_invariants(chunked: bool, caching: bool, budget: int, cap: int) -> None:
    rng = random.Random(1234)
    d = Driver(num_blocks=16, budget=budget, max_num_seqs=6, chunked=chunked, caching=caching, prefill_cap=cap)
    bases = [[rng.randrange(8) for _ in range(rng.randint(8, 12))] for _ in range(3)]
    aborted: set[str] = set()
    n = 0
    for step in range(300):
        if rng.random() < 0.35:
            prompt = rng.choice(bases)[: rng.randint(0, 12)] + [rng.randrange(8) for _ in range(rng.randint(1, 18))]
            d.add(f"q{n}", prompt, max_tokens=rng.randint(1, 12))
            n += 1
        live = [s for s in d.seqs.values() if not s.is_finished]
        if live and rng.random() < 0.03:
            victim = rng.choice(live)
            assert d.sched.abort(victim.request_id) is victim
            aborted.add(victim.request_id)
        decodes = [s for s in d.sched.running if s.num_uncomputed_tokens == 1]
        out = d.step()
        check_invariants(d)
        chunks = {id(item.seq): item.num_new_tokens for item in out.scheduled}
        if cap and chunked:
            assert all(item.num_new_tokens <= cap for item in out.scheduled)
        if not out.preempted:  # every running decode got its token
            assert all(id(s) in chunks for s in decodes)
    d.run()
    check_invariants(d)
    assert d.bm.num_used_blocks == 0
    assert d.sched.num_preemptions > 0
    if caching:
        assert d.bm.prefix_hits > 0
    for rid, s in d.seqs.items():
        if rid in aborted:
            assert s.finish_reason == FinishReason.ABORT
        else:
            assert s.finish_reason == FinishReason.LENGTH, s
            assert s.output_token_ids == expected_outputs(s, d.expected_len(s))


def test_prefill_cap_spreads_a_long_prompt_and_admits_a_short_one_next_step() -> None:
    d = Driver(budget=64, prefill_cap=8, num_blocks=64)
    long = d.add("long", list(range(100)), max_tokens=2)
    out = d.step()
    assert [(s.seq, s.num_new_tokens, s.sample) for s in out.scheduled] == [(long, 8, False)]
    short = d.add("short", [7, 8, 9, 10, 11], max_tokens=3)
    out = d.step()  # the newcomer's whole prompt runs beside the long prompt's next chunk
    assert [(s.seq, s.num_new_tokens, s.sample) for s in out.scheduled] == [(long, 8, False), (short, 5, True)]
    out = d.step()
    assert [(s.seq, s.num_new_tokens, s.sample) for s in out.scheduled] == [(long, 8, False), (short, 1, True)]
    d.run()
    assert long.output_token_ids == expected_outputs(long, 2)
    assert short.output_token_ids == expected_outputs(short, 3)
    assert d.bm.num_used_blocks == 0


def test_prefill_cap_interleaves_two_long_prompts_and_chunks_a_waiting_one() -> None:
    d = Driver(budget=20, prefill_cap=6, num_blocks=64, caching=False)
    a = d.add("a", list(range(30)), max_tokens=1)
    b = d.add("b", list(range(100, 130)), max_tokens=1)
    c = d.add("c", list(range(200, 230)), max_tokens=1)
    out = d.step()  # every prompt gets a chunk of the cap (2 tokens of budget stay unused)
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 6), (b, 6), (c, 6)]
    steps = d.run()
    assert steps == 4  # 30 tokens at 6 a step: 5 steps in all for each; none waits for another
    assert all(s.output_token_ids == expected_outputs(s, 1) for s in (a, b, c))


def test_prefill_cap_off_keeps_the_greedy_budget_use() -> None:
    d = Driver(budget=64, prefill_cap=0)
    long = d.add("long", list(range(100)), max_tokens=1)
    d.add("short", [1, 2, 3], max_tokens=1)
    out = d.step()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(long, 64)]


def test_prefill_never_takes_a_running_decode_token() -> None:
    d = Driver(budget=16, prefill_cap=0, num_blocks=64, caching=False)
    long = d.add("long", list(range(40)), max_tokens=1)
    dec = [d.add(f"d{i}", [i + 1, i + 2], max_tokens=5) for i in range(3)]
    d.sched.waiting.rotate(-1)  # the short ones first: they become decodes behind the long prompt
    d.step()
    assert [s.num_uncomputed_tokens for s in dec] == [1, 1, 1]
    assert d.sched.running[-1] is long  # admitted last, with the budget the decodes left
    d.sched.running.insert(0, d.sched.running.pop())  # ... and now ahead of them in arrival order
    out = d.step()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(long, 13)] + [(s, 1) for s in dec]


def test_prefill_cap_is_validated() -> None:
    with pytest.raises(ValueError, match="max_prefill_tokens_per_seq"):
        SchedulerConfig(max_prefill_tokens_per_seq=-1).validate()


def test_prefill_cap_default_depends_on_the_device_and_needs_chunked_prefill() -> None:
    assert SchedulerConfig().prefill_cap("cuda") == 512
    assert SchedulerConfig().prefill_cap("cpu") == 16
    assert SchedulerConfig(max_prefill_tokens_per_seq=0).prefill_cap("cpu") == 0
    assert SchedulerConfig(max_prefill_tokens_per_seq=7).prefill_cap("cuda") == 7
    bm = BlockManager(8, BS)
    assert Scheduler(SchedulerConfig(), bm, 64, device_type="cpu").prefill_cap == 16
    assert Scheduler(SchedulerConfig(), bm, 64).prefill_cap == 512  # the device defaults to CUDA
    unchunked = SchedulerConfig(max_num_batched_tokens=64, enable_chunked_prefill=False, max_prefill_tokens_per_seq=8)
    assert Scheduler(unchunked, bm, 64).prefill_cap == 0  # whole prompts only: nothing to cap



def test_prefill_cap_of_one_chunks_even_a_two_token_prompt() -> None:
    d = Driver(budget=8, prefill_cap=1)
    seq = d.add("a", [5, 6], max_tokens=2)
    plan = []
    while d.sched.has_work():
        plan.append([(s.num_new_tokens, s.sample) for s in d.step().scheduled])
    assert plan == [[(1, False)], [(1, True)], [(1, True)]]
    assert seq.output_token_ids == expected_outputs(seq, 2)


def test_prefill_gets_nothing_when_the_decodes_after_it_need_the_whole_budget() -> None:
    d = Driver(budget=16, prefill_cap=0, num_blocks=64, caching=False)
    long = d.add("long", list(range(40)), max_tokens=1)
    dec = [d.add(f"d{i}", [i + 1, i + 2], max_tokens=5) for i in range(3)]
    d.sched.waiting.rotate(-1)
    d.step()
    d.sched.running.insert(0, d.sched.running.pop())  # the long prompt ahead of three decodes
    d.config.max_num_batched_tokens = 3  # exactly one token per decode
    before = long.num_computed_tokens
    out = d.step()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(s, 1) for s in dec]
    assert long.num_computed_tokens == before  # it waits for a step with budget left


# -- found by mutation testing (docs/testing.md) ------------------------------------------------


def test_configuration_and_duplicate_id_errors_read_whole() -> None:
    config = SchedulerConfig(max_num_batched_tokens=16, enable_chunked_prefill=False)
    with pytest.raises(ValueError) as err:
        Scheduler(config, BlockManager(8, BS), max_model_len=17)
    assert str(err.value) == "without chunked prefill, max_num_batched_tokens (16) must be >= max_model_len (17)"
    d = Driver()
    d.add("b", [1, 2])
    with pytest.raises(ValueError) as err:
        d.add("b", [1])
    assert str(err.value) == "duplicate request id 'b'"


def test_last_budget_token_admits_a_prompt_chunk() -> None:
    # Every scheduled sequence gets min(tokens it has to compute, budget left): one token left
    # is still a one-token chunk for the next waiting prompt.
    d = Driver(budget=3)
    a = d.add("a", [1, 2], max_tokens=1)
    b = d.add("b", [3, 4, 5, 6, 7], max_tokens=1)
    out = d.step()
    assert [(s.seq, s.num_new_tokens, s.sample) for s in out.scheduled] == [(a, 2, True), (b, 1, False)]


def test_a_too_long_head_does_not_hold_up_the_next_request() -> None:
    d = Driver(max_model_len=8)
    too_long = d.add("long", list(range(9)), max_tokens=1)
    ok = d.add("ok", [1, 2, 3], max_tokens=1)
    out = d.step()
    assert out.finished == [too_long] and too_long.stop_reason == EXCEEDS_MAX_MODEL_LEN
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(ok, 3)]


def test_every_sequence_ending_with_its_pending_token_frees_its_slot() -> None:
    # Overlapped scheduling: all three running sequences end with the token still pending, so
    # all three slots are free for the two waiting requests in the very next step.
    sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64), BlockManager(64, BS), 10_000)
    running = [Sequence(f"r{i}", [i + 1, i + 2], SamplingParams(max_tokens=1)) for i in range(3)]
    waiting = [Sequence(f"w{i}", [i + 7, i + 8], SamplingParams(max_tokens=1)) for i in range(2)]
    for seq in running + waiting:
        sched.add(seq)
    first = sched.schedule()
    assert [s.seq for s in first.scheduled] == running
    sched.begin_step(first)
    for row, item in enumerate(first.scheduled):
        item.seq.mark_pending(row)
    second = sched.schedule()
    assert [s.seq for s in second.scheduled] == waiting


def test_without_chunked_prefill_a_prompt_exactly_the_budget_left_fits() -> None:
    d = Driver(budget=10, chunked=False)
    a = d.add("a", list(range(4)), max_tokens=2)
    b = d.add("b", list(range(20, 29)), max_tokens=1)
    assert [(s.seq, s.num_new_tokens) for s in d.step().scheduled] == [(a, 4)]
    # a's decode takes 1 of 10: b's 9-token prompt is exactly the budget left.
    assert [(s.seq, s.num_new_tokens) for s in d.step().scheduled] == [(a, 1), (b, 9)]


def test_a_head_that_can_never_fit_does_not_hold_up_the_next_request() -> None:
    d = Driver(num_blocks=2, budget=64)  # 8 tokens of KV in all
    too_big = d.add("big", list(range(12)), max_tokens=1)
    small = d.add("small", [1, 2, 3], max_tokens=1)
    out = d.step()
    assert out.finished == [too_big] and too_big.stop_reason == KV_CACHE_TOO_SMALL
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(small, 3)]


def test_log_events_name_what_happened() -> None:
    # Operators search logs for these event names.
    import structlog

    with structlog.testing.capture_logs() as logs:
        d = Driver(max_model_len=8)
        d.add("long", list(range(9)), max_tokens=1)
        d.step()
    assert [e["event"] for e in logs if e.get("request_id") == "long"] == ["request_cannot_run"]
    assert logs[-1]["reason"] == EXCEEDS_MAX_MODEL_LEN.reason.value and logs[-1]["num_tokens"] == 9


def test_an_abort_mid_step_does_not_keep_later_sequences_out_of_the_prefix_cache() -> None:
    d = Driver(caching=True)
    d.add("a", [90, 91, 92], max_tokens=4)
    b = d.add("b", list(range(8)), max_tokens=1)  # two full blocks
    out = d.sched.schedule()
    assert [s.seq.request_id for s in out.scheduled] == ["a", "b"]
    d.model.execute(out.scheduled)
    d.sched.abort("a")  # ends before the step is read back
    b.append_token(fake_token(b))
    b.finish(FinishReason.LENGTH)
    d.sched.update(out)
    probe = Sequence("c", list(range(8)) + [50], SamplingParams(max_tokens=1))
    assert d.bm.match_prefix(probe) == 8  # b's full blocks were cached at the end of the step


def test_a_sampled_sequence_without_a_token_is_a_named_error() -> None:
    d = Driver()
    d.add("a", [1, 2, 3], max_tokens=2)
    out = d.sched.schedule()
    with pytest.raises(RuntimeError) as err:
        d.sched.update(out)  # nothing appended, nothing marked pending
    assert str(err.value) == "sequence a was sampled but no token was appended or marked pending"


def _producer_driver(num_blocks: int) -> tuple[Driver, "KVConnectorScheduler"]:
    """A Driver whose scheduler has a producer's KV connector (leases keep finished prefills'
    blocks); the pull address is never dialled here."""
    from tandem.core_protocol import KVTransferParams
    from tandem.engine_service.config import KVTransferConfig
    from tandem.engine_service.kv_connector.scheduler_side import KVConnectorScheduler

    d = Driver(num_blocks=num_blocks, max_model_len=100)
    kv = KVConnectorScheduler(KVTransferConfig(role="producer"), d.bm, "me", ("127.0.0.1", 1))
    d.sched = Scheduler(d.config, d.bm, d.max_model_len, kv_connector=kv)
    d.remote_decode = lambda rid, prompt: _add_prefill_leg(d, rid, prompt, KVTransferParams(do_remote_decode=True))
    d.on_finished = kv.on_request_finished
    return d, kv


def _add_prefill_leg(d: Driver, rid: str, prompt: list[int], params) -> Sequence:
    seq = Sequence(rid, prompt, SamplingParams(max_tokens=1), kv_transfer_params=params)
    d.seqs[rid] = seq
    d.sched.add(seq)
    return seq


def test_a_request_that_fits_alone_waits_for_leased_blocks_instead_of_failing() -> None:
    """Issue 19 item 5: a burst of prefill legs whose leases hold the pool; the next request fits
    alone, so it waits (nothing running is not "can never fit") and runs once a lease ends."""
    d, kv = _producer_driver(num_blocks=4)
    legs = [d.remote_decode(f"p{i}", list(range(10 * i, 10 * i + 8))) for i in range(2)]  # 2 blocks each
    while any(not s.is_finished for s in legs):
        d.step()
    assert len(kv.leases) == 2 and d.bm.num_free_blocks == 0 and not d.sched.running
    late = d.add("late", list(range(50, 56)), max_tokens=2)  # 2 blocks: fits an empty pool
    for _ in range(3):
        out = d.step()
        assert out.finished == [] and out.scheduled == []
        assert late.status == SequenceStatus.WAITING and d.sched.blocked_on_leases
    assert kv.release_request("p0") and kv.sweep() == 1  # the decode leg pulled p0's blocks
    d.run()
    assert late.finish_reason == FinishReason.LENGTH and late.num_output_tokens == 2
    # A request that could never fit still ends, once no lease holds anything either.
    big = d.add("big", list(range(20)))
    out = d.step()
    assert out.finished == [] and big.status == SequenceStatus.WAITING
    assert kv.release_request("p1") and kv.sweep() == 1
    out = d.step()
    assert out.finished == [big] and big.stop_reason == KV_CACHE_TOO_SMALL
    assert d.bm.num_used_blocks == 0 and not d.sched.has_work()


def test_a_running_sequence_short_of_blocks_held_by_leases_waits_instead_of_failing() -> None:
    d, kv = _producer_driver(num_blocks=3)
    leg = d.remote_decode("p", list(range(8)))  # 2 blocks
    while not leg.is_finished:
        d.step()
    grows = d.add("grows", [1, 2, 3], max_tokens=3)  # the 4th token's K/V needs a 2nd block
    outs = [d.step() for _ in range(3)]
    assert all(o.finished == [] for o in outs)
    assert any(o.preempted == [grows] for o in outs) and grows.status == SequenceStatus.WAITING
    assert kv.release_request("p") and kv.sweep() == 1
    d.run()
    assert grows.finish_reason == FinishReason.LENGTH and grows.num_output_tokens == 3


def test_expired_requests_are_never_admitted_and_running_ones_stop() -> None:
    """Deadlines in the core: a waiting request past its deadline is ended without running, a
    running one is stopped between steps; both end deadline_exceeded with their blocks freed."""
    from tandem.engine_service.core.scheduler import DEADLINE_EXCEEDED

    d = Driver(num_blocks=16, max_model_len=100)
    now = [100.0]
    d.sched._clock = lambda: now[0]
    late = Sequence("late", list(range(6)), SamplingParams(max_tokens=4), deadline=99.0)
    running = Sequence("run", list(range(10, 16)), SamplingParams(max_tokens=50), deadline=100.5)
    plain = d.add("plain", list(range(20, 26)), max_tokens=8)
    for seq in (late, running):
        d.seqs[seq.request_id] = seq
        d.sched.add(seq)
    out = d.step()
    assert out.finished == [late] and late.stop_reason == DEADLINE_EXCEEDED
    assert late.finish_reason == FinishReason.ERROR and late.num_computed_tokens == 0
    assert {item.seq.request_id for item in out.scheduled} == {"run", "plain"}
    d.step()
    assert running.num_output_tokens == 2 and not running.is_finished
    now[0] = 100.6
    out = d.step()
    assert out.finished == [running] and running.stop_reason == DEADLINE_EXCEEDED
    assert running not in d.sched.running and running.block_table == []
    d.run()
    assert plain.finish_reason == FinishReason.LENGTH and plain.num_output_tokens == 8
    assert d.bm.num_used_blocks == 0 and not d.sched.has_work()
