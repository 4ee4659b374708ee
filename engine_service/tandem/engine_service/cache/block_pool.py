"""One paged cache group's physical blocks: ids, ref counts, free list, LRU evictable set, hashes.

Each paged group manager (`paged_manager.py`) owns one `BlockPool` and decides what to take and
release; a pool only keeps the books of its own blocks.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Block:
    """One physical KV block: who references it and, once full and written, its content hash."""

    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set only while registered in the prefix cache
    num_tokens: int = 0  # token slots whose K/V are written


@dataclass(frozen=True)
class PagedGroup:
    """A paged cache group as the block manager sees it: a pool size, an optional window, and
    the cache kind whose manager keeps its books (`CacheSpec.kind`; left empty, `sliding_window`
    when a window is set, else `full_attention`)."""

    name: str
    num_blocks: int
    sliding_window: int | None = None
    kind: str = ""

    def __post_init__(self) -> None:
        if not self.kind:
            kind = "sliding_window" if self.sliding_window is not None else "full_attention"
            object.__setattr__(self, "kind", kind)


class BlockPool:
    """One paged group's physical blocks: free list, LRU evictable set and hash -> block map.

    Free capacity is the free list (never cached or cleared blocks, used first) plus the
    evictable set (cached blocks nobody references, evicted least recently used first).
    `on_evict(hash)`, when given, hears of every hash an eviction removes (state checkpoints
    belong to their block and go with it).
    """

    def __init__(self, group: PagedGroup, on_evict: Callable[[int], None] | None = None) -> None:
        if group.num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.group = group
        self.num_blocks = group.num_blocks
        self.window = group.sliding_window
        self.blocks: list[Block] = [Block(i) for i in range(group.num_blocks)]
        self.free_ids: deque[int] = deque(range(group.num_blocks))
        # Unreferenced cached blocks in LRU order (oldest first). Values are unused.
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.on_evict = on_evict

    @property
    def num_free(self) -> int:
        return len(self.free_ids) + len(self.evictable)

    def take_hit(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.evictable[block_id]
        block.ref_count += 1

    def take_free(self) -> int:
        if self.free_ids:
            block_id = self.free_ids.popleft()
        else:
            block_id, _ = self.evictable.popitem(last=False)
            block = self.blocks[block_id]
            assert block.hash is not None
            del self.cached[block.hash]
            if self.on_evict is not None:
                self.on_evict(block.hash)
            block.hash = None
        block = self.blocks[block_id]
        block.ref_count = 1
        block.num_tokens = 0
        return block_id

    def release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"block {block_id} of group {self.group.name!r} freed more often than allocated")
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is not None:
                self.evictable[block_id] = None
            else:
                block.num_tokens = 0
                self.free_ids.append(block_id)

    def register(self, h: int, block_id: int) -> None:
        """Cache `block_id` under `h` unless another block already holds that content."""
        if h not in self.cached:
            self.cached[h] = block_id
            self.blocks[block_id].hash = h

    def reset(self) -> None:
        for block_id in self.evictable:
            block = self.blocks[block_id]
            block.hash = None
            block.num_tokens = 0
            self.free_ids.append(block_id)
        self.evictable.clear()
        for block_id in self.cached.values():
            self.blocks[block_id].hash = None
        self.cached.clear()
