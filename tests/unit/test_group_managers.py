"""Each cache kind's group manager on its own (the coordinator, `BlockManager`, is tested in
test_block_manager, test_cache_groups and test_hybrid_prefix_cache)."""

from __future__ import annotations

import pytest

from tandem.engine_service.cache.block_manager import PAGED_MANAGERS, BlockManager, hash_block
from tandem.engine_service.cache.block_pool import PagedGroup
from tandem.engine_service.cache.cache_spec import FullAttentionSpec, LatentSpec, SlidingWindowSpec, StateSpec
from tandem.engine_service.cache.full_attention_manager import FullAttentionManager
from tandem.engine_service.cache.group_manager import NULL_BLOCK, Hit
from tandem.engine_service.cache.latent_manager import LatentManager
from tandem.engine_service.cache.memory_plan import GroupPlan, MemoryPlan
from tandem.engine_service.cache.sliding_window_manager import SlidingWindowManager, first_needed_block
from tandem.engine_service.cache.state_slot_manager import StateSlotManager
from tandem.engine_service.config import CacheConfig
from tandem.engine_service.sequence import SamplingParams, Sequence

BS = 4


def make_seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, tokens, SamplingParams())


def hashes_of(tokens: list[int], num_blocks: int) -> list[int]:
    out: list[int] = []
    for i in range(num_blocks):
        out.append(hash_block(out[-1] if out else None, tokens[i * BS : (i + 1) * BS]))
    return out


def scan(manager, hashes: list[int], state_loaded: bool = False) -> tuple[list[bool], list[bool]]:
    """Feed `hashes` in order (as the coordinator does, stopping at the first False); returns what
    `feed` and `valid` answered for each block fed."""
    s = manager.hit_scan(state_loaded)
    fed, valid = [], []
    for i, h in enumerate(hashes):
        fed.append(s.feed(i, h))
        if not fed[-1]:
            break
        valid.append(s.valid(i + 1, h))
    return fed, valid


def admit(manager, seq: Sequence, num_new: int, hit: Hit | None = None) -> None:
    """Admission as the coordinator runs it for one paged group (table 0)."""
    hit = hit or Hit(0, [], 0)
    assert manager.fits(seq, num_new, hit)
    seq.block_tables = [[]]
    manager.take_hit(seq, hit, restore=True)
    seq.num_computed_tokens = hit.blocks * BS
    manager.grow(seq, num_new, state_loaded=False)


