"""BlockManager: block accounting, ref counts, chained prefix hashes, LRU eviction, rollback."""

from __future__ import annotations

import pytest

from tandem.engine_service.cache.block_manager import BlockManager, hash_block, salt_root
from tandem.engine_service.sequence import SamplingParams, Sequence

BS = 4


def make_seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, tokens, SamplingParams())


def prefill(bm: BlockManager, seq: Sequence) -> int:
    """Admit `seq` the way the scheduler does and pretend the model wrote all its K/V."""
    hits = bm.match_prefix(seq)
    assert bm.allocate(seq, seq.num_tokens - hits)
    assert seq.num_computed_tokens == hits
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)
    return hits


def naive_hits(cached_token_lists: list[list[int]], prompt: list[int], bs: int = BS) -> int:
    """Reference: longest block-aligned common prefix with any cached sequence, never all of it."""
    best = 0
    for cached in cached_token_lists:
        n = 0
        while (
            n + bs <= len(cached)
            and n + bs <= len(prompt)
            and cached[n : n + bs] == prompt[n : n + bs]
        ):
            n += bs
        best = max(best, n)
    return min(best, (len(prompt) - 1) // bs * bs)


def ref_counts_from_tables(bm: BlockManager, seqs: list[Sequence]) -> list[int]:
    counts = [0] * bm.num_blocks
    for s in seqs:
        for b in s.block_table:
            counts[b] += 1
    return counts


def test_allocate_and_free_accounting(allocation_probe) -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = make_seq("a", list(range(10)))
    assert allocation_probe.num_blocks_needed(bm, seq, 10) == 3
    assert bm.allocate(seq, 10)
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert bm.num_used_blocks == 3
    assert bm.num_free_blocks == 5
    assert bm.usage == pytest.approx(3 / 8)
    seq.num_computed_tokens = 10
    bm.commit(seq)
    # 10 -> 11 tokens still fits in 3 blocks; 12 -> 13 needs a fourth.
    assert allocation_probe.num_blocks_needed(bm, seq, 1) == 0
    assert bm.allocate(seq, 1)
    assert len(seq.block_table) == 3
    seq.num_computed_tokens = 12
    assert allocation_probe.num_blocks_needed(bm, seq, 1) == 1
    assert bm.allocate(seq, 1)
    assert len(seq.block_table) == 4
    assert bm.slot(seq, 13) == seq.block_table[3] * BS + 1
    bm.free(seq)
    assert seq.block_table == [] and seq.block_hashes == []
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 8
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_shared_prefix_ref_counts() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    base = list(range(100, 109))  # 2 full blocks + 1 token
    a = make_seq("a", base)
    assert prefill(bm, a) == 0
    b = make_seq("b", base[:8] + [7, 7, 7])
    assert prefill(bm, b) == naive_hits([a.token_ids], b.token_ids) == 8
    assert b.num_cached_prompt_tokens == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert [bm.blocks[i].ref_count for i in range(16)] == ref_counts_from_tables(bm, [a, b])
    assert bm.num_used_blocks == 4
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in range(16)] == ref_counts_from_tables(bm, [b])
    assert bm.num_used_blocks == 3
    bm.free(b)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 16
    # Still cached after release.
    assert bm.match_prefix(make_seq("c", base)) == 8


def test_chained_hash_needs_matching_parent() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    prefill(bm, a)
    # Same second block after a different first block: no hit at all.
    other_head = [9, 9, 9, 9, 5, 6, 7, 8, 0]
    assert bm.match_prefix(make_seq("c", other_head)) == 0 == naive_hits([a.token_ids], other_head)
    # Same first block, different second block: only the first hits.
    other_tail = [1, 2, 3, 4, 5, 6, 7, 0, 0]
    assert bm.match_prefix(make_seq("d", other_tail)) == 4 == naive_hits([a.token_ids], other_tail)
    # The hash itself depends on the parent, and on the root/child distinction.
    assert hash_block(None, [5, 6, 7, 8]) != hash_block(hash_block(None, [1, 2, 3, 4]), [5, 6, 7, 8])
    assert hash_block(None, [1, 2, 3, 4]) == hash_block(None, (1, 2, 3, 4))
    assert hash_block(None, [1, 2, 3, 4]) != hash_block(None, [1, 2, 3, 5])


