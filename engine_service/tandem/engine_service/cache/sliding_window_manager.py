"""Sliding-window groups: only the last `window` tokens are read, so blocks behind the window
go back to the pool during the request.

A query at position p reads keys `p - window + 1 .. p`. Once a request's next query sits at
position c, blocks ending before `c - window + 1` are never read again: `trim` gives them back
and leaves `NULL_BLOCK` in their table entries. A model whose every layer is windowed thus holds
about `window / block_size + 1` blocks per request, however long it runs.

A prefix hit of k blocks needs only the blocks the first query after it can see
(`first_needed_block(k * block_size)` .. k - 1): blocks freed for being outside the window, and
evicted since, are not needed, and a hit never reuses a block whose content was evicted (its
hash is gone).
"""

from __future__ import annotations

from collections.abc import Callable

from tandem.engine_service.cache.block_pool import PagedGroup
from tandem.engine_service.cache.group_manager import NULL_BLOCK, Hit
from tandem.engine_service.cache.paged_manager import PagedGroupManager
from tandem.engine_service.sequence import Sequence


def first_needed_block(next_position: int, window: int | None, block_size: int) -> int:
    """Index of the first block a query at `next_position` (or later) reads in a group with
    `window` (None: full attention, so block 0)."""
    if window is None:
        return 0
    return max(0, next_position - window + 1) // block_size


class WindowScan:
    """A lookup in a windowed group: tracks where the current run of cached blocks starts; a hit
    of k blocks holds when that run reaches back to the first block its next query reads."""

    def __init__(self, cached: dict[int, int], window: int, block_size: int) -> None:
        self._cached = cached
        self._window = window
        self._block_size = block_size
        self._run_start = 0

    def feed(self, index: int, block_hash: int) -> bool:
        if block_hash not in self._cached:
            self._run_start = index + 1
        return True  # a later block may still start a long enough run

    def valid(self, num_blocks: int, block_hash: int) -> bool:
        return self._run_start <= first_needed_block(num_blocks * self._block_size, self._window, self._block_size)


class SlidingWindowManager(PagedGroupManager):
    """Block ids of a sliding-window group (`SlidingWindowSpec`)."""

    kind = "sliding_window"

    def __init__(self, group: PagedGroup, index: int, block_size: int,
                 on_evict: Callable[[int], None] | None = None) -> None:
        if group.sliding_window is None or group.sliding_window < 1:
            raise ValueError(f"sliding-window group {group.name!r} needs a window >= 1")
        super().__init__(group, index, block_size, on_evict)
        self.window: int = group.sliding_window

    def first_live_block(self, position: int) -> int:
        return first_needed_block(position, self.window, self.block_size)

    def hit_scan(self, state_loaded: bool) -> WindowScan:
        return WindowScan(self.pool.cached, self.window, self.block_size)

    def _behind_window(self, seq: Sequence) -> list[int]:
        """Table indices of live blocks behind the window of `seq`'s next query (newest first)."""
        table = seq.block_tables[self.index]
        out = []
        i = min(self.first_live_block(seq.num_computed_tokens), len(table)) - 1
        while i >= 0 and table[i] != NULL_BLOCK:
            out.append(i)
            i -= 1
        return out

    def room(self, seq: Sequence, hit: Hit | None) -> int:
        """Free blocks plus, for an admitted request, those `trim` would give back to the pool."""
        room = self.pool.num_free
        if hit is None:
            table = seq.block_tables[self.index]
            room += sum(1 for i in self._behind_window(seq) if self.pool.blocks[table[i]].ref_count == 1)
        return room

    def trim(self, seq: Sequence) -> None:
        table = seq.block_tables[self.index]
        for i in self._behind_window(seq):
            self.pool.release(table[i])
            table[i] = NULL_BLOCK