def write(manager, seq: Sequence, upto: int) -> None:
    """The model wrote `seq` up to `upto`: commit and cache the newly full blocks."""
    seq.num_computed_tokens = upto
    manager.commit(seq, upto)
    first = len(seq.block_hashes)
    seq.block_hashes = hashes_of(seq.token_ids, upto // BS)
    manager.cache_blocks(seq, first, upto // BS)


# --------------------------------------------------------------------------- full attention


def test_full_attention_grows_by_whole_blocks_and_caches_full_ones() -> None:
    m = FullAttentionManager(PagedGroup("full", 8), 0, BS)
    seq = make_seq(list(range(10)))
    assert m.num_new_blocks(seq, 10, Hit(0)) == 3
    admit(m, seq, 10)
    assert len(seq.block_table) == 3 and m.pool.num_free == 5
    write(m, seq, 10)
    blocks = [m.pool.blocks[b] for b in seq.block_table]
    assert [b.num_tokens for b in blocks] == [4, 4, 2]
    assert [b.hash for b in blocks] == seq.block_hashes + [None]  # the partial block is not cached
    assert m.num_new_blocks(seq, 2) == 0 and m.num_new_blocks(seq, 3) == 1
    m.grow(seq, 3, state_loaded=False)
    assert len(seq.block_table) == 4


def test_full_attention_scan_stops_at_the_first_missing_block() -> None:
    m = FullAttentionManager(PagedGroup("full", 8), 0, BS)
    tokens = list(range(13))
    seq = make_seq(tokens)
    admit(m, seq, 13)
    write(m, seq, 12)
    hashes = seq.block_hashes
    assert scan(m, hashes) == ([True] * 3, [True] * 3)
    # Drop block 1 from the cache: no hit may reach past block 0.
    victim = m.pool.cached.pop(hashes[1])
    m.pool.blocks[victim].hash = None
    assert scan(m, hashes) == ([True, False], [True])


def test_full_attention_hit_of_evictable_blocks_needs_room_for_them() -> None:
    m = FullAttentionManager(PagedGroup("full", 4), 0, BS)
    a = make_seq(list(range(9)), "a")
    admit(m, a, 9)
    write(m, a, 9)
    m.free(a)  # blocks 0 and 1 cached and evictable, block 2 free: 4 free in all
    b = make_seq(list(range(8)) + [50] * 9, "b")
    hit = Hit(2, hashes_of(b.token_ids, 2), 2)
    # Reviving the two hits and 3 new blocks needs 5 > 4; 2 new blocks fit exactly.
    assert not m.fits(b, 12, hit)
    assert m.fits(b, 8, hit)
    admit(m, b, 8, hit)
    assert b.block_table[:2] == [m.pool.cached[h] for h in hit.hashes] and m.pool.num_free == 0


def test_full_attention_free_makes_the_tail_block_the_first_evicted() -> None:
    m = FullAttentionManager(PagedGroup("full", 3), 0, BS)
    a = make_seq(list(range(13)), "a")
    admit(m, a, 12)
    write(m, a, 12)
    head, _, tail = a.block_table
    m.free(a)
    assert list(m.pool.evictable) == [tail, a.block_table[1], head]
    assert m.pool.take_free() == tail


def test_latent_is_its_own_kind_with_full_attention_books() -> None:
    m = LatentManager(PagedGroup("latent", 8, kind="latent"), 0, BS)
    assert m.kind == "latent" == LatentSpec(8, "bfloat16").kind
    seq = make_seq(list(range(9)))
    admit(m, seq, 9)
    write(m, seq, 8)
    assert m.first_live_block(100 * BS) == 0  # every entry stays read
    victim = m.pool.cached.pop(seq.block_hashes[0])
    m.pool.blocks[victim].hash = None
    assert scan(m, seq.block_hashes) == ([False], [])


# --------------------------------------------------------------------------- sliding window


def test_first_needed_block_follows_the_window() -> None:
    for window in (1, 3, 4, 9):
        for pos in range(30):
            first_key = max(0, pos - window + 1)
            assert first_needed_block(pos, window, BS) == first_key // BS
            m = SlidingWindowManager(PagedGroup("w", 4, window), 0, BS)
            assert m.first_live_block(pos) == first_key // BS
    assert first_needed_block(25, None, BS) == 0


def test_sliding_window_trim_gives_back_blocks_behind_the_window() -> None:
    window = 6
    m = SlidingWindowManager(PagedGroup("w", 8, window), 0, BS)
    seq = make_seq(list(range(20)))
    admit(m, seq, 20)
    write(m, seq, 20)
    first = first_needed_block(20, window, BS)
    assert first == 3
    kept = seq.block_table[first:]
    assert m.room(seq, None) == m.pool.num_free + first  # what trim would give back counts as room
    m.trim(seq)
    assert seq.block_table[:first] == [NULL_BLOCK] * first and seq.block_table[first:] == kept
    assert m.pool.num_free == 8 - len(kept)
    m.trim(seq)  # nothing left behind the window: a no-op
    assert m.pool.num_free == 8 - len(kept)


def test_sliding_window_room_skips_shared_blocks() -> None:
    """A block another request still holds does not go back to the pool when trimmed."""
    window = 4
    m = SlidingWindowManager(PagedGroup("w", 8, window), 0, BS)
    a = make_seq(list(range(9)), "a")
    admit(m, a, 9)
    write(m, a, 9)
    b = make_seq(list(range(8)) + [70] * 5, "b")
    hit = Hit(2, a.block_hashes[:2], 2)
    admit(m, b, 5, hit)  # reads blocks from first_needed_block(8) = 1: block 0 stays NULL
    assert b.block_table[0] == NULL_BLOCK and b.block_table[1] == a.block_table[1]
    b.num_computed_tokens = 13
    # Behind b's window now: block 1 (shared with a, so it stays in use) and nothing else.
    assert m.room(b, None) == m.pool.num_free
    m.trim(b)
    assert m.pool.blocks[a.block_table[1]].ref_count == 1 and b.block_table[1] == NULL_BLOCK


def test_sliding_window_scan_needs_only_the_blocks_its_next_query_reads() -> None:
    window = 5
    m = SlidingWindowManager(PagedGroup("w", 8, window), 0, BS)
    h = list(range(100, 106))
    for missing in range(len(h)):
        m.pool.cached.clear()
        m.pool.cached.update({x: 0 for x in h if x != h[missing]})
        fed, valid = scan(m, h)
        assert fed == [True] * len(h)  # a window never ends the scan
        # A hit of k blocks holds iff every block its next query reads is cached.
        expected = [missing not in range(first_needed_block(k * BS, window, BS), k) for k in range(1, len(h) + 1)]
        assert valid == expected


def test_sliding_window_needs_a_window() -> None:
    with pytest.raises(ValueError, match="needs a window"):
        SlidingWindowManager(PagedGroup("w", 8, kind="sliding_window"), 0, BS)


# --------------------------------------------------------------------------- state slots


def state_manager(num_slots: int = 2, num_checkpoints: int = 2, stride: int = 2 * BS) -> StateSlotManager:
    return StateSlotManager(BS, num_slots, num_checkpoints, stride)


def test_state_admission_needs_a_free_slot_and_free_returns_it() -> None:
    m = state_manager(num_slots=1, num_checkpoints=0)
    a, b = make_seq([1, 2], "a"), make_seq([3, 4], "b")
    assert m.fits(a, 2, Hit(0)) and m.checkpoints is None
    m.take_hit(a, Hit(0), restore=True)
    assert a.state_slot == 0 and m.slots.num_free == 0
    assert not m.fits(b, 2, Hit(0))
    assert m.fits(a, 2, None)  # an admitted request asks for no slot
    m.free(a)
    assert a.state_slot is None and m.fits(b, 2, Hit(0))


def test_state_hits_hold_only_at_checkpoints_unless_the_state_is_loaded() -> None:
    m = state_manager()
    hashes = [11, 12, 13]
    slot = m.checkpoints.take()
    m.checkpoints.register(12, slot)
    assert scan(m, hashes) == ([True] * 3, [False, True, False])
    assert scan(m, hashes, state_loaded=True) == ([True] * 3, [True] * 3)
    no_ck = state_manager(num_checkpoints=0)
    assert scan(no_ck, hashes) == ([True] * 3, [False] * 3)


def test_state_saves_at_stride_positions_and_registers_once_hashed() -> None:
    stride = 2 * BS
    m = state_manager(stride=stride)
    seq = make_seq(list(range(3 * stride + 1)))
    m.take_hit(seq, Hit(0), restore=True)
    assert m.cut_chunk(seq, 0, stride + 3) == stride  # ends on the last checkpoint it reaches
    assert m.cut_chunk(seq, 0, stride - 1) == stride - 1  # reaches none
    m.grow(seq, stride, state_loaded=False)
    before, after = m.pop_copies()
    assert before == [] and len(after) == 1 and after[0][0] == seq.state_slot
    ck_slot = after[0][1]
    assert m.checkpoints.num_pending == 1
    seq.block_hashes = hashes_of(seq.token_ids, stride // BS)
    m.cache_blocks(seq, 0, stride // BS)
    assert m.checkpoints.num_pending == 0 and m.checkpoints.hashes() == [seq.block_hashes[-1]]
    m.grow(seq, 3, state_loaded=False)  # stride + 3 is no checkpoint position
    assert m.pop_copies() == ([], [])
    # A second request hitting that prefix gets the checkpoint restored into its slot.
    other = make_seq(seq.token_ids, "o")
    m.take_hit(other, Hit(stride // BS, seq.block_hashes, stride // BS), restore=True)
    assert m.pop_copies() == ([(ck_slot, other.state_slot)], [])
    assert m.checkpoints.num_restored == 1


def test_state_load_saves_and_restores_nothing() -> None:
    m = state_manager()
    seq = make_seq(list(range(20)))
    m.take_hit(seq, Hit(2, hashes_of(seq.token_ids, 2), 2), restore=False)
    seq.num_computed_tokens = 2 * BS
    m.grow(seq, 2 * BS, state_loaded=True)
    assert m.pop_copies() == ([], []) and m.checkpoints.num_pending == 0


def test_state_free_releases_pending_saves_and_drops_queued_copies() -> None:
    m = state_manager()
    a, b = make_seq(list(range(20)), "a"), make_seq(list(range(50, 70)), "b")
    for s in (a, b):
        m.take_hit(s, Hit(0), restore=True)
        m.grow(s, 2 * BS, state_loaded=False)
    assert m.checkpoints.num_pending == 2
    m.free(a)
    assert m.checkpoints.num_pending == 1 and a.state_slot is None
    _, after = m.pop_copies()
    assert [dst for _, dst in after] == list(m.checkpoints._pending)


def test_state_reset_drops_checkpoints_and_saves_in_flight() -> None:
    m = state_manager()
    seq = make_seq(list(range(20)))
    m.take_hit(seq, Hit(0), restore=True)
    m.grow(seq, 2 * BS, state_loaded=False)
    m.reset_prefix_cache()  # the save above was computed before the reset
    seq.block_hashes = hashes_of(seq.token_ids, 2)
    m.cache_blocks(seq, 0, 2)
    assert m.checkpoints.num_registered == 0 and m.checkpoints.num_free == m.checkpoints.num_slots


def test_state_checkpoint_goes_with_its_evicted_block() -> None:
    m = state_manager()
    slot = m.checkpoints.take()
    m.checkpoints.register(99, slot)
    listener = m.eviction_listener()
    listener(98)  # a block without a checkpoint
    assert 99 in m.checkpoints
    listener(99)
    assert 99 not in m.checkpoints and state_manager(num_checkpoints=0).eviction_listener() is None


def test_state_usage_reports_slots_and_checkpoints() -> None:
    m = state_manager(num_slots=3, num_checkpoints=2)
    seq = make_seq(list(range(20)))
    m.take_hit(seq, Hit(0), restore=True)
    m.grow(seq, 2 * BS, state_loaded=False)
    assert m.usage() == {"state_slots": {"total": 3, "used": 1},
                         "state_checkpoints": {"total": 2, "used": 1, "pending": 1}}


def test_checkpoint_stride_rule_is_the_configs() -> None:
    """The manager and the config refuse the same strides with the same message."""
    for stride in (0, 2, 6, 9):
        with pytest.raises(ValueError) as from_config:
            CacheConfig(block_size=BS, state_checkpoint_stride=stride).validate()
        with pytest.raises(ValueError) as from_manager:
            state_manager(stride=stride)
        assert str(from_config.value) == str(from_manager.value)
    assert state_manager(stride=3 * BS).checkpoint_stride == 3 * BS
    assert StateSlotManager(BS, 1, 1, 6, enable_prefix_caching=False).checkpoints is None


# --------------------------------------------------------------------------- the coordinator's list


def test_every_paged_spec_kind_has_a_manager() -> None:
    specs = [FullAttentionSpec(1, 8, "float32"), SlidingWindowSpec(1, 8, "float32", sliding_window=4),
             LatentSpec(8, "float32")]
    assert sorted(PAGED_MANAGERS) == sorted(s.kind for s in specs)
    assert not StateSpec(((2,),), ("float32",)).paged and StateSlotManager.kind == StateSpec.kind


def test_managers_follow_the_plan_kinds_and_unknown_kinds_are_refused() -> None:
    plan = MemoryPlan(BS, (
        GroupPlan("full", "full_attention", (0,), num_blocks=8),
        GroupPlan("w", "sliding_window", (1,), num_blocks=6, sliding_window=5),
        GroupPlan("lat", "latent", (2,), num_blocks=8),
        GroupPlan("state", "state", (3,), num_slots=2, num_checkpoint_slots=1),
    ))
    bm = BlockManager.from_plan(plan, True, 2 * BS)
    assert [type(m) for m in bm.managers] == [FullAttentionManager, SlidingWindowManager, LatentManager,
                                              StateSlotManager]
    assert [m.index for m in bm.paged_managers] == [0, 1, 2] and bm.pools[1].window == 5
    with pytest.raises(ValueError, match="no manager for paged cache kind 'compressed'"):
        BlockManager(8, BS, groups=[PagedGroup("c", 8, kind="compressed")])


def test_an_eviction_in_any_paged_group_drops_the_checkpoint() -> None:
    bm = BlockManager(0, BS, groups=[PagedGroup("full", 2), PagedGroup("w", 2, 4)], num_state_slots=1,
                      num_checkpoint_slots=1, checkpoint_stride=BS)
    for g, pool in enumerate(bm.pools):
        slot = bm.checkpoints.take()
        bm.checkpoints.register(7, slot)
        block = pool.take_free()
        pool.register(7, block)
        pool.release(block)  # cached and evictable
        pool.take_free()  # the never-used block
        assert 7 in bm.checkpoints, g
        pool.take_free()  # evicts the cached one
        assert 7 not in bm.checkpoints, g
