"""Prefix caching with state checkpoints (hybrid models), without a model.

A fake hybrid model stands in for the runner: per paged group its "cache" stores (position,
token id) per KV slot, and per state slot it stores the token ids the recurrent state has
consumed. Every step it applies the plan's checkpoint restores, checks that each chunk's state
is exactly the state after the chunk's first `start` tokens (fresh when `start == 0`), and that
its visible K/V hold its own tokens, then writes, then applies the checkpoint saves. A hit that
reused K/V without the matching state, a checkpoint restored from the wrong prefix, a save from
the wrong slot or at the wrong position, or a checkpoint slot reused while registered, all fail.

Then the pieces around it (copies on tensors, the worker's order, planner sizing, options,
metrics), end to end on tiny Qwen3.5 / Qwen3-Next checkpoints saved by transformers (hits give
the tokens and logprobs of the no-caching engine and of transformers), and `tandem bench prefix`.
"""

from __future__ import annotations

import random

import pytest
import torch

from tandem.core_protocol import EngineStats
from tandem.engine_service.cache.cache_spec import CacheGroup, CacheLayout, FullAttentionSpec, StateSpec
from tandem.engine_service.config import CacheConfig, SchedulerConfig
from tandem.engine_service.cache.block_manager import NULL_BLOCK, BlockManager, PagedGroup
from tandem.engine_service.cache.memory_plan import plan_cache
from tandem.engine_service.core.scheduler import Scheduler, SchedulerOutput
from tandem.engine_service.sequence import FinishReason, SamplingParams, Sequence
from tandem.engine_service.worker.state_copies import check_copies, copy_state_slots
from tests.hf_reference import hf_reference
from tandem.engine_service.cache.state_pool import CheckpointSlots
from tandem.engine_service.step_plan import StepPlan, decode_plan, encode_plan

BS = 4


def make_seq(rid: str, tokens: list[int], max_tokens: int = 8) -> Sequence:
    return Sequence(rid, tokens, SamplingParams(max_tokens=max_tokens))


def hybrid_manager(num_blocks: int = 32, num_slots: int = 4, num_checkpoints: int = 4, stride: int = 2 * BS,
                   groups: list[PagedGroup] | None = None, prefix_caching: bool = True) -> BlockManager:
    return BlockManager(num_blocks, BS, prefix_caching, groups=groups, num_state_slots=num_slots,
                        num_checkpoint_slots=num_checkpoints, checkpoint_stride=stride)


