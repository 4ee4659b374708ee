"""Cache groups in the block manager: block ids per paged group, sliding-window freeing, prefix
hits across groups, and state slots taken on admission and returned on every way out.

A fake model stands in for the runner: per group, its "cache" stores (position, token id) per
slot, and every step checks that each query's visible context (the window, for a sliding
group) really holds that sequence's tokens — so a block freed too early, reused while still
needed, or hit with the wrong content fails the run.
"""

from __future__ import annotations

import random

import pytest

from tandem.engine_service.config import SchedulerConfig
from tandem.engine_service.cache.block_manager import NULL_BLOCK, BlockManager, PagedGroup, first_needed_block
from tandem.engine_service.core.scheduler import KV_CACHE_TOO_SMALL, Scheduler, ScheduledSeq
from tandem.engine_service.sequence import FinishReason, SamplingParams, Sequence

BS = 4
W = 7  # not a multiple of the block size on purpose


def make_seq(rid: str, tokens: list[int], max_tokens: int = 16) -> Sequence:
    return Sequence(rid, tokens, SamplingParams(max_tokens=max_tokens))


def live(table: list[int]) -> list[int]:
    return [b for b in table if b != NULL_BLOCK]


class GroupModel:
    """Writes (position, token) per group and checks every query's visible context."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.kv: list[dict[int, tuple[int, int]]] = [{} for _ in bm.pools]

    def execute(self, scheduled: list[ScheduledSeq]) -> None:
        for item in scheduled:
            seq = item.seq
            tokens = seq.token_ids
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + item.num_new_tokens
            for g, pool in enumerate(self.bm.pools):
                # Computed here, not with the block manager's helper: the first key position the
                # chunk's first query sees.
                lo = 0 if pool.window is None else max(0, start - pool.window + 1)
                for p in range(lo, start):
                    assert self.kv[g].get(self.bm.slot(seq, p, g)) == (p, tokens[p]), (seq, g, p)
                for p in range(start, end):
                    slot = self.bm.slot(seq, p, g)
                    assert seq.block_tables[g][p // BS] != NULL_BLOCK
                    assert pool.blocks[slot // BS].ref_count == 1, "writing into a shared block"
                    self.kv[g][slot] = (p, tokens[p])
        if self.bm.state_slots is not None:
            slots = [item.seq.state_slot for item in scheduled]
            assert None not in slots and len(set(slots)) == len(slots), "state slots must be distinct"


def run(bm: BlockManager, seqs: list[Sequence], budget: int, max_num_seqs: int = 8,
        on_step=None) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    sched = Scheduler(config, bm, max_model_len=10_000)
    model = GroupModel(bm)
    for s in seqs:
        sched.add(s)
    for _ in range(2000):
        if not sched.has_work():
            return sched
        out = sched.schedule()
        model.execute(out.scheduled)
        for item in out.scheduled:
            seq = item.seq
            if item.sample:
                seq.append_token((len(seq.token_ids) * 31 + len(seq.request_id)) % 97)
                if seq.num_output_tokens >= seq.params.max_tokens:
                    seq.finish(FinishReason.LENGTH)
        sched.update(out)
        if on_step is not None:
            on_step(sched)
    raise AssertionError("scheduler did not drain")


def window_cap(window: int = W) -> int:
    """Live blocks a decoding request may hold in a windowed group."""
    return -(-(window - 1) // BS) + 2


def test_sliding_only_request_holds_only_its_window() -> None:
    bm = BlockManager(0, BS, groups=[PagedGroup("sliding", 64, sliding_window=W)])
    seq = make_seq("a", list(range(30)), max_tokens=40)
    peak = []

    def check(sched: Scheduler) -> None:
        if seq.block_table:
            peak.append(len(live(seq.block_table)))
            assert len(seq.block_table) * BS >= seq.num_computed_tokens  # entries stay positional
            assert bm.num_used_blocks == len(live(seq.block_table))  # freed blocks are back in the pool

    run(bm, [seq], budget=8)  # chunked prefill of 30 tokens, then 40 decode steps
    seq2 = make_seq("b", list(range(100, 130)), max_tokens=40)
    seq = seq2
    run(bm, [seq2], budget=8, on_step=check)
    assert max(peak[-30:]) <= window_cap()
    assert seq2.num_tokens == 70 and bm.num_used_blocks == 0


def test_mixed_groups_keep_full_blocks_and_free_window_blocks() -> None:
    groups = [PagedGroup("full", 64), PagedGroup("sliding", 32, sliding_window=W)]
    bm = BlockManager(0, BS, groups=groups)
    seq = make_seq("a", list(range(25)), max_tokens=20)
    sizes = []
    run(bm, [seq], budget=6, on_step=lambda s: seq.block_tables[0] and sizes.append(
        (len(live(seq.block_tables[0])), len(live(seq.block_tables[1])), len(seq.block_tables[1]))))
    full, sliding, width = sizes[-1]
    assert full == width == -(-44 // BS)  # every full-attention block kept until the end
    assert sliding <= window_cap() < full
    assert bm.pools[0].num_free == 64 and bm.pools[1].num_free == 32  # all returned on finish


WORKLOADS = [(None, W), (W,), (None, 3, 12)]


def random_workload(windows: tuple, seed: int) -> tuple[BlockManager, Scheduler, list[Sequence]]:
    """Shared prefixes, chunked prefill, small pools (preemption, eviction), five state slots."""
    rng = random.Random(seed)
    groups = [PagedGroup(f"g{i}", 16 if w is None else 12, sliding_window=w) for i, w in enumerate(windows)]
    # State groups hit only at a state checkpoint: keep one every block (tests/unit/test_hybrid_prefix_cache.py).
    bm = BlockManager(0, BS, groups=groups, num_state_slots=5, num_checkpoint_slots=4, checkpoint_stride=BS)
    bases = [[rng.randrange(50) for _ in range(rng.randrange(4, 24))] for _ in range(3)]
    seqs = []
    for i in range(14):
        prompt = rng.choice(bases)[: rng.randrange(1, 24)] + [rng.randrange(50) for _ in range(rng.randrange(0, 9))]
        seqs.append(make_seq(f"r{i}", prompt or [1], max_tokens=rng.randrange(1, 20)))
    sched = run(bm, seqs, budget=rng.choice([3, 8, 16]), max_num_seqs=6)
    return bm, sched, seqs


@pytest.mark.parametrize("windows", WORKLOADS, ids=["mixed", "sliding", "three"])
@pytest.mark.parametrize("seed", range(4))
def test_random_workload_keeps_every_visible_context_intact(windows: tuple, seed: int) -> None:
    """Every query's visible context holds its own tokens, in every group (see GroupModel), and
    everything is returned at the end."""
    bm, _, seqs = random_workload(windows, seed)
    assert all(s.is_finished for s in seqs)
    assert all(p.num_free == p.num_blocks for p in bm.pools)
    assert bm.state_slots.num_free == 5
    assert bm.prefix_hits > 0  # shared prefixes do hit


def test_random_workloads_do_preempt() -> None:
    """Guards the test above: its pools are small enough that preemption happens."""
    assert sum(random_workload(w, seed)[1].num_preemptions for w in WORKLOADS for seed in range(4)) > 0


def test_prefix_hit_after_window_blocks_were_freed_and_evicted() -> None:
    """A prompt recomputed after its owner's out-of-window blocks went back to the pool: the
    hit is valid while the window blocks before it are cached, and shrinks once they are evicted."""
    bm = BlockManager(0, BS, groups=[PagedGroup("sliding", 12, sliding_window=W)])
    prompt = list(range(40))
    a = make_seq("a", prompt, max_tokens=1)
    run(bm, [a], budget=40)
    # 40 tokens written; the blocks before the last window were freed (and stay cached).
    b = make_seq("b", prompt[:33] + [99])
    hit = bm.match_prefix(b)
    assert hit == 32
    # The hit needs only the blocks the first recomputed query sees: positions 32-W+1.. -> blocks 6, 7.
    assert first_needed_block(32, W, BS) == 6
    assert bm.allocate(b, b.num_tokens - hit)
    assert b.block_table[:6] == [NULL_BLOCK] * 6 and NULL_BLOCK not in b.block_table[6:]
    bm.free(b)
    # Evict everything cached: a long unrelated sequence takes the whole pool.
    c = make_seq("c", list(range(500, 548)))
    assert bm.allocate(c, 48)
    bm.free(c)
    assert bm.match_prefix(make_seq("d", prompt[:33] + [99])) == 0


def test_full_group_limits_the_hit_of_a_mixed_layout() -> None:
    groups = [PagedGroup("full", 16), PagedGroup("sliding", 16, sliding_window=W)]
    bm = BlockManager(0, BS, groups=groups)
    prompt = list(range(24))
    a = make_seq("a", prompt, max_tokens=1)
    run(bm, [a], budget=24)
    assert bm.match_prefix(make_seq("b", prompt + [1])) == 24
    # Evict the full group's head block only: no hit can skip it.
    pool = bm.pools[0]
    head_hash = next(iter(pool.cached))  # block 0's hash was registered first
    victim = pool.cached.pop(head_hash)
    pool.blocks[victim].hash = None
    assert bm.match_prefix(make_seq("c", prompt + [1])) == 0


# --------------------------------------------------------------------------- state slots


def slot_manager(num_slots: int, num_blocks: int = 32) -> BlockManager:
    return BlockManager(num_blocks, BS, num_state_slots=num_slots)


def test_state_slot_taken_on_admission_and_returned_on_finish() -> None:
    bm = slot_manager(2)
    a = make_seq("a", [1, 2, 3])
    assert a.state_slot is None
    assert bm.allocate(a, 3)
    assert a.state_slot is not None and bm.state_slots.num_used == 1
    assert bm.allocate(a, 1)  # a later step does not take another
    assert bm.state_slots.num_used == 1
    bm.free(a)
    assert a.state_slot is None and bm.state_slots.num_free == 2


def test_admission_needs_a_slot_as_well_as_blocks(allocation_probe) -> None:
    bm = slot_manager(1)
    a, b = make_seq("a", [1, 2]), make_seq("b", [3, 4])
    assert allocation_probe.can_allocate(bm, b, 2)
    assert bm.allocate(a, 2)
    assert not allocation_probe.can_allocate(bm, b, 2)
    used = bm.num_used_blocks
    assert not bm.allocate(b, 2)  # plenty of blocks, no slot: nothing changes
    assert b.block_table == [] and b.state_slot is None and bm.num_used_blocks == used


def test_scheduler_waits_for_a_slot_then_admits() -> None:
    bm = slot_manager(2)
    seqs = [make_seq(f"r{i}", [i, i + 1, i + 2], max_tokens=3) for i in range(5)]
    most = []
    run(bm, seqs, budget=64, on_step=lambda s: most.append(s.num_running))
    assert max(most) == 2  # the slot pool, not max_num_seqs (8), bounds the batch
    assert all(s.num_output_tokens == 3 for s in seqs)
    assert bm.state_slots.num_free == 2


def test_state_slot_returned_on_abort_error_and_preemption() -> None:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)
    # abort
    bm = slot_manager(2)
    sched = Scheduler(config, bm, max_model_len=1000)
    a = make_seq("a", [1, 2, 3])
    sched.add(a)
    sched.schedule()
    assert a.state_slot is not None
    sched.abort("a")
    assert a.state_slot is None and bm.state_slots.num_free == 2
    # error: a prompt that can never fit the pool
    bm = slot_manager(2, num_blocks=2)
    sched = Scheduler(config, bm, max_model_len=1000)
    big = make_seq("big", list(range(40)))
    sched.add(big)
    out = sched.schedule()
    assert big in out.finished and big.stop_reason == KV_CACHE_TOO_SMALL
    assert big.state_slot is None and bm.state_slots.num_free == 2
    # preemption: two sequences outgrow a 4-block pool; the later one is preempted
    bm = slot_manager(2, num_blocks=4)
    sched = Scheduler(config, bm, max_model_len=1000)
    x, y = make_seq("x", [1] * 7, max_tokens=20), make_seq("y", [2] * 7, max_tokens=20)
    sched.add(x), sched.add(y)
    preempted = None
    for _ in range(10):
        out = sched.schedule()
        for item in out.scheduled:
            if item.sample:
                item.seq.append_token(5)
        sched.update(out)
        if out.preempted:
            preempted = out.preempted[0]
            break
    assert preempted is y
    assert y.state_slot is None and y.block_table == []
    assert bm.state_slots.num_used == 1 and x.state_slot is not None


def test_double_release_of_a_slot_is_an_error() -> None:
    bm = slot_manager(1)
    a = make_seq("a", [1])
    bm.allocate(a, 1)
    slot = a.state_slot
    bm.free(a)
    with pytest.raises(RuntimeError):
        bm.state_slots.release(slot)


# --------------------------------------------------------------------------- runner and engine


def test_runner_allocates_a_state_group_and_the_engine_hands_out_its_slots(monkeypatch) -> None:
    """A model declaring a state group (no model uses one yet): the planner reserves its bytes,
    the runner allocates its tensors, and the engine's requests take and return slots."""
    import torch

    from tandem.engine_service.cache.cache_spec import CacheGroup, CacheLayout, StateSpec
    from tandem.engine_service.config import CacheConfig, EngineConfig, ModelConfig
    from tandem.engine_service.core.engine import LLMEngine
    from tandem.engine_service.models.llama import LlamaForCausalLM

    plain_layout = LlamaForCausalLM.cache_layout
    spec = StateSpec(((3, 5), (2, 4, 4)), ("float32", "bfloat16"))

    def with_state(self, dtype: str) -> CacheLayout:
        return CacheLayout(plain_layout(self, dtype).groups + (CacheGroup("recurrent", spec, (0, 1)),))

    monkeypatch.setattr(LlamaForCausalLM, "cache_layout", with_state)
    config = EngineConfig(
        ModelConfig(model="dummy:tiny-llama", attention_backend="torch", max_model_len=64),
        CacheConfig(block_size=BS, cpu_kv_cache_bytes=1 << 22),
        SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=32, overlap_scheduling="off"),
    )
    engine = LLMEngine(config)
    runner, bm = engine.runner, engine.block_manager
    plan = runner.memory_plan
    state = plan.state_groups[0]
    assert (state.name, state.num_slots, state.bytes_per_slot) == ("recurrent", 3, 2 * (15 * 4 + 32 * 2))
    per_block = plan.paged_groups[0].bytes_per_block
    # State checkpoints (prefix caching) take their share of what the request slots leave.
    left = (1 << 22) - 3 * state.bytes_per_slot
    checkpoints = int(left * config.cache.state_checkpoint_memory_fraction) // state.bytes_per_slot
    assert state.num_checkpoint_slots == checkpoints > 0
    assert plan.num_blocks == (left - checkpoints * state.bytes_per_slot) // per_block
    tensors = runner.cache_tensors.state["recurrent"]
    assert sorted(tensors) == [0, 1]
    slots = 3 + checkpoints + 1  # request slots, checkpoint slots, scratch
    assert [(tuple(t.shape), t.dtype) for t in tensors[0]] == [((slots, 3, 5), torch.float32),
                                                               ((slots, 2, 4, 4), torch.bfloat16)]
    assert bm.state_slots is not None and bm.state_slots.num_slots == 3
    assert bm.checkpoints is not None and bm.checkpoints.num_slots == checkpoints
    seen: set[int] = set()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i in range(5):
        engine.add_request(f"r{i}", [5 + i, 6, 7], params)
    while engine.has_work():
        engine.step()
        running = engine.scheduler.running
        slots = [s.state_slot for s in running]
        assert None not in slots and len(set(slots)) == len(slots) <= 3
        seen.update(slots)
    assert seen <= {0, 1, 2} and bm.state_slots.num_free == 3
