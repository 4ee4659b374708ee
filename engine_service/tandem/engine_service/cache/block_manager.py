"""Paged KV cache bookkeeping: block ids per cache group, ref counts, prefix cache, state slots.

Only ids and counters live here; the tensors belong to the model runner. A request holds one
block table per paged cache group (`seq.block_tables`, all of equal length: entry i covers
token positions `i * block_size .. (i + 1) * block_size - 1`), and, when the model has state
groups, one state slot (`seq.state_slot`). The slot of token position p in group g is
`block_tables[g][p // block_size] * block_size + p % block_size`.

Sliding-window groups free during the request: once the request's next query sits at position
c, blocks ending before `c - window + 1` are never read again, so `allocate` gives them back
and leaves `NULL_BLOCK` in their table entries. A model whose every layer is windowed thus holds
about `window / block_size + 1` blocks per request, however long it runs.

Prefix caching: when a block is full and its K/V are written (`commit`), it is registered under a
chained hash of (hash of the previous block, token ids of this block), so equal block contents
after different prefixes never match. A released block keeps its hash and stays reusable until
it is evicted (least recently used first) to make room for a new allocation. Each group has its
own pool and its own hash -> block map; a hit of k blocks must be valid in every group:
a full-attention group needs all of blocks 0..k-1 cached, a sliding-window group only those the
first query after the hit can see (blocks freed for being outside the window, and evicted since,
are not needed, and a hit never reuses a block whose content was evicted: its hash is gone).

State checkpoints (models with state groups, e.g. Gated DeltaNet layers): K/V blocks alone cannot
resume a prefix, because the recurrent state after it is needed too. A prefill chunk that ends on
a checkpoint position `p` (a multiple of `checkpoint_stride`, itself a multiple of the block size,
within the tokens known at admission) saves the request's state slot into a checkpoint slot after
the forward (`state_copies_after`); once the block ending at `p` is hashed (`commit`), the
checkpoint is registered under that block's hash and belongs to it (evicted with it, or LRU when
checkpoint slots run out). A hit is then truncated to the last position with a checkpoint, and
admission restores that checkpoint into the request's slot before the forward
(`state_copies_before`). The scheduler cuts prefill chunks at checkpoint positions
(`checkpoint_chunk`). Without checkpoint slots, a model with state groups gets no prefix hits.

A request whose state comes from elsewhere (a disaggregated decode leg pulls the producer's state
after its whole prompt) is admitted with `state_loaded=True`: its hit needs the K/V blocks only,
no checkpoint is restored into its slot (the pulled state covers more than any local one), and
none is saved by that admission's chunk (the slot holds nothing until the pull is written).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence as SeqOf
from dataclasses import dataclass, field

from tandem.engine_service.cache.block_pool import Block, BlockPool, PagedGroup
from tandem.engine_service.sequence import Sequence
from tandem.engine_service.cache.state_pool import CheckpointSlots, StateSlotPool

# Distinguishes the first block of a sequence (no parent) from a block whose parent hash
# happens to have any particular value.
_ROOT_TAG = b"\x00"
_CHILD_TAG = b"\x01"

# A table entry whose block was given back (sliding-window groups only). Input building maps it
# to block 0; kernels and the reference never read positions before the window.
NULL_BLOCK = -1


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


def first_needed_block(next_position: int, window: int | None, block_size: int) -> int:
    """Index of the first block a query at `next_position` (or later) reads in a group with
    `window` (None: full attention, so block 0)."""
    if window is None:
        return 0
    return max(0, next_position - window + 1) // block_size


@dataclass
class _Plan:
    """What `allocate` would do, computed without side effects."""

    hit_blocks: int  # prefix hits (admission only)
    hit_hashes: list[int]
    new_blocks: list[int] = field(default_factory=list)  # per group
    taken: list[int] = field(default_factory=list)  # per group: new blocks + revived hits
    freed: list[int] = field(default_factory=list)  # per group: blocks the window trim gives back
    needs_slot: bool = False
    kv_hit_blocks: int = 0  # the hit K/V alone would give (before truncation to a checkpoint)


@dataclass
class _Checkpointing:
    """One admitted request's checkpoint books: positions up to `limit` may be saved; `pending`
    holds (position, checkpoint slot, cache generation) of saves not registered yet."""

    limit: int
    pending: list[tuple[int, int, int]] = field(default_factory=list)


class BlockManager:
    """Hands out block ids per paged cache group and state slots; shares full, written blocks by content.

    Scheduler protocol (how prefix hits and the token budget fit together):

    1. `match_prefix(seq)` (no side effects) tells how many leading tokens a sequence with empty
       block tables would get from the cache; the scheduler computes the chunk size as
       `min(seq.num_tokens - hits, budget)`.
    2. `allocate(seq, chunk)` takes exactly those hits (same answer: nothing changes in between),
       a state slot when the model has state groups, and sets `seq.num_computed_tokens = hits`,
       then adds blocks so every table covers `hits + chunk` tokens. Later calls (tables not
       empty) first free sliding-window blocks behind the window, then only add blocks.
       Admission needs blocks in every group and a slot; failing either changes nothing.
    3. After the model wrote K/V and the caller advanced `seq.num_computed_tokens`,
       `commit(seq)` registers the newly full blocks.
    4. `free(seq)` releases everything, the state slot included (finish, abort, error and
       preemption all end here).

    With state checkpoints (see the module docstring) the scheduler also shortens chunks with
    `checkpoint_chunk`, and takes each step's slot -> slot copies with `pop_state_copies`
    (restores queued by `allocate` at admission, saves by `allocate` of a chunk ending on a
    checkpoint position).

    `num_blocks`, `blocks`, `num_free_blocks` and `slot` describe the primary (first) group;
    `usage` is the fullest group's.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        *,
        groups: SeqOf[PagedGroup] | None = None,
        num_state_slots: int = 0,
        num_checkpoint_slots: int = 0,
        checkpoint_stride: int = 0,
    ) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        if groups is None:
            groups = [PagedGroup("attention", num_blocks)]
        if not groups:
            raise ValueError("a block manager needs at least one paged group")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_groups = len(groups)
        self.state_slots = StateSlotPool(num_state_slots, num_checkpoint_slots) if num_state_slots else None
        # Checkpoints only make sense for a model with state that caches prefixes.
        self.checkpoints: CheckpointSlots | None = None
        self.checkpoint_stride = 0
        if num_state_slots and num_checkpoint_slots and enable_prefix_caching:
            if checkpoint_stride < block_size or checkpoint_stride % block_size:
                raise ValueError(f"checkpoint_stride ({checkpoint_stride}) must be a positive multiple of "
                                 f"block_size ({block_size})")
            self.checkpoints = CheckpointSlots(num_state_slots, num_checkpoint_slots)
            self.checkpoint_stride = checkpoint_stride
        on_evict = self._on_evict if self.checkpoints is not None else None
        self.pools = [BlockPool(g, on_evict) for g in groups]
        self._windowed = [i for i, p in enumerate(self.pools) if p.window is not None]
        self._checkpointing: dict[Sequence, _Checkpointing] = {}
        self._generation = 0  # bumped by reset_prefix_cache: older pending saves are not registered
        # This step's slot -> slot copies, with the request each belongs to: (src, dst, seq).
        self._copies_before: list[tuple[int, int, Sequence]] = []
        self._copies_after: list[tuple[int, int, Sequence]] = []
        self.reset_counters()

    def reset_counters(self) -> None:
        """Zero the prefix-cache totals (and the checkpoints'): what a warm-up leaves in them."""
        self.prefix_queries = 0  # tokens looked up in the prefix cache at admission
        self.prefix_hits = 0  # of those, tokens served from the cache
        # Tokens whose K/V were cached at admission (hits before truncation to a checkpoint; equal
        # to prefix_hits for a model without state groups).
        self.prefix_kv_hits = 0
        if self.checkpoints is not None:
            self.checkpoints.reset_counters()

    @classmethod
    def from_plan(cls, plan, enable_prefix_caching: bool = True, checkpoint_stride: int = 0) -> "BlockManager":
        """One pool per paged group of a `memory.MemoryPlan`, its state slots and checkpoint slots."""
        groups = [PagedGroup(g.name, g.num_blocks, g.sliding_window) for g in plan.paged_groups]
        return cls(groups[0].num_blocks, plan.block_size, enable_prefix_caching,
                   groups=groups, num_state_slots=plan.num_state_slots,
                   num_checkpoint_slots=getattr(plan, "num_checkpoint_slots", 0),
                   checkpoint_stride=checkpoint_stride)

    # -- capacity ----------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pools[0].num_blocks

    @property
    def blocks(self) -> list[Block]:
        return self.pools[0].blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take in the primary group: never-cached plus evictable ones."""
        return self.pools[0].num_free

    def get_num_free_blocks(self) -> int:
        return self.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the primary group's prefix cache (in use or evictable)."""
        return len(self.pools[0].cached)

    @property
    def usage(self) -> float:
        return max((p.num_blocks - p.num_free) / p.num_blocks for p in self.pools)

    def group_usage(self) -> dict[str, dict[str, int]]:
        """Per paged group (and the state slots): total and used."""
        out = {p.group.name: {"total": p.num_blocks, "used": p.num_blocks - p.num_free} for p in self.pools}
        if self.state_slots is not None:
            out["state_slots"] = {"total": self.state_slots.num_slots, "used": self.state_slots.num_used}
        if self.checkpoints is not None:
            # "used": registered (reusable, like cached blocks) or pending (owned by a request).
            ck = self.checkpoints
            out["state_checkpoints"] = {"total": ck.num_slots, "used": ck.num_registered + ck.num_pending,
                                        "pending": ck.num_pending}
        return out

    def slot(self, seq: Sequence, pos: int, group: int = 0) -> int:
        """Flat cache slot of token position `pos` of `seq` in paged group `group`."""
        return seq.block_tables[group][pos // self.block_size] * self.block_size + pos % self.block_size

    # -- prefix lookup -----------------------------------------------------------------------
    def match_prefix(self, seq: Sequence, state_loaded: bool = False) -> int:
        """Leading tokens of `seq` already in the cache (full blocks, never all of its tokens).

        At least the last token is always left to compute so the model produces its logits. For
        a fresh sequence that is the last prompt token; for a preempted one being recomputed,
        the prompt and the output tokens before the last one are eligible. `state_loaded`: the
        request's state comes from elsewhere, so K/V blocks alone make a hit (module docstring).
        """
        hit_blocks, _, _ = self._lookup(seq, state_loaded)
        return hit_blocks * self.block_size

    def _lookup(self, seq: Sequence, state_loaded: bool = False) -> tuple[int, list[int], int]:
        """The largest hit (in blocks) valid in every group (and, with state groups, ending on a
        checkpoint unless `state_loaded`), the hashes of its blocks, and the hit the K/V blocks
        alone would give."""
        if not self.enable_prefix_caching:
            return 0, [], 0
        tokens = seq.token_ids
        bs = self.block_size
        hashes: list[int] = []
        parent: int | None = None
        # Per windowed group: first block of the current run of cached blocks.
        run_start = {g: 0 for g in self._windowed}
        best = kv_best = 0
        has_state = self.state_slots is not None
        checkpoints = self.checkpoints
        for i in range((len(tokens) - 1) // bs):
            h = hash_block(parent, tokens[i * bs : (i + 1) * bs])
            hashes.append(h)
            parent = h
            broken = False
            for g, pool in enumerate(self.pools):
                if h not in pool.cached:
                    if pool.window is None:
                        broken = True  # a full group needs every block: no longer hit exists
                        break
                    run_start[g] = i + 1
            if broken:
                break
            k = i + 1
            if all(run_start[g] <= first_needed_block(k * bs, self.pools[g].window, bs) for g in self._windowed):
                kv_best = k
                # State groups: K/V resume a prefix only together with the state after it.
                if not has_state or state_loaded or (checkpoints is not None and h in checkpoints):
                    best = k
        return best, hashes[:best], kv_best

    # -- allocation --------------------------------------------------------------------------
    def _admitted(self, seq: Sequence) -> bool:
        return bool(seq.block_tables[0])

    def _trimmable(self, seq: Sequence, g: int) -> list[int]:
        """Table indices of group g's live blocks behind the window (newest first)."""
        pool = self.pools[g]
        table = seq.block_tables[g]
        out = []
        i = min(first_needed_block(seq.num_computed_tokens, pool.window, self.block_size), len(table)) - 1
        while i >= 0 and table[i] != NULL_BLOCK:
            out.append(i)
            i -= 1
        return out

    def _plan(self, seq: Sequence, num_new_tokens: int, state_loaded: bool = False) -> _Plan:
        if num_new_tokens < 0:
            raise ValueError("num_new_tokens must be >= 0")
        bs = self.block_size
        if self._admitted(seq):
            plan = _Plan(0, [])
            num_tokens = seq.num_computed_tokens + num_new_tokens
            needed = -(-num_tokens // bs)
            for g, pool in enumerate(self.pools):
                table = seq.block_tables[g]
                new = max(0, needed - len(table))
                freed = 0
                if pool.window is not None:
                    freed = sum(1 for i in self._trimmable(seq, g) if pool.blocks[table[i]].ref_count == 1)
                plan.new_blocks.append(new)
                plan.taken.append(new)
                plan.freed.append(freed)
            return plan
        hit_blocks, hit_hashes, kv_hit_blocks = self._lookup(seq, state_loaded)
        plan = _Plan(hit_blocks, hit_hashes, needs_slot=self.state_slots is not None and seq.state_slot is None,
                     kv_hit_blocks=kv_hit_blocks)
        needed = -(-(hit_blocks * bs + num_new_tokens) // bs)
        new = max(0, needed - hit_blocks)
        for pool in self.pools:
            first = first_needed_block(hit_blocks * bs, pool.window, bs)
            revived = sum(
                1 for h in hit_hashes[first:] if pool.blocks[pool.cached[h]].ref_count == 0
            )
            plan.new_blocks.append(new)
            plan.taken.append(new + revived)
            plan.freed.append(0)
        return plan

    def _fits(self, plan: _Plan) -> bool:
        if plan.needs_slot and self.state_slots is not None and self.state_slots.num_free == 0:
            return False
        return all(t <= p.num_free + f for t, p, f in zip(plan.taken, self.pools, plan.freed))

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """New blocks `allocate(seq, num_new_tokens)` would add to the primary group (prefix hits not included)."""
        return self._plan(seq, num_new_tokens).new_blocks[0]

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether `allocate(seq, num_new_tokens)` would succeed; changes nothing."""
        return self._fits(self._plan(seq, num_new_tokens))

    def allocate(self, seq: Sequence, num_new_tokens: int, state_loaded: bool = False) -> bool:
        """Cover `num_computed_tokens + num_new_tokens` tokens with blocks (see class docstring).

        With empty block tables, prefix hits (and a state slot) are taken first and
        `num_computed_tokens` is reset to the hit count. Returns False, changing nothing but the
        release of blocks behind a sliding window, if a pool (or the slot pool) is too small.
        `state_loaded` (admission only): the state comes from elsewhere; K/V hits suffice, and no
        checkpoint is restored or saved for these tokens (module docstring).
        """
        admitted = self._admitted(seq)
        if state_loaded and admitted:
            raise ValueError("state_loaded applies to an admission (empty block tables) only")
        if admitted:
            if self._windowed:
                self._trim(seq)
            if num_new_tokens >= 0 and seq.num_computed_tokens + num_new_tokens <= len(seq.block_table) * self.block_size:
                if self.checkpoints is not None:
                    self._queue_save(seq, num_new_tokens)
                return True  # the common decode step: the last block still has room
        plan = self._plan(seq, num_new_tokens, state_loaded)
        # Checking up front makes failure side-effect free: nothing to roll back.
        if not self._fits(plan):
            return False
        if not admitted:
            self._take_hits(seq, plan, restore=not state_loaded)
        for g, pool in enumerate(self.pools):
            table = seq.block_tables[g]
            for _ in range(plan.new_blocks[g]):
                table.append(pool.take_free())
        if self.checkpoints is not None and not state_loaded:
            self._queue_save(seq, num_new_tokens)
        return True

    # -- state checkpoints -------------------------------------------------------------------
    def checkpoint_chunk(self, seq: Sequence, start: int, num_new_tokens: int) -> int:
        """`num_new_tokens`, shortened so a chunk from `start` ends on the last checkpoint
        position it reaches (so its state can be saved there); unchanged without checkpoints,
        when it reaches none, or when every checkpoint slot is pending."""
        checkpoints = self.checkpoints
        if checkpoints is None or num_new_tokens < 1:
            return num_new_tokens
        books = self._checkpointing.get(seq)
        limit = books.limit if books is not None else seq.num_known_tokens
        end = min(start + num_new_tokens, limit)
        p = end - end % self.checkpoint_stride
        if p <= start or not checkpoints.can_take():
            return num_new_tokens
        return p - start

    def _queue_save(self, seq: Sequence, num_new_tokens: int) -> None:
        """A chunk ending on a checkpoint position within the limit saves the state there."""
        end = seq.num_computed_tokens + num_new_tokens
        if num_new_tokens < 1 or end % self.checkpoint_stride:
            return
        books = self._checkpointing.get(seq)
        checkpoints = self.checkpoints
        if books is None or end > books.limit or seq.state_slot is None or not checkpoints.can_take():
            return
        if any(pos == end for pos, _, _ in books.pending):
            return  # the same position scheduled again (cannot happen today; never save twice)
        slot = checkpoints.take()
        books.pending.append((end, slot, self._generation))
        self._copies_after.append((seq.state_slot, slot, seq))

    def _register_checkpoints(self, seq: Sequence, books: _Checkpointing) -> None:
        """Register pending saves whose block (the one ending at their position) is hashed."""
        hashed = len(seq.block_hashes) * self.block_size
        checkpoints = self.checkpoints
        keep = []
        for pos, slot, generation in books.pending:
            if pos > hashed:
                keep.append((pos, slot, generation))
            elif generation != self._generation:
                checkpoints.release(slot)  # computed before a cache reset
            else:
                checkpoints.register(seq.block_hashes[pos // self.block_size - 1], slot)
        books.pending = keep

    def _on_evict(self, block_hash: int) -> None:
        self.checkpoints.drop(block_hash)

    def pop_state_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's (src, dst) slot copies: restores before the forward, saves after it."""
        before = [(src, dst) for src, dst, _ in self._copies_before]
        after = [(src, dst) for src, dst, _ in self._copies_after]
        self._copies_before = []
        self._copies_after = []
        return before, after
    def give_back_before(self, seq, group: int, first_kept: int) -> None:
        """Release the blocks of table entries before `first_kept` in paged group `group` (a
        sliding window's blocks no query will read: a KV load skips them); they become `NULL_BLOCK`."""
        table = seq.block_tables[group]
        pool = self.pools[group]
        for i in range(min(first_kept, len(table))):
            if table[i] != NULL_BLOCK:
                pool.release(table[i])
                table[i] = NULL_BLOCK

    def _trim(self, seq: Sequence) -> None:
        for g in self._windowed:
            table = seq.block_tables[g]
            pool = self.pools[g]
            for i in self._trimmable(seq, g):
                pool.release(table[i])
                table[i] = NULL_BLOCK

    def _take_hits(self, seq: Sequence, plan: _Plan, restore: bool = True) -> None:
        bs = self.block_size
        k = plan.hit_blocks
        tables: list[list[int]] = []
        for pool in self.pools:
            first = first_needed_block(k * bs, pool.window, bs)
            table = [NULL_BLOCK] * first
            for h in plan.hit_hashes[first:]:
                block_id = pool.cached[h]
                pool.take_hit(block_id)
                table.append(block_id)
            tables.append(table)
        if plan.needs_slot and self.state_slots is not None:
            seq.state_slot = self.state_slots.take()
        if self.checkpoints is not None:
            self._checkpointing[seq] = _Checkpointing(seq.num_known_tokens)
            if k and restore:
                src = self.checkpoints.restore(plan.hit_hashes[k - 1])
                self._copies_before.append((src, seq.state_slot, seq))
        num_hit_tokens = k * bs
        seq.block_tables = tables
        seq.block_hashes = list(plan.hit_hashes)
        seq.num_computed_tokens = num_hit_tokens
        if seq.num_cached_prompt_tokens is None:
            seq.num_cached_prompt_tokens = min(num_hit_tokens, seq.num_prompt_tokens)
        if self.enable_prefix_caching:
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += num_hit_tokens
            self.prefix_kv_hits += plan.kv_hit_blocks * bs

    # -- after a step ------------------------------------------------------------------------
    def commit(self, seq: Sequence) -> None:
        """Record written K/V up to `seq.num_computed_tokens`; cache the newly full blocks.

        If another block already holds the same content (two sequences computed the same prefix
        concurrently), that mapping wins and this block stays private and unhashed. Blocks a
        window already gave back are hashed (the chain needs them) but not registered.
        """
        bs = self.block_size
        # Computed tokens whose ids are still pending (overlapped scheduling) wait for a later
        # commit: a block is hashed from its token ids.
        computed = min(seq.num_computed_tokens, seq.num_known_tokens, len(seq.block_table) * bs)
        last = -(-computed // bs) - 1
        for g, pool in enumerate(self.pools):
            table = seq.block_tables[g]
            # Blocks fill in order, so walking back from the last written block until a full (or
            # given back) one touches only what this step wrote.
            for i in range(last, -1, -1):
                if table[i] == NULL_BLOCK:
                    break
                block = pool.blocks[table[i]]
                if block.num_tokens == bs:
                    break
                block.num_tokens = min(bs, computed - i * bs)
        if not self.enable_prefix_caching:
            return
        first = len(seq.block_hashes)
        num_full = computed // bs
        if num_full <= first:
            return
        self._hash_blocks(seq, first, num_full)
        if self.checkpoints is not None:
            books = self._checkpointing.get(seq)
            if books is not None and books.pending:
                self._register_checkpoints(seq, books)

    def _hash_blocks(self, seq: Sequence, first: int, num_full: int) -> None:
        bs = self.block_size
        tokens = seq.token_ids
        for i in range(first, num_full):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            h = hash_block(parent, tokens[i * bs : (i + 1) * bs])
            seq.block_hashes.append(h)
            for g, pool in enumerate(self.pools):
                block_id = seq.block_tables[g][i]
                if block_id != NULL_BLOCK:
                    pool.register(h, block_id)

    def free(self, seq: Sequence) -> None:
        """Release every block and the state slot of `seq`; clear its block tables and hashes.

        Released in reverse order so that, among this sequence's cached blocks, the tail ones
        are evicted first: a head block is useful to more future prompts than a tail block,
        and a tail block without its head can never be hit.
        """
        for g, pool in enumerate(self.pools):
            if g >= len(seq.block_tables):
                break
            for block_id in reversed(seq.block_tables[g]):
                if block_id != NULL_BLOCK:
                    pool.release(block_id)
        seq.block_tables = [[] for _ in self.pools]
        seq.block_hashes = []
        if self.checkpoints is not None:
            self._forget_checkpointing(seq)
        if seq.state_slot is not None:
            if self.state_slots is None:
                raise RuntimeError(f"{seq.request_id} holds a state slot but the model has no state groups")
            self.state_slots.release(seq.state_slot)
            seq.state_slot = None

    def _forget_checkpointing(self, seq: Sequence) -> None:
        """A request ends: free its pending checkpoint slots and drop its queued copies."""
        books = self._checkpointing.pop(seq, None)
        if books is not None:
            for _, slot, _ in books.pending:
                self.checkpoints.release(slot)
        if self._copies_before:
            self._copies_before = [c for c in self._copies_before if c[2] is not seq]
        if self._copies_after:
            self._copies_after = [c for c in self._copies_after if c[2] is not seq]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (and state checkpoint); unreferenced ones go back to the free list.

        Blocks in use keep their contents and owners but lose their hash, so no later request
        can hit K/V computed before the reset (e.g. with older weights); pending checkpoint saves
        are not registered. Always succeeds.
        """
        for pool in self.pools:
            pool.reset()
        if self.checkpoints is not None:
            self.checkpoints.reset()
            self._generation += 1
        return True