class HybridModel:
    """K/V per paged group and consumed tokens per state slot; checks each step's inputs."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.kv: list[dict[int, tuple[int, int]]] = [{} for _ in bm.pools]
        # The state slot index space: request slots, checkpoint slots, scratch.
        self.state: dict[int, tuple[int, ...] | None] = {}
        self.restores = self.saves = self.resumed_chunks = 0

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        check_copies(pairs, self.bm.state_slots.scratch_slot + 1)
        values = [self.state.get(src) for src, _ in pairs]  # every source read before any write
        for (_, dst), value in zip(pairs, values):
            assert value is not None, "copying a slot nothing wrote"
            self.state[dst] = value

    def execute(self, out: SchedulerOutput, tokens_of) -> None:
        """`tokens_of(seq)`: every token id of seq, pending ones included (the driver knows them)."""
        self.copy(out.state_copies_before)
        self.restores += len(out.state_copies_before)
        ck = self.bm.checkpoints
        for item in out.scheduled:
            seq = item.seq
            tokens = tokens_of(seq)
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + item.num_new_tokens
            slot = seq.state_slot
            assert slot is not None and 0 <= slot < self.bm.state_slots.num_slots
            if start == 0:
                state = ()  # has_initial_state=False: whatever the slot held is ignored
            else:
                state = self.state.get(slot)
                assert state == tuple(tokens[:start]), f"{seq.request_id}: wrong state at {start}"
                self.resumed_chunks += 1
            for g, pool in enumerate(self.bm.pools):
                lo = 0 if pool.window is None else max(0, start - pool.window + 1)
                for p in range(lo, start):
                    assert self.kv[g].get(self.bm.slot(seq, p, g)) == (p, tokens[p]), (seq, g, p)
                for p in range(start, end):
                    assert seq.block_tables[g][p // BS] != NULL_BLOCK
                    self.kv[g][self.bm.slot(seq, p, g)] = (p, tokens[p])
            self.state[slot] = state + tuple(tokens[start:end])
        # A save copies a request slot into a checkpoint slot, and only at a stride position.
        for src, dst in out.state_copies_after:
            assert ck.first <= dst < ck.first + ck.num_slots
            assert len(self.state[src]) % self.bm.checkpoint_stride == 0
        self.copy(out.state_copies_after)
        self.saves += len(out.state_copies_after)


class Driver:
    """Runs a scheduler over a HybridModel like the engine does (optionally overlapped: step N+1
    is scheduled and executed before step N's tokens are confirmed), with random aborts."""

    def __init__(self, bm: BlockManager, budget: int, max_num_seqs: int = 4, prefill_cap: int | None = None,
                 overlap: bool = False, seed: int = 0) -> None:
        config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                 max_prefill_tokens_per_seq=prefill_cap)
        self.sched = Scheduler(config, bm, max_model_len=10_000, device_type="cpu")
        self.bm, self.model, self.overlap = bm, HybridModel(bm), overlap
        self.rng = random.Random(seed)
        self.future: dict[Sequence, list[int]] = {}  # sampled but unconfirmed tokens
        self.chunks: list[tuple[str, int, int]] = []  # (request, start, length) of every scheduled chunk
        self._in_flight: SchedulerOutput | None = None

    def tokens_of(self, seq: Sequence) -> list[int]:
        return seq.token_ids + self.future.get(seq, [])

    def step(self) -> None:
        out = self.sched.schedule()
        for item in out.scheduled:
            self.chunks.append((item.seq.request_id, item.seq.num_computed_tokens, item.num_new_tokens))
        if out.scheduled:
            self.model.execute(out, self.tokens_of)
        self.sched.begin_step(out)
        for row, item in enumerate(s for s in out.scheduled if s.sample):
            seq = item.seq
            seq.mark_pending(row)
            self.future.setdefault(seq, []).append((seq.num_tokens * 7 + len(seq.request_id)) % 50)
        previous, self._in_flight = self._in_flight, out
        if previous is not None:
            self._confirm(previous)
        if not self.overlap:
            self._confirm(out)
            self._in_flight = None

    def _confirm(self, out: SchedulerOutput) -> None:
        for item in out.scheduled:
            seq = item.seq
            if not item.sample or seq.is_finished or not self.future.get(seq):
                continue
            seq.confirm_token(self.future[seq].pop(0))
            if seq.num_output_tokens >= seq.params.max_tokens:
                seq.finish(FinishReason.LENGTH)
        self.sched.end_step(out)

    def abort(self, seq: Sequence) -> None:
        self.sched.abort(seq.request_id)
        self.future.pop(seq, None)

    def drain(self, limit: int = 5000) -> None:
        for _ in range(limit):
            if not self.sched.has_work() and self._in_flight is None:
                return
            self.step()
            if self._in_flight is not None and not self.sched.has_work():
                self._confirm(self._in_flight)
                self._in_flight = None
        raise AssertionError("scheduler did not drain")


# --------------------------------------------------------------------------- hits and checkpoints


def test_hit_is_truncated_to_the_last_checkpoint_and_restores_it() -> None:
    bm = hybrid_manager(stride=2 * BS)
    prompt = list(range(100, 121))  # 21 tokens: 5 full blocks; checkpoint positions 8 and 16
    d = Driver(bm, budget=64)
    a = make_seq("a", prompt, max_tokens=1)
    d.sched.add(a)
    d.drain()
    # The first chunk (16 on CPU) is cut at the last checkpoint position it reaches: one save there.
    assert [(s, n) for _, s, n in d.chunks] == [(0, 16), (16, 5)]
    assert bm.checkpoints.num_registered == 1 and bm.checkpoints.num_saved == 1
    assert d.model.saves == 1
    b = make_seq("b", prompt + [7, 8, 9])
    assert bm.match_prefix(b) == 16  # K/V would give 20 (5 blocks); the state exists at 16
    queries, kv = bm.prefix_queries, bm.prefix_kv_hits
    d.chunks.clear()
    d.sched.add(b)
    d.drain()
    assert d.chunks[0] == ("b", 16, 8)  # resumed at the checkpoint: no chunk cut (ends at 24)
    assert d.model.restores == 1 and d.model.resumed_chunks >= 1
    assert bm.prefix_kv_hits - kv == 20 and bm.prefix_hits == 16
    assert bm.prefix_queries - queries == 24


def test_state_layout_without_checkpoints_gets_no_hits() -> None:
    """K/V blocks alone cannot resume a hybrid model's prefix."""
    bm = BlockManager(32, BS, num_state_slots=2)
    assert bm.checkpoints is None
    d = Driver(bm, budget=64)
    d.sched.add(make_seq("a", list(range(20)), max_tokens=1))
    d.drain()
    b = make_seq("b", list(range(20)) + [1])
    assert bm.match_prefix(b) == 0
    assert bm.lookup(b).kv_blocks == 5  # while K/V alone would hit 5 blocks
    assert [n for _, _, n in d.chunks] == [16, 4]  # the prefill cap alone decides (16 on CPU)


