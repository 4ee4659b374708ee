"""Full-attention groups: every token's K/V is kept until the request ends.

A query reads every block of its table, so a prefix hit of k blocks needs all of blocks
0..k-1 cached in this group: the first block missing from the cache ends every longer hit.
"""

from __future__ import annotations

from tandem.engine_service.cache.paged_manager import PagedGroupManager


class ContiguousScan:
    """A lookup in a group whose hit needs every leading block cached."""

    def __init__(self, cached: dict[int, int]) -> None:
        self._cached = cached

    def feed(self, index: int, block_hash: int) -> bool:
        return block_hash in self._cached

    def valid(self, num_blocks: int, block_hash: int) -> bool:
        return True  # every block fed so far is cached, or the scan stopped


class FullAttentionManager(PagedGroupManager):
    """Block ids of a full-attention group (`FullAttentionSpec`): blocks are held to the end."""

    kind = "full_attention"

    def hit_scan(self, state_loaded: bool) -> ContiguousScan:
        return ContiguousScan(self.pool.cached)