def test_equal_block_after_different_prefixes_never_shares_kv() -> None:
    """A cached block's K/V depend on every token before it, not only on its own ids: a block
    with the same ids after a different prefix must never be handed out as a hit."""
    bm = BlockManager(num_blocks=16, block_size=BS)
    p1, p2, shared = [1, 1, 1, 1], [2, 2, 2, 2], [5, 6, 7, 8]
    a = make_seq("a", p1 + shared + [0])
    prefill(bm, a)
    a_blocks = list(a.block_table)
    bm.free(a)
    b = make_seq("b", p2 + shared + [0])
    assert prefill(bm, b) == 0
    b_blocks = list(b.block_table)
    bm.free(b)
    # Both a's and b's blocks stay cached; a prompt after p2 must get b's K/V for `shared`.
    d = make_seq("d", p2 + shared + [3])
    assert prefill(bm, d) == 8
    assert d.block_table[:2] == b_blocks[:2]
    assert a_blocks[1] not in d.block_table
    # The hash of a child block depends on the parent's value, not only on having one.
    parent1, parent2 = hash_block(None, p1), hash_block(None, p2)
    assert hash_block(parent1, shared) != hash_block(parent2, shared)


def test_cache_salts_partition_the_prefix_cache() -> None:
    """Sequences share cached blocks only within one cache_salt (the unsalted ones are one more
    partition): the same prompt under another salt hits nothing."""
    bm = BlockManager(num_blocks=32, block_size=BS)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]

    def salted(rid: str, salt: str) -> Sequence:
        return Sequence(rid, list(prompt), SamplingParams(cache_salt=salt))

    a = salted("a", "tenant-a")
    assert prefill(bm, a) == 0
    bm.free(a)
    assert bm.match_prefix(salted("b", "tenant-b")) == 0
    assert bm.match_prefix(make_seq("c", list(prompt))) == 0  # unsalted: not tenant-a's either
    assert bm.match_prefix(salted("d", "tenant-a")) == 8  # the same salt hits
    assert salt_root("") is None and salt_root("x") != salt_root("y")
    assert hash_block(salt_root("x"), prompt[:4]) != hash_block(None, prompt[:4])