def test_checkpoint_goes_with_its_evicted_block_and_lru_when_slots_run_out() -> None:
    bm = hybrid_manager(num_blocks=8, num_checkpoints=2, stride=BS)
    d = Driver(bm, budget=64, prefill_cap=BS)
    first = list(range(10))  # checkpoints at 4 and 8 (one chunk per block)
    d.sched.add(make_seq("a", first, max_tokens=1))
    d.drain()
    assert bm.checkpoints.num_registered == 2
    assert bm.match_prefix(make_seq("x", first + [1])) == 8
    # A third checkpoint (of another prompt) evicts the least recently used one: position 4's.
    d.sched.add(make_seq("b", list(range(50, 55)), max_tokens=1))
    d.drain()
    assert bm.checkpoints.num_evicted == 1 and bm.checkpoints.num_registered == 2
    assert bm.match_prefix(make_seq("y", first[:5] + [1])) == 0  # K/V of block 0 alone are not enough
    assert bm.match_prefix(make_seq("z", first + [1])) == 8
    # Evicting the block position 8's checkpoint belongs to drops the checkpoint.
    block_hash = make_hashes(first, 2)[1]
    assert block_hash in bm.checkpoints
    c = make_seq("c", list(range(200, 232)))
    assert bm.allocate(c, 32)  # takes every block: all cached ones are evicted
    assert block_hash not in bm.checkpoints
    assert bm.checkpoints.num_registered == 0  # the other one's block went too
    bm.free(c)
    assert bm.match_prefix(make_seq("w", first + [1])) == 0


def make_hashes(tokens: list[int], n: int) -> list[int]:
    from tandem.engine_service.cache.block_manager import hash_block

    out, parent = [], None
    for i in range(n):
        parent = hash_block(parent, tokens[i * BS:(i + 1) * BS])
        out.append(parent)
    return out


def test_concurrent_saves_of_one_prefix_keep_one_checkpoint_and_free_the_other() -> None:
    bm = hybrid_manager(num_checkpoints=4, stride=BS)
    d = Driver(bm, budget=64, prefill_cap=BS)
    prompt = list(range(30, 39))
    d.sched.add(make_seq("a", prompt, max_tokens=1))
    d.sched.add(make_seq("b", prompt, max_tokens=1))  # same step: neither hits the other
    d.drain()
    assert d.model.saves == 4 and bm.checkpoints.num_registered == 2
    assert bm.checkpoints.num_free == 2 and bm.checkpoints.num_pending == 0


def test_reset_drops_checkpoints_and_pending_saves_are_not_registered() -> None:
    bm = hybrid_manager(stride=BS)
    d = Driver(bm, budget=64, prefill_cap=BS)
    d.sched.add(make_seq("a", list(range(12)), max_tokens=1))
    d.drain()
    assert bm.checkpoints.num_registered == 3
    # A save in flight during a reset: scheduled and executed, the reset comes before its commit.
    b = make_seq("b", list(range(40, 49)), max_tokens=1)
    d.sched.add(b)
    out = d.sched.schedule()
    assert len(out.state_copies_after) == 1 and bm.checkpoints.num_pending == 1
    d.model.execute(out, d.tokens_of)
    bm.reset_prefix_cache()
    assert bm.checkpoints.num_registered == 0
    d.sched.begin_step(out)
    for item in out.scheduled:
        if item.sample:
            item.seq.append_token(1)
            item.seq.finish(FinishReason.LENGTH)
    d.sched.end_step(out)
    assert bm.checkpoints.num_registered == 0 and bm.checkpoints.num_free == bm.checkpoints.num_slots


def test_abort_between_schedule_and_launch_drops_its_queued_copies() -> None:
    bm = hybrid_manager(stride=BS)
    d = Driver(bm, budget=64)
    d.sched.add(make_seq("a", list(range(9)), max_tokens=1))
    d.drain()
    b = make_seq("b", list(range(9)) + [5, 5, 5, 5])
    assert bm.allocate(b, 5)  # hit 8 -> restore queued, chunk to 13 (no save: 13 is no checkpoint)
    c = make_seq("c", list(range(60, 70)))
    assert bm.allocate(c, 8)  # ends on 8: a save queued
    assert bm.checkpoints.num_pending == 1
    bm.free(b)
    bm.free(c)
    assert bm.pop_state_copies() == ([], [])
    assert bm.checkpoints.num_pending == 0


# --------------------------------------------------------------------------- scheduler chunk cutting


