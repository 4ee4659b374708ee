"""Paged KV cache bookkeeping: physical block ownership, ref counts and the prefix cache.

Only ids and counters live here; the K/V tensors belong to the model runner, which addresses
them through `seq.block_table` (the slot of token position p is
`block_table[p // block_size] * block_size + p % block_size`).

Prefix caching: when a block is full and its K/V are written (`commit`), it is registered under a
chained hash of (hash of the previous block, token ids of this block), so equal block contents
after different prefixes never match. A released block keeps its hash and stays reusable until
it is evicted (least recently used first) to make room for a new allocation.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence as SeqOf
from dataclasses import dataclass

from tandem.engine_service.sequence import Sequence

# Distinguishes the first block of a sequence (no parent) from a block whose parent hash
# happens to have any particular value.
_ROOT_TAG = b"\x00"
_CHILD_TAG = b"\x01"


def hash_block(parent_hash: int | None, token_ids: SeqOf[int]) -> int:
    """Chained content hash of one full block: 64 bits of BLAKE2b over the parent and the ids.

    Stable across processes (unlike `hash()`), so hashes may be logged or exchanged.
    """
    h = hashlib.blake2b(digest_size=8)
    if parent_hash is None:
        h.update(_ROOT_TAG)
    else:
        h.update(_CHILD_TAG + parent_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


@dataclass
class Block:
    """One physical KV block: who references it and, once full and written, its content hash."""

    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set only while registered in the prefix cache
    num_tokens: int = 0  # token slots whose K/V are written


@dataclass
class _Plan:
    """What `allocate` would do, computed without side effects."""

    hit_hashes: list[int]
    hit_ids: list[int]
    num_new_blocks: int
    num_revived: int  # prefix hits that currently sit unreferenced in the evictable set

    @property
    def blocks_taken_from_pool(self) -> int:
        return self.num_new_blocks + self.num_revived


class BlockManager:
    """Hands out paged KV blocks to sequences and shares full, written blocks by content.

    Scheduler protocol (how prefix hits and the token budget fit together):

    1. `match_prefix(seq)` (no side effects) tells how many leading tokens a sequence with an
       empty block table would get from the cache; the scheduler computes the chunk size as
       `min(seq.num_tokens - hits, budget)`.
    2. `allocate(seq, chunk)` takes exactly those hits (same answer: nothing changes in between)
       and sets `seq.num_computed_tokens = hits`, then adds blocks so the table covers
       `hits + chunk` tokens. Later calls (block table not empty) only add blocks.
    3. After the model wrote K/V and the caller advanced `seq.num_computed_tokens`,
       `commit(seq)` registers the newly full blocks.
    4. `free(seq)` releases everything.

    Free capacity is the free list (never cached or cleared blocks, used first) plus the
    evictable set (cached blocks nobody references, evicted least recently used first).
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks: list[Block] = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        # Unreferenced cached blocks in LRU order (oldest first). Values are unused.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[int, int] = {}  # block hash -> block id
        self.prefix_queries = 0  # tokens looked up in the prefix cache at admission
        self.prefix_hits = 0  # of those, tokens served from the cache

    # -- capacity ----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: never-cached ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    def get_num_free_blocks(self) -> int:
        return self.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (in use or evictable)."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def slot(self, seq: Sequence, pos: int) -> int:
        """Flat cache slot of token position `pos` of `seq`."""
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    # -- prefix lookup -----------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> int:
        """Leading tokens of `seq` already in the cache (full blocks, never all of its tokens).

        At least the last token is always left to compute so the model produces its logits. For
        a fresh sequence that is the last prompt token; for a preempted one being recomputed,
        the prompt and the output tokens before the last one are eligible.
        """
        hashes, _ = self._lookup(seq)
        return len(hashes) * self.block_size

    def _lookup(self, seq: Sequence) -> tuple[list[int], list[int]]:
        if not self.enable_prefix_caching:
            return [], []
        tokens = seq.token_ids
        bs = self.block_size
        hashes: list[int] = []
        ids: list[int] = []
        parent: int | None = None
        for i in range((len(tokens) - 1) // bs):
            h = hash_block(parent, tokens[i * bs : (i + 1) * bs])
            block_id = self._cached.get(h)
            if block_id is None:
                break
            hashes.append(h)
            ids.append(block_id)
            parent = h
        return hashes, ids

    # -- allocation --------------------------------------------------------------------------
    def _plan(self, seq: Sequence, num_new_tokens: int) -> _Plan:
        if num_new_tokens < 0:
            raise ValueError("num_new_tokens must be >= 0")
        if seq.block_table:
            hit_hashes: list[int] = []
            hit_ids: list[int] = []
            held = len(seq.block_table)
            num_tokens = seq.num_computed_tokens + num_new_tokens
        else:
            hit_hashes, hit_ids = self._lookup(seq)
            held = len(hit_ids)
            num_tokens = held * self.block_size + num_new_tokens
        needed = -(-num_tokens // self.block_size)
        revived = sum(1 for b in hit_ids if self.blocks[b].ref_count == 0)
        return _Plan(hit_hashes, hit_ids, max(0, needed - held), revived)

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """New blocks `allocate(seq, num_new_tokens)` would add (prefix hits not included)."""
        return self._plan(seq, num_new_tokens).num_new_blocks

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether `allocate(seq, num_new_tokens)` would succeed; changes nothing."""
        return self._plan(seq, num_new_tokens).blocks_taken_from_pool <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Cover `num_computed_tokens + num_new_tokens` tokens with blocks (see class docstring).

        With an empty block table, prefix hits are taken first and `num_computed_tokens` is
        reset to the hit count. Returns False, changing nothing, if the pool is too small.
        """
        table = seq.block_table
        if table and num_new_tokens >= 0 and seq.num_computed_tokens + num_new_tokens <= len(table) * self.block_size:
            return True  # the common decode step: the last block still has room
        plan = self._plan(seq, num_new_tokens)
        # Checking up front makes failure side-effect free: nothing to roll back.
        if plan.blocks_taken_from_pool > self.num_free_blocks:
            return False
        if not seq.block_table:
            self._take_hits(seq, plan)
        for _ in range(plan.num_new_blocks):
            seq.block_table.append(self._take_free_block())
        return True

    def _take_hits(self, seq: Sequence, plan: _Plan) -> None:
        for block_id in plan.hit_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._evictable[block_id]
            block.ref_count += 1
        num_hit_tokens = len(plan.hit_ids) * self.block_size
        seq.block_table = list(plan.hit_ids)
        seq.block_hashes = list(plan.hit_hashes)
        seq.num_computed_tokens = num_hit_tokens
        if seq.num_cached_prompt_tokens is None:
            seq.num_cached_prompt_tokens = min(num_hit_tokens, seq.num_prompt_tokens)
        if self.enable_prefix_caching:
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += num_hit_tokens

    def _take_free_block(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)
            block = self.blocks[block_id]
            assert block.hash is not None
            del self._cached[block.hash]
            block.hash = None
        block = self.blocks[block_id]
        block.ref_count = 1
        block.num_tokens = 0
        return block_id

    # -- after a step ------------------------------------------------------------------------
    def commit(self, seq: Sequence) -> None:
        """Record written K/V up to `seq.num_computed_tokens`; cache the newly full blocks.

        If another block already holds the same content (two sequences computed the same prefix
        concurrently), that mapping wins and this block stays private and unhashed.
        """
        bs = self.block_size
        # Computed tokens whose ids are still pending (overlapped scheduling) wait for a later
        # commit: a block is hashed from its token ids.
        computed = min(seq.num_computed_tokens, seq.num_known_tokens, len(seq.block_table) * bs)
        # Blocks fill in order, so walking back from the last written block until a full one
        # touches only what this step wrote.
        for i in range(-(-computed // bs) - 1, -1, -1):
            block = self.blocks[seq.block_table[i]]
            if block.num_tokens == bs:
                break
            block.num_tokens = min(bs, computed - i * bs)
        if not self.enable_prefix_caching:
            return
        first = len(seq.block_hashes)
        num_full = computed // bs
        if num_full <= first:
            return
        tokens = seq.token_ids
        for i in range(first, num_full):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            h = hash_block(parent, tokens[i * bs : (i + 1) * bs])
            seq.block_hashes.append(h)
            block_id = seq.block_table[i]
            if h not in self._cached:
                self._cached[h] = block_id
                self.blocks[block_id].hash = h

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq` and clear its block table and hashes.

        Released in reverse order so that, among this sequence's cached blocks, the tail ones
        are evicted first: a head block is useful to more future prompts than a tail block,
        and a tail block without its head can never be hit.
        """
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is not None:
                    self._evictable[block_id] = None
                else:
                    block.num_tokens = 0
                    self._free.append(block_id)
        seq.block_table = []
        seq.block_hashes = []

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; unreferenced ones go back to the free list.

        Blocks in use keep their contents and owners but lose their hash, so no later request
        can hit K/V computed before the reset (e.g. with older weights). Always succeeds.
        """
        for block_id in self._evictable:
            block = self.blocks[block_id]
            block.hash = None
            block.num_tokens = 0
            self._free.append(block_id)
        self._evictable.clear()
        for block_id in self._cached.values():
            self.blocks[block_id].hash = None
        self._cached.clear()
        return True