def test_every_hit_block_was_written_after_the_same_prefix() -> None:
    """Randomized: record for every written block the full token prefix it was computed from;
    every prefix hit must come from a block computed from exactly the requester's prefix."""
    import random

    rng = random.Random(7)
    bm = BlockManager(num_blocks=24, block_size=BS)
    written: dict[int, list[int]] = {}  # block id -> tokens 0..end of block when it was written
    live: list[Sequence] = []
    blocks_pool = [[rng.randrange(3) for _ in range(BS)] for _ in range(4)]
    num_hits = 0
    for i in range(400):
        if live and (rng.random() < 0.5 or bm.num_free_blocks < 6):
            bm.free(live.pop(rng.randrange(len(live))))
            continue
        tokens = [t for _ in range(rng.randint(1, 4)) for t in rng.choice(blocks_pool)] + [9]
        seq = make_seq(f"s{i}", tokens)
        hits = bm.match_prefix(seq)
        if not bm.allocate(seq, seq.num_tokens - hits):
            continue
        for j in range(hits // BS):
            block_id = seq.block_table[j]
            assert written[block_id] == tokens[: (j + 1) * BS], "K/V of another prefix shared"
        num_hits += hits // BS
        for j in range(hits // BS, seq.num_tokens // BS):  # blocks this prefill writes
            written[seq.block_table[j]] = tokens[: (j + 1) * BS]
        seq.num_computed_tokens = seq.num_tokens
        bm.commit(seq)
        live.append(seq)
    assert num_hits > 50


def test_never_the_whole_prompt() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_seq("a", list(range(8)))
    a.append_token(50)
    a.append_token(51)
    prefill(bm, a)  # 10 tokens: blocks 0 and 1 full and cached
    same = make_seq("b", list(range(8)))
    # Both full blocks are cached, but the last prompt token must be computed.
    assert bm.match_prefix(same) == 4
    assert bm.allocate(same, 4)
    assert same.num_computed_tokens == 4 < same.num_prompt_tokens
    longer = make_seq("c", list(range(8)) + [50])
    assert bm.match_prefix(longer) == 8
    assert bm.match_prefix(make_seq("d", list(range(3)))) == 0


def test_recompute_hits_prompt_and_output() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_seq("a", list(range(6)))
    prefill(bm, a)
    for t in (60, 61, 62):  # decode three tokens, writing K/V of all but the last
        a.append_token(t)
        assert bm.allocate(a, a.num_uncomputed_tokens)
        a.num_computed_tokens = a.num_tokens
        bm.commit(a)
    a.append_token(63)  # 10 tokens, 9 computed
    assert a.num_cached_prompt_tokens == 0
    bm.free(a)
    a.num_computed_tokens = 0
    # Recompute: blocks 0 and 1 (prompt + first outputs) come back from the cache.
    assert bm.match_prefix(a) == 8
    assert bm.allocate(a, 2)
    assert a.num_computed_tokens == 8
    assert a.num_cached_prompt_tokens == 0  # first-admission value is kept
    assert len(a.block_table) == 3


def test_lru_eviction_order_tail_first() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS)
    a = make_seq("a", [1] * 4 + [2] * 4 + [3])
    b = make_seq("b", [4] * 4 + [5] * 4 + [6])
    prefill(bm, a)
    bm.free(a)
    prefill(bm, b)
    bm.free(b)
    assert bm.num_cached_blocks == 4 and bm.num_free_blocks == 6
    probe_a = make_seq("pa", a.token_ids)
    probe_b = make_seq("pb", b.token_ids)
    assert (bm.match_prefix(probe_a), bm.match_prefix(probe_b)) == (8, 8)

    # Two never-cached blocks are used first, then the oldest cached: a's tail block.
    x = make_seq("x", list(range(200, 212)))
    assert bm.allocate(x, 12)
    assert (bm.match_prefix(probe_a), bm.match_prefix(probe_b)) == (4, 8)
    y = make_seq("y", list(range(300, 304)))
    assert bm.allocate(y, 4)
    assert (bm.match_prefix(probe_a), bm.match_prefix(probe_b)) == (0, 8)
    z = make_seq("z", list(range(400, 404)))
    assert bm.allocate(z, 4)
    assert (bm.match_prefix(probe_a), bm.match_prefix(probe_b)) == (0, 4)


def test_hit_refreshes_lru_position() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_seq("a", [1] * 4 + [2])
    b = make_seq("b", [3] * 4 + [4])
    prefill(bm, a)
    bm.free(a)
    prefill(bm, b)
    bm.free(b)
    # Reuse a's cached block: it becomes the most recently used.
    a2 = make_seq("a2", [1] * 4 + [9])
    assert prefill(bm, a2) == 4
    bm.free(a2)
    # Take every free-list block (the unhashed tails) plus exactly one cached block.
    x = make_seq("x", list(range(100, 100 + 4 * (bm.num_free_blocks - 1))))
    assert bm.allocate(x, x.num_tokens)
    assert bm.match_prefix(make_seq("pb", [3] * 4 + [0])) == 0  # b's block was older: evicted
    assert bm.match_prefix(make_seq("pa", [1] * 4 + [0])) == 4


def test_failed_allocation_changes_nothing(allocation_probe) -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    x = make_seq("x", list(range(9)))
    prefill(bm, x)
    bm.free(x)  # blocks 0,1 cached and evictable; block 2 free
    y = make_seq("y", [77] * 4)
    assert bm.allocate(y, 4)  # takes the never-used block
    queries, hits = bm.prefix_queries, bm.prefix_hits
    refs = [blk.ref_count for blk in bm.blocks]
    free_before = bm.num_free_blocks

    z = make_seq("z", list(range(8)) + list(range(500, 510)))  # 2 hit blocks + 3 new needed
    assert bm.match_prefix(z) == 8
    assert allocation_probe.num_blocks_needed(bm, z, 10) == 3
    assert not allocation_probe.can_allocate(bm, z, 10)
    assert not bm.allocate(z, 10)
    assert z.block_table == [] and z.block_hashes == []
    assert z.num_computed_tokens == 0 and z.num_cached_prompt_tokens is None
    assert [blk.ref_count for blk in bm.blocks] == refs
    assert bm.num_free_blocks == free_before
    assert (bm.prefix_queries, bm.prefix_hits) == (queries, hits)
    assert bm.match_prefix(z) == 8  # the cached blocks were not evicted by the attempt

    # A chunk that fits: the two hits plus one new block.
    assert allocation_probe.can_allocate(bm, z, 4)
    assert bm.allocate(z, 4)
    assert z.num_computed_tokens == 8 and len(z.block_table) == 3
    assert bm.num_free_blocks == 0


def test_duplicate_commit_keeps_first_mapping() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = list(range(9))
    a, b = make_seq("a", prompt), make_seq("b", prompt)
    # Both admitted before either wrote anything: no hits, private blocks.
    assert bm.allocate(a, 9) and bm.allocate(b, 9)
    for s in (a, b):
        s.num_computed_tokens = 9
        bm.commit(s)
    assert a.block_hashes == b.block_hashes and len(a.block_hashes) == 2
    assert bm.num_cached_blocks == 2
    assert [bm.blocks[i].hash is not None for i in b.block_table[:2]] == [False, False]
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8
    c = make_seq("c", prompt)
    assert prefill(bm, c) == 8
    assert c.block_table[:2] == registered_block_ids(bm, prompt)


def registered_block_ids(bm: BlockManager, prompt: list[int]) -> list[int]:
    """Block ids registered for the first two blocks of `prompt`, recomputed independently."""
    h0 = hash_block(None, prompt[:4])
    h1 = hash_block(h0, prompt[4:8])
    ids = {blk.hash: blk.block_id for blk in bm.blocks if blk.hash is not None}
    return [ids[h0], ids[h1]]


def test_reset_prefix_cache() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq("a", list(range(9)))
    prefill(bm, a)
    bm.free(a)
    running = make_seq("r", [5] * 9)
    prefill(bm, running)
    assert bm.num_cached_blocks == 4
    used = bm.num_used_blocks
    assert bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0
    assert bm.match_prefix(make_seq("p", a.token_ids)) == 0
    assert bm.match_prefix(make_seq("q", running.token_ids)) == 0
    assert bm.num_used_blocks == used
    # The running sequence keeps working and caching its new blocks.
    running.append_token(1)
    running.append_token(2)
    assert bm.allocate(running, 2)
    running.num_computed_tokens = 11
    bm.commit(running)
    bm.free(running)
    assert bm.num_free_blocks == 8
    assert bm.match_prefix(make_seq("q2", running.token_ids)) == 0  # parent block 0 is gone


def test_counters() -> None:
    bm = BlockManager(num_blocks=32, block_size=BS)
    cached: list[list[int]] = []
    prompts = [list(range(10)), list(range(10)), list(range(6)) + [9, 9, 9], list(range(12)), [3, 3]]
    expected_q = expected_h = 0
    for i, p in enumerate(prompts):
        s = make_seq(str(i), p)
        hits = prefill(bm, s)
        assert hits == naive_hits(cached, p)
        assert s.num_cached_prompt_tokens == hits
        expected_q += len(p)
        expected_h += hits
        cached.append(p)
    assert (bm.prefix_queries, bm.prefix_hits) == (expected_q, expected_h)


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = make_seq("a", list(range(9)))
    prefill(bm, a)
    assert a.block_hashes == [] and bm.num_cached_blocks == 0
    bm.free(a)
    assert bm.match_prefix(make_seq("b", list(range(9)))) == 0
    assert (bm.prefix_queries, bm.prefix_hits) == (0, 0)
    assert bm.num_free_blocks == 8


def test_block_token_counts_and_double_free() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    s = make_seq("s", list(range(6)))
    assert bm.allocate(s, 3)
    s.num_computed_tokens = 3
    bm.commit(s)
    assert [bm.blocks[b].num_tokens for b in s.block_table] == [3]
    assert bm.allocate(s, 3)
    s.num_computed_tokens = 6
    bm.commit(s)
    assert [bm.blocks[b].num_tokens for b in s.block_table] == [4, 2]
    table = list(s.block_table)
    bm.free(s)
    s.block_table = table
    with pytest.raises(RuntimeError, match=r"^block \d+ of group '\w+' freed more often than allocated$"):
        bm.free(s)


# -- found by mutation testing (docs/testing.md) ------------------------------------------------


def test_constructor_bounds() -> None:
    bm = BlockManager(num_blocks=1, block_size=1)  # the smallest pool is valid
    assert bm.num_free_blocks == 1
    with pytest.raises(ValueError, match="^num_blocks must be >= 1$"):
        BlockManager(num_blocks=0, block_size=4)
    with pytest.raises(ValueError, match="^block_size must be >= 1$"):
        BlockManager(num_blocks=4, block_size=0)


def test_zero_new_tokens_takes_only_the_hits_and_negative_is_refused() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    prefill(bm, make_seq("a", list(range(9))))
    s = make_seq("s", list(range(9)))
    with pytest.raises(ValueError, match="^num_new_tokens must be >= 0$"):
        bm.allocate(s, -1)
    assert s.block_table == [] and s.num_computed_tokens == 0
    assert bm.allocate(s, 0)  # only the prefix hits: two full blocks
    assert s.num_computed_tokens == 8 and len(s.block_table) == 2
    assert bm.allocate(s, 0) and len(s.block_table) == 2  # nothing more to cover


def test_lookup_stops_at_the_first_missing_block() -> None:
    """A later block matching after a miss must not hit: its parent differs, and the hit list
    has to be a contiguous prefix of the block table."""
    bm = BlockManager(num_blocks=16, block_size=BS)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    prefill(bm, make_seq("ab", a + b + [0]))
    assert bm.match_prefix(make_seq("axb", a + [9, 9, 9, 9] + b + [0])) == 4
    s = make_seq("axb2", a + [9, 9, 9, 9] + b + [0])
    assert prefill(bm, s) == 4


def test_reset_clears_every_hash_and_the_pool_stays_usable() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS)
    held = make_seq("held", list(range(9)))
    prefill(bm, held)  # 2 cached blocks in use (+1 partial)
    idle = make_seq("idle", [7] * 5)
    prefill(bm, idle)
    bm.free(idle)  # 1 cached block evictable (+1 partial, back on the free list)
    assert bm.reset_prefix_cache()
    assert all(blk.hash is None for blk in bm.blocks)
    bm.free(held)  # blocks without a hash go back to the free list, not the evictable set
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 0
    for round_ in range(2):  # fill and empty the whole pool twice (eviction path included)
        seqs = [make_seq(f"r{round_}{i}", [round_ * 10 + i] * 4) for i in range(6)]
        for q in seqs:
            prefill(bm, q)
        assert bm.num_free_blocks == 0
        for q in seqs:
            bm.free(q)
    assert bm.num_free_blocks == 6