@pytest.mark.parametrize("cap", [6, 16, 0])
def test_chunks_end_on_checkpoints_and_keep_the_fair_prefill_cap(cap: int) -> None:
    bm = hybrid_manager(num_blocks=64, stride=2 * BS)
    d = Driver(bm, budget=20, prefill_cap=cap, max_num_seqs=4)
    prompts = {"a": list(range(37)), "b": list(range(100, 123)), "c": list(range(200, 203))}
    for rid, p in prompts.items():
        d.sched.add(make_seq(rid, p, max_tokens=3))
    d.drain()
    stride = bm.checkpoint_stride
    for rid, start, n in d.chunks:
        if cap:
            assert n <= cap, "a chunk grew past the fair-prefill cap"
        end = start + n
        limit = len(prompts[rid])
        crossed = [p for p in range(start + 1, min(end, limit) + 1) if p % stride == 0]
        # A chunk ends on the last checkpoint position it reaches, so it never passes one.
        assert not crossed or crossed[-1] == end, (rid, start, n)
    # Every chunk that ended on a checkpoint position within its prompt saved the state there.
    expected = sum(1 for rid, s, n in d.chunks if (s + n) % stride == 0 and s + n <= len(prompts[rid]))
    assert d.model.saves == expected > 0
    # Decodes are not cut and save nothing past the prompt.
    assert all(n == 1 for rid, s, n in d.chunks if s >= len(prompts[rid]))


def test_no_chunk_cut_without_chunked_prefill() -> None:
    bm = hybrid_manager(num_blocks=64, stride=2 * BS)
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, enable_chunked_prefill=False)
    sched = Scheduler(config, bm, max_model_len=64, device_type="cpu")
    sched.add(make_seq("a", list(range(21))))
    out = sched.schedule()
    assert out.scheduled[0].num_new_tokens == 21
    assert out.state_copies_after == []  # 21 is no checkpoint position


# --------------------------------------------------------------------------- random accounting


def _random_run(seed: int, overlap: bool) -> tuple[BlockManager, Driver, dict]:
    rng = random.Random(seed)
    groups = [PagedGroup("full", rng.choice([14, 20, 40]))]
    if rng.random() < 0.5:
        groups.append(PagedGroup("sliding", 16, sliding_window=7))
    bm = hybrid_manager(num_slots=rng.choice([2, 3, 5]), num_checkpoints=rng.choice([1, 3, 6]),
                        stride=rng.choice([BS, 2 * BS]), groups=groups)
    d = Driver(bm, budget=rng.choice([5, 12, 32]), max_num_seqs=rng.choice([2, 4, 6]),
               prefill_cap=rng.choice([None, 6, 0]), overlap=overlap, seed=seed)
    bases = [[rng.randrange(50) for _ in range(rng.randrange(6, 30))] for _ in range(3)]
    live: list[Sequence] = []
    counts = {"admitted": 0, "aborted": 0, "finished": 0, "resets": 0}
    for i in range(60):
        if rng.random() < 0.6:
            prompt = rng.choice(bases)[: rng.randrange(1, 30)] + [rng.randrange(50) for _ in range(rng.randrange(0, 6))]
            seq = make_seq(f"r{i}", prompt, max_tokens=rng.randrange(1, 12))
            d.sched.add(seq)
            live.append(seq)
            counts["admitted"] += 1
        if live and rng.random() < 0.12:  # abort, cancel and deadline all end as an abort here
            victim = live.pop(rng.randrange(len(live)))
            if not victim.is_finished:
                d.abort(victim)
                counts["aborted"] += 1
        if rng.random() < 0.02:
            bm.reset_prefix_cache()
            counts["resets"] += 1
        for _ in range(rng.randrange(1, 4)):
            d.step()
        check_invariants(bm)
    d.drain()
    counts["finished"] = sum(s.finish_reason == FinishReason.LENGTH for s in live)
    return bm, d, counts


def check_invariants(bm: BlockManager) -> None:
    ck = bm.checkpoints
    assert ck.num_free + ck.num_pending + ck.num_registered == ck.num_slots
    # Each registered checkpoint belongs to a block cached in the full-attention group.
    assert all(h in bm.pools[0].cached for h in ck.hashes())


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_random_admission_finish_abort_preemption_leave_everything_free(overlap: bool) -> None:
    totals = {"steps": 0, "preemptions": 0, "restores": 0, "saves": 0, "resumed": 0, "evicted": 0, "hits": 0}
    for seed in range(10):
        bm, d, counts = _random_run(seed, overlap)
        assert not d.sched.has_work()
        assert all(p.num_free == p.num_blocks for p in bm.pools), "a block leaked"
        assert bm.state_slots.num_used == 0 and bm.state_slots.num_free == bm.state_slots.num_slots
        ck = bm.checkpoints
        assert ck.num_pending == 0, "a pending checkpoint leaked"
        assert ck.num_free + ck.num_registered == ck.num_slots
        check_invariants(bm)
        bm.reset_prefix_cache()
        assert ck.num_free == ck.num_slots and all(not p.cached for p in bm.pools)
        totals["steps"] += len(d.chunks)
        totals["preemptions"] += d.sched.num_preemptions
        totals["restores"] += d.model.restores
        totals["saves"] += d.model.saves
        totals["resumed"] += d.model.resumed_chunks
        totals["evicted"] += ck.num_evicted
        totals["hits"] += bm.prefix_hits
    print("hybrid accounting", "overlap" if overlap else "sync", totals)
    # Guards: the workload exercised what it claims to.
    assert totals["preemptions"] > 0 and totals["restores"] > 0 and totals["saves"] > 0
    assert totals["evicted"] > 0 and totals["hits"] > 0


