"""What every paged cache kind shares: one `BlockPool`, one block table per request, growth by
whole blocks, content-addressed sharing of full blocks.

A request's table in paged group `index` is `seq.block_tables[index]`; entry i covers token
positions `i * block_size .. (i + 1) * block_size - 1` (all of a request's tables have the same
length). A kind decides which leading entries a query at a position still reads
(`first_live_block`; entries before it may be `NULL_BLOCK`) and how a prefix lookup goes
(`hit_scan`); the rest is here.
"""

from __future__ import annotations

from collections.abc import Callable

from tandem.engine_service.cache.block_pool import BlockPool, PagedGroup
from tandem.engine_service.cache.group_manager import NULL_BLOCK, GroupManager, Hit
from tandem.engine_service.sequence import Sequence


class PagedGroupManager(GroupManager):
    """Block ids of one paged cache group for every request (subclassed once per paged kind)."""

    paged = True

    def __init__(self, group: PagedGroup, index: int, block_size: int,
                 on_evict: Callable[[int], None] | None = None) -> None:
        self.group = group
        self.index = index  # this group's table in `seq.block_tables`
        self.block_size = block_size
        self.pool = BlockPool(group, on_evict)

    def first_live_block(self, position: int) -> int:
        """First table entry a query at `position` (or later) reads; 0 when it reads them all."""
        return 0

    # -- allocation --------------------------------------------------------------------------
    def num_new_blocks(self, seq: Sequence, num_new_tokens: int, hit: Hit | None = None) -> int:
        """Blocks to add so the table covers `num_new_tokens` more tokens (past `hit`'s blocks
        when admitting with `hit`)."""
        if hit is None:
            computed, held = seq.num_computed_tokens, len(seq.block_tables[self.index])
        else:
            computed, held = hit.blocks * self.block_size, hit.blocks
        return max(0, -(-(computed + num_new_tokens) // self.block_size) - held)

    def room(self, seq: Sequence, hit: Hit | None) -> int:
        """Blocks an allocation for `seq` may take: the pool's free and evictable ones."""
        return self.pool.num_free

    def fits(self, seq: Sequence, num_new_tokens: int, hit: Hit | None) -> bool:
        taken = self.num_new_blocks(seq, num_new_tokens, hit)
        if hit is not None:
            # Hit blocks nobody references sit in the evictable set: taking them uses room too.
            pool = self.pool
            first = self.first_live_block(hit.blocks * self.block_size)
            taken += sum(1 for h in hit.hashes[first:] if pool.blocks[pool.cached[h]].ref_count == 0)
        return taken <= self.room(seq, hit)

    def take_hit(self, seq: Sequence, hit: Hit, restore: bool) -> None:
        pool = self.pool
        first = self.first_live_block(hit.blocks * self.block_size)
        table = [NULL_BLOCK] * first
        for h in hit.hashes[first:]:
            block_id = pool.cached[h]
            pool.take_hit(block_id)
            table.append(block_id)
        seq.block_tables[self.index] = table

    def grow(self, seq: Sequence, num_new_tokens: int, state_loaded: bool) -> None:
        table = seq.block_tables[self.index]
        for _ in range(self.num_new_blocks(seq, num_new_tokens)):
            table.append(self.pool.take_free())

    def give_back_before(self, seq: Sequence, first_kept: int) -> None:
        """Release the blocks of table entries before `first_kept`; they become `NULL_BLOCK`."""
        table = seq.block_tables[self.index]
        for i in range(min(first_kept, len(table))):
            if table[i] != NULL_BLOCK:
                self.pool.release(table[i])
                table[i] = NULL_BLOCK

    # -- after a step ------------------------------------------------------------------------
    def commit(self, seq: Sequence, computed: int) -> None:
        bs = self.block_size
        table = seq.block_tables[self.index]
        # Blocks fill in order, so walking back from the last written block until a full (or
        # given back) one touches only what this step wrote.
        for i in range(-(-computed // bs) - 1, -1, -1):
            if table[i] == NULL_BLOCK:
                break
            block = self.pool.blocks[table[i]]
            if block.num_tokens == bs:
                break
            block.num_tokens = min(bs, computed - i * bs)

    def cache_blocks(self, seq: Sequence, first: int, end: int) -> None:
        """Register the hashed blocks this group still holds; one given back (`NULL_BLOCK`) was
        hashed only because the chain needs it."""
        table = seq.block_tables[self.index]
        for i in range(first, end):
            if table[i] != NULL_BLOCK:
                self.pool.register(seq.block_hashes[i], table[i])

    def free(self, seq: Sequence) -> None:
        """Release in reverse order so that, among this sequence's cached blocks, the tail ones
        are evicted first: a head block is useful to more future prompts than a tail block, and
        a tail block without its head can never be hit."""
        if self.index >= len(seq.block_tables):
            return  # never admitted: a fresh sequence has the primary table only
        for block_id in reversed(seq.block_tables[self.index]):
            if block_id != NULL_BLOCK:
                self.pool.release(block_id)

    def reset_prefix_cache(self) -> None:
        self.pool.reset()

    def usage(self) -> dict[str, dict[str, int]]:
        return {self.group.name: {"total": self.pool.num_blocks, "used": self.pool.num_blocks - self.pool.num_free}}