# --------------------------------------------------------------------------- copies on tensors


def test_copy_state_slots_moves_every_tensor_and_reads_before_writing() -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(6, 3, 5, generator=gen), torch.randn(6, 2, 4, 4, generator=gen).to(torch.bfloat16)]
    before = [t.clone() for t in tensors]
    pairs = [(1, 4), (4, 2), (0, 5)]  # slot 4 is a source and a destination in one call
    copy_state_slots(tensors, pairs)
    for t, old in zip(tensors, before):
        assert torch.equal(t[4], old[1]) and torch.equal(t[2], old[4]) and torch.equal(t[5], old[0])
        assert torch.equal(t[0], old[0]) and torch.equal(t[1], old[1]) and torch.equal(t[3], old[3])


def test_copy_state_slots_is_one_index_copy_per_tensor(monkeypatch) -> None:
    tensors = [torch.zeros(8, 2) for _ in range(5)]
    calls = []
    original = torch.Tensor.index_copy_

    def counting(self, *args, **kwargs):
        calls.append(self.data_ptr())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "index_copy_", counting)
    copy_state_slots(tensors, [(0, 4), (1, 5), (2, 6), (3, 7)])
    assert len(calls) == len(tensors)


def test_check_copies_rejects_bad_pairs() -> None:
    with pytest.raises(ValueError, match="twice"):
        check_copies([(0, 3), (1, 3)], 8)
    with pytest.raises(ValueError, match="outside"):
        check_copies([(0, 8)], 8)
    with pytest.raises(ValueError, match="onto itself"):
        check_copies([(2, 2)], 8)


def test_worker_runs_restores_before_and_saves_after_the_forward() -> None:
    from tandem.engine_service.step_plan import NewRequest
    from tandem.engine_service.worker.worker import StepWorker

    order: list = []

    class Runner:
        block_size = BS

        def copy_state_slots(self, pairs):
            order.append(("copy", list(pairs)))

        def forward(self, host, previous_tokens=None):
            order.append(("forward",))
            return torch.zeros(1, 8)

    class NoSampler:
        def sample_async(self, logits, rows):
            return None

    worker = StepWorker(Runner(), NoSampler())
    plan = StepPlan(step_id=0, new_requests=[NewRequest(
        request_id="a", token_ids=list(range(12)), num_prompt_tokens=12, sampling_params=SamplingParams(),
        eos_token_ids=[], block_ids=[[0, 1, 2]], num_computed_tokens=8, num_scheduled_tokens=4, sample=False,
        state_slot=0)], state_copies_before=[(5, 0)], state_copies_after=[(0, 6)])
    plan = decode_plan(encode_plan(plan))  # the copies survive msgpack
    assert plan.state_copies_before == [(5, 0)] and plan.state_copies_after == [(0, 6)]
    worker.launch(plan)
    assert order == [("copy", [(5, 0)]), ("forward",), ("copy", [(0, 6)])]


# --------------------------------------------------------------------------- sizing and options


def _state_layout() -> CacheLayout:
    return CacheLayout((
        CacheGroup("full_attention", FullAttentionSpec(2, 8, "float32"), (0, 2)),
        CacheGroup("gdn", StateSpec(((6, 3), (2, 4, 4)), ("float32", "float32")), (1, 3)),
    ))


def test_planner_gives_checkpoints_their_share_and_the_manager_their_slots() -> None:
    layout = _state_layout()
    per_slot = layout.groups[1].bytes_per_slot()
    per_block = layout.groups[0].bytes_per_block(BS)
    budget = 400 * per_block
    kw = dict(max_num_seqs=3, max_num_batched_tokens=32, max_model_len=64)
    cfg = CacheConfig(block_size=BS, cpu_kv_cache_bytes=budget, state_checkpoint_memory_fraction=0.25,
                      state_checkpoint_stride=2 * BS)
    plan = plan_cache(layout, cfg, "cpu", **kw)
    left = budget - 3 * per_slot
    assert plan.num_checkpoint_slots == int(left * 0.25) // per_slot > 0
    assert plan.num_blocks == (left - plan.num_checkpoint_slots * per_slot) // per_block
    assert plan.state_bytes == (3 + plan.num_checkpoint_slots) * per_slot
    bm = BlockManager.from_plan(plan, True, cfg.checkpoint_stride())
    assert bm.checkpoints.num_slots == plan.num_checkpoint_slots and bm.checkpoints.first == 3
    assert bm.state_slots.scratch_slot == 3 + plan.num_checkpoint_slots
    # No share, or no prefix caching: no checkpoints, every byte to blocks.
    for off in (CacheConfig(block_size=BS, cpu_kv_cache_bytes=budget, state_checkpoint_memory_fraction=0.0),
                CacheConfig(block_size=BS, cpu_kv_cache_bytes=budget, enable_prefix_caching=False)):
        p = plan_cache(layout, off, "cpu", **kw)
        assert p.num_checkpoint_slots == 0 and p.num_blocks == left // per_block
    # A fixed pool: checkpoints are the share of blocks + checkpoints.
    fixed = plan_cache(layout, CacheConfig(block_size=BS, num_blocks=100, state_checkpoint_memory_fraction=0.2),
                       "cpu", **kw)
    assert fixed.num_checkpoint_slots == int(100 * per_block * 0.2 / 0.8) // per_slot


def test_checkpoint_options_are_validated() -> None:
    assert CacheConfig().checkpoint_stride() == 512
    assert CacheConfig(block_size=1024).checkpoint_stride() == 1024
    with pytest.raises(ValueError, match="multiple of block_size"):
        CacheConfig(block_size=16, state_checkpoint_stride=24).validate()
    with pytest.raises(ValueError, match="state_checkpoint_memory_fraction"):
        CacheConfig(state_checkpoint_memory_fraction=1.0).validate()
    with pytest.raises(ValueError, match="multiple of block_size"):
        BlockManager(8, BS, num_state_slots=1, num_checkpoint_slots=1, checkpoint_stride=6)


def test_checkpoint_slots_books() -> None:
    ck = CheckpointSlots(first=10, num_slots=2)
    a, b = ck.take(), ck.take()
    assert {a, b} == {10, 11} and not ck.can_take()
    with pytest.raises(RuntimeError, match="pending"):
        ck.take()
    assert ck.register(111, a) and not ck.register(111, b)  # the same prefix twice: one kept
    assert ck.num_registered == 1 and ck.num_free == 1
    with pytest.raises(RuntimeError, match="not pending"):
        ck.release(a)
    assert ck.restore(111) == a
    ck.drop(111)
    ck.drop(111)  # no-op
    assert ck.num_free == 2


def test_metrics_expose_kv_hits_and_checkpoints() -> None:
    from types import SimpleNamespace

    from tandem.engine_service.api.metrics import EngineMetrics

    info = SimpleNamespace(block_size=16, kv_blocks=100, enable_prefix_caching=True, max_model_len=2048)
    snap = EngineStats(kv_blocks_total=100, prefix_cache_hits=512, prefix_cache_kv_hits=600,
                       state_checkpoints_used=3, state_checkpoint_saves=7)
    engine = SimpleNamespace(info=info, stats_snapshot=snap, step_listeners=[])
    r = EngineMetrics(engine, "m").registry
    labels = {"model_name": "m"}
    assert r.get_sample_value("tandem:prefix_cache_kv_hits_total", labels) == 600
    assert r.get_sample_value("tandem:prefix_cache_hits_total", labels) == 512
    assert r.get_sample_value("tandem:state_checkpoints_used", labels) == 3
    assert r.get_sample_value("tandem:state_checkpoint_saves_total", labels) == 7


# --------------------------------------------------------------------------- end to end (tiny hybrid models)

STEPS = 32
LOGPROB_ATOL = 2e-4
HYBRID_FAMILIES = ["tiny-qwen3.5", "tiny-qwen3-next"]


@pytest.fixture
def torch_twins(monkeypatch):
    """The GDN kernels' PyTorch twins even under TRITON_INTERPRET=1 (conftest sets it): the
    interpreter makes an engine step seconds long, and what is tested here is the cache, not the
    kernels (tests/kernels/ compare them with their twins)."""
    import importlib

    for name in ("causal_conv1d", "gated_delta_rule", "gated_norm"):
        module = importlib.import_module(f"tandem.kernels.{name}")
        monkeypatch.setattr(module, "use_triton", lambda device: device.type == "cuda")


@pytest.fixture(scope="module", params=HYBRID_FAMILIES)
def hybrid_checkpoint(request, tmp_path_factory, hf_checkpoint):
    hf, path = hf_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=4321)
    return request.param, hf, path


def hybrid_engine(path, prefix_caching: bool, budget: int = 64, overlap: str = "off", num_blocks: int = 128):
    from tandem.engine_service.config import EngineConfig, ModelConfig
    from tandem.engine_service.core.engine import LLMEngine

    return LLMEngine(EngineConfig(
        ModelConfig(model=str(path), attention_backend="torch", max_model_len=256),
        CacheConfig(block_size=BS, num_blocks=num_blocks, enable_prefix_caching=prefix_caching,
                    state_checkpoint_stride=2 * BS, state_checkpoint_memory_fraction=0.5),
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_prefill_tokens_per_seq=8,
                        overlap_scheduling=overlap),
    ))


def generate(engine, rid: str, tokens: list[int]) -> tuple[list[int], list[float], int]:
    """Greedy tokens, their logprobs and the prompt tokens served from the cache."""
    engine.add_request(rid, tokens, SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True, logprobs=0))
    out, lps, cached = [], [], 0
    while engine.has_work():
        for o in engine.step():
            if o.request_id == rid:
                out.extend(o.new_token_ids)
                lps.extend(lp.logprob for lp in o.new_logprobs)
                cached = o.num_cached_prompt_tokens
    return out, lps, cached


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_second_request_hits_the_shared_prefix_and_matches_no_caching(hybrid_checkpoint, overlap: str,
                                                                      torch_twins) -> None:
    """Request B shares A's first 27 tokens: with caching it resumes at the checkpoint at 24
    (K/V of 6 blocks + the state there) and gives the tokens and logprobs it gives without
    caching, and transformers' greedy tokens."""
    _, hf, path = hybrid_checkpoint
    shared = _prompt(27, seed=7)
    a_prompt, b_prompt = shared + _prompt(6, seed=8), shared + _prompt(5, seed=9)
    cached = hybrid_engine(path, True, overlap=overlap)
    bm = cached.block_manager
    assert bm.checkpoints is not None and bm.checkpoints.num_slots >= 4
    a_tokens, _, a_hit = generate(cached, "a", a_prompt)
    assert a_hit == 0 and bm.checkpoints.num_registered > 0
    restored = bm.checkpoints.num_restored
    b_tokens, b_lps, b_hit = generate(cached, "b", b_prompt)
    assert b_hit == 24 and bm.checkpoints.num_restored == restored + 1
    assert bm.prefix_kv_hits >= bm.prefix_hits
    plain = hybrid_engine(path, False, overlap=overlap)
    ref_tokens, ref_lps, ref_hit = generate(plain, "b", b_prompt)
    assert ref_hit == 0 and plain.block_manager.checkpoints is None
    assert b_tokens == ref_tokens == hf_reference(hf, b_prompt, STEPS).continuation
    assert a_tokens == hf_reference(hf, a_prompt, STEPS).continuation
    torch.testing.assert_close(torch.tensor(b_lps), torch.tensor(ref_lps), atol=LOGPROB_ATOL, rtol=0)
    for engine in (cached, plain):
        assert all(p.num_free == p.num_blocks for p in engine.block_manager.pools)
        assert engine.block_manager.state_slots.num_used == 0
    assert bm.checkpoints.num_pending == 0


def test_hits_with_concurrent_requests_and_preemption_match_no_caching(hybrid_checkpoint, torch_twins) -> None:
    """Several requests sharing prefixes, admitted together and later, in a pool small enough to
    preempt: every request's tokens equal the no-caching engine's, with hits restored."""
    _, hf, path = hybrid_checkpoint
    base = _prompt(40, seed=11)
    prompts = [base[:35] + _prompt(3, 20 + i) for i in range(3)] + [base[:17] + _prompt(4, 30), _prompt(19, 31)]

    def run(prefix_caching: bool):
        # 24 blocks of 4 tokens cannot hold four running requests of ~45 tokens each.
        engine = hybrid_engine(path, prefix_caching, budget=12, num_blocks=24)
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        out = {f"r{i}": [] for i in range(len(prompts))}
        engine.add_request("r0", prompts[0], params)
        for _ in range(6):  # r0 computes some of the shared prefix before the others arrive
            for o in engine.step():
                out[o.request_id].extend(o.new_token_ids)
        for i, p in enumerate(prompts[1:], 1):
            engine.add_request(f"r{i}", p, params)
        while engine.has_work():
            for o in engine.step():
                out[o.request_id].extend(o.new_token_ids)
        bm = engine.block_manager
        assert all(p.num_free == p.num_blocks for p in bm.pools) and bm.state_slots.num_used == 0
        return out, engine

    cached_out, cached = run(True)
    plain_out, plain = run(False)
    assert cached.block_manager.prefix_hits > 0 and cached.block_manager.checkpoints.num_restored > 0
    assert cached.scheduler.num_preemptions > 0 and plain.scheduler.num_preemptions > 0
    assert cached_out == plain_out
    assert cached.block_manager.checkpoints.num_pending == 0


# --------------------------------------------------------------------------- tandem bench prefix


def test_hit_ceilings_round_to_blocks_and_checkpoints() -> None:
    from tandem.bench.prefix import hit_ceilings
    from tandem.bench.workloads import BenchRequest

    p = list(range(30))
    reqs = [BenchRequest(p + [100 + i], 1) for i in range(3)]  # 31 tokens each; two repeat the prefix
    c = hit_ceilings(reqs, 30, block_size=4, stride=16)
    assert c == {"block": 2 * 28 / 93, "checkpoint": 2 * 16 / 93}


def test_bench_prefix_runs_on_cpu_and_compares_with_full_attention(torch_twins, tmp_path) -> None:
    from tandem.bench.prefix import PrefixOptions, default_compare_model, run_prefix, short_table
    from tandem.bench.results import Deadline, new_record
    from tandem.engine_service.config import EngineConfig, ModelConfig

    assert default_compare_model("dummy:tiny-qwen3.5") == "dummy:tiny-qwen3.5-full-attention"
    assert default_compare_model("dummy:tiny-llama") is None
    config = EngineConfig(
        ModelConfig(model="dummy:tiny-qwen3.5", attention_backend="torch", max_model_len=256, device="cpu"),
        CacheConfig(block_size=BS, cpu_kv_cache_bytes=1 << 24, state_checkpoint_stride=4 * BS),
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, overlap_scheduling="off"),
    )
    opts = PrefixOptions(num_prefixes=2, prefix_len=36, suffix_len=4, requests_per_prefix=3, output_len=2,
                         concurrency=2, noreuse_requests=3, noreuse_prompt_len=20, noreuse_output_len=2, repeats=1,
                         warmup_requests=1)
    record = new_record("prefix", config.model.model, {})
    run_prefix(record, config, opts, Deadline(600))
    assert record.errors == []
    res = record.results["prefix"]
    hybrid, full = res["hit_rate"]["model"], res["hit_rate"]["full_attention"]
    assert hybrid["state_groups"] and not full["state_groups"]
    assert full["architecture"] == hybrid["architecture"]  # same model family, every layer attention
    # The hybrid model hits, only at checkpoints; the full-attention one at blocks.
    assert 0 < hybrid["hit_rate"] <= hybrid["kv_hit_rate"] and hybrid["checkpoint_saves"] > 0
    assert hybrid["hit_tokens"] % (4 * BS) == 0 and full["hit_tokens"] % BS == 0
    assert hybrid["hit_rate"] <= hybrid["ceiling"]["checkpoint"] and full["hit_rate"] <= full["ceiling"]["block"]
    assert full["hit_rate"] >= hybrid["hit_rate"]
    noreuse = res["noreuse"]
    assert len(noreuse["runs"]["on"]) == len(noreuse["runs"]["off"]) == 1
    assert all(r["prefix_cache_hits"] == 0 for r in noreuse["runs"]["on"] + noreuse["runs"]["off"])
    assert set(noreuse["cost"]) == {"output_tokens_per_s", "total_tokens_per_s"}
    assert len(short_table(record.results)) == 5
    # The report's section (docs/benchmarks.md) reads the written JSON.
    from tandem.bench.report import build_report
    from tandem.bench.results import write_record

    write_record(record, tmp_path / "results")
    build_report(tmp_path / "results", tmp_path / "benchmarks.md", tmp_path / "plot.png")
    text = (tmp_path / "benchmarks.md").read_text()
    assert "## Prefix caching of hybrid models" in text and "dummy:tiny-qwen3.5-full-attention" in text


def test_bench_prefix_without_tokens_off_records_no_cost(monkeypatch) -> None:
    """A no-reuse run the deadline stopped before its first token (0 tok/s without prefix caching)
    leaves the cost unset and the record incomplete, instead of dividing by zero."""
    from tandem.bench import prefix
    from tandem.bench.results import Deadline, new_record
    from tandem.engine_service.config import EngineConfig, ModelConfig

    def fake_engine_run(config, model, caching, fn):
        rate = 5.0 if caching else 0.0
        return {"model": model, "output_tokens_per_s": rate, "total_tokens_per_s": rate}

    monkeypatch.setattr(prefix, "_with_engine", fake_engine_run)
    config = EngineConfig(ModelConfig(model="dummy:tiny-qwen3.5", device="cpu"), CacheConfig(), SchedulerConfig())
    record = new_record("prefix", config.model.model, {})
    prefix.run_prefix(record, config, prefix.PrefixOptions(repeats=1), Deadline(600))
    noreuse = record.results["prefix"]["noreuse"]
    assert "cost" not in noreuse and "out of time" in noreuse["cost_unavailable"] and record.incomplete
