"""Paged KV cache bookkeeping: a thin coordinator over one group manager per cache kind.

Only ids and counters live here; the tensors belong to the model runner. A request holds one
block table per paged cache group (`seq.block_tables`, all of equal length: entry i covers
token positions `i * block_size .. (i + 1) * block_size - 1`), and, when the model has state
groups, one state slot (`seq.state_slot`). The slot of token position p in group g is
`block_tables[g][p // block_size] * block_size + p % block_size`.

Each kind keeps its own books behind one interface (`group_manager.py`): full attention
(`full_attention_manager.py`), sliding window (`sliding_window_manager.py`: blocks behind the
window go back during the request), latent entries (`latent_manager.py`) and state slots with
their checkpoints (`state_slot_manager.py`). This module owns what they share: the chained block
hashes, the order of calls, and the prefix-cache counters.

Prefix caching: when a block is full and its K/V are written (`commit`), it is registered under a
chained hash of (hash of the previous block, token ids of this block), so equal block contents
after different prefixes never match. A released block keeps its hash and stays reusable until
it is evicted (least recently used first) to make room for a new allocation. Each paged group
has its own pool and its own hash -> block map; a hit of k blocks must be valid in every group
(each kind says what that takes), and with state groups it must also end where a state
checkpoint exists (the K/V-only hit is counted apart, `prefix_kv_hits`).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable
from collections.abc import Sequence as SeqOf

from tandem.engine_service.cache.block_pool import Block, BlockPool, PagedGroup
from tandem.engine_service.cache.full_attention_manager import FullAttentionManager
from tandem.engine_service.cache.group_manager import NO_HIT, NULL_BLOCK, GroupManager, Hit
from tandem.engine_service.cache.latent_manager import LatentManager
from tandem.engine_service.cache.paged_manager import PagedGroupManager
from tandem.engine_service.cache.sliding_window_manager import SlidingWindowManager, first_needed_block
from tandem.engine_service.cache.state_pool import CheckpointSlots, StateSlotPool
from tandem.engine_service.cache.state_slot_manager import StateSlotManager
from tandem.engine_service.sequence import Sequence

__all__ = ["NULL_BLOCK", "PAGED_MANAGERS", "BlockManager", "PagedGroup", "first_needed_block", "hash_block",
           "salt_root"]

# Distinguishes the first block of a sequence (no parent) from a block whose parent hash
# happens to have any particular value.
_ROOT_TAG = b"\x00"
_CHILD_TAG = b"\x01"

# The manager of each paged cache kind (`CacheSpec.kind`, `PagedGroup.kind`). A new kind is a new
# module with a `PagedGroupManager` subclass, listed here.
PAGED_MANAGERS: dict[str, type[PagedGroupManager]] = {
    cls.kind: cls for cls in (FullAttentionManager, SlidingWindowManager, LatentManager)
}


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


def salt_root(cache_salt: str) -> int | None:
    """The parent hash of a sequence's first block: None (the shared chain) without a salt, else
    a hash of the salt, so sequences of different salts never share a cached block."""
    if not cache_salt:
        return None
    h = hashlib.blake2b(digest_size=8, person=b"tandem-salt")
    h.update(cache_salt.encode("utf-8", "surrogatepass"))
    return int.from_bytes(h.digest(), "little")


def _eviction_callback(managers: SeqOf[GroupManager]) -> Callable[[int], None] | None:
    """One callback for the paged pools that tells every listening manager of an eviction."""
    listeners = [f for m in managers if (f := m.eviction_listener()) is not None]
    if len(listeners) <= 1:
        return listeners[0] if listeners else None

    def tell_all(block_hash: int) -> None:
        for f in listeners:
            f(block_hash)
    return tell_all


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
       Admission needs room in every group (blocks, a slot); failing anywhere changes nothing.
    3. After the model wrote K/V and the caller advanced `seq.num_computed_tokens`,
       `commit(seq)` registers the newly full blocks.
    4. `free(seq)` releases everything, the state slot included (finish, abort, error and
       preemption all end here).

    With state checkpoints (`state_slot_manager.py`) the scheduler also shortens chunks with
    `checkpoint_chunk`, and takes each step's slot -> slot copies with `pop_state_copies`.

    `managers` lists the group managers, paged ones first in layout order (manager g owns
    `seq.block_tables[g]` and `pools[g]`). `num_blocks`, `blocks`, `num_free_blocks` and `slot`
    describe the primary (first) group; `usage` is the fullest group's.
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
        others: list[GroupManager] = []
        self._state: StateSlotManager | None = None
        if num_state_slots:
            self._state = StateSlotManager(block_size, num_state_slots, num_checkpoint_slots, checkpoint_stride,
                                           enable_prefix_caching)
            others.append(self._state)
        on_evict = _eviction_callback(others)
        paged = [self._paged_manager(g, i, on_evict) for i, g in enumerate(groups)]
        self.managers: list[GroupManager] = [*paged, *others]
        self.paged_managers: list[PagedGroupManager] = paged
        self.pools: list[BlockPool] = [m.pool for m in paged]
        self.num_groups = len(paged)
        self.reset_counters()

    def _paged_manager(self, group: PagedGroup, index: int,
                       on_evict: Callable[[int], None] | None) -> PagedGroupManager:
        try:
            cls = PAGED_MANAGERS[group.kind]
        except KeyError:
            raise ValueError(f"no manager for paged cache kind {group.kind!r} (group {group.name!r}); "
                             f"known: {', '.join(PAGED_MANAGERS)}") from None
        return cls(group, index, self.block_size, on_evict)

    def reset_counters(self) -> None:
        """Zero the prefix-cache totals (and every group's): what a warm-up leaves in them."""
        self.prefix_queries = 0  # tokens looked up in the prefix cache at admission
        self.prefix_hits = 0  # of those, tokens served from the cache
        # Tokens whose K/V were cached at admission (hits before truncation to a checkpoint; equal
        # to prefix_hits for a model without state groups).
        self.prefix_kv_hits = 0
        for m in self.managers:
            m.reset_counters()

    @classmethod
    def from_plan(cls, plan, enable_prefix_caching: bool = True, checkpoint_stride: int = 0) -> "BlockManager":
        """One manager per paged group of a `memory_plan.MemoryPlan` (by its kind), and one for
        its state slots and checkpoint slots."""
        groups = [PagedGroup(g.name, g.num_blocks, g.sliding_window, g.kind) for g in plan.paged_groups]
        return cls(groups[0].num_blocks, plan.block_size, enable_prefix_caching,
                   groups=groups, num_state_slots=plan.num_state_slots,
                   num_checkpoint_slots=getattr(plan, "num_checkpoint_slots", 0),
                   checkpoint_stride=checkpoint_stride)

    # -- the state-slot manager's parts callers use ------------------------------------------
    @property
    def state_slots(self) -> StateSlotPool | None:
        return self._state.slots if self._state is not None else None

    @property
    def checkpoints(self) -> CheckpointSlots | None:
        return self._state.checkpoints if self._state is not None else None

    @property
    def checkpoint_stride(self) -> int:
        """Tokens between state checkpoints; 0 without checkpoints."""
        return self._state.checkpoint_stride if self._state is not None else 0

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
        """Per paged group (and the state slots, and checkpoints when there are): total and used."""
        out: dict[str, dict[str, int]] = {}
        for m in self.managers:
            out.update(m.usage())
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
        request's state comes from elsewhere, so K/V blocks alone make a hit
        (`state_slot_manager.py`).
        """
        return self.lookup(seq, state_loaded).blocks * self.block_size

    def lookup(self, seq: Sequence, state_loaded: bool = False) -> Hit:
        """The largest hit valid in every group, the hashes of its blocks, and the hit the
        paged groups alone would give. No side effects. A request asking for prompt logprobs
        never hits (as in vLLM): every prompt position must be computed to report its logprob.
        Its own blocks are still committed for the requests after it."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return NO_HIT
        tokens = seq.token_ids
        bs = self.block_size
        scans = [m.hit_scan(state_loaded) for m in self.managers]
        kv_scans = scans[: self.num_groups]
        other_scans = scans[self.num_groups :]
        hashes: list[int] = []
        parent: int | None = salt_root(seq.params.cache_salt)
        best = kv_best = 0
        for i in range((len(tokens) - 1) // bs):
            h = hash_block(parent, tokens[i * bs : (i + 1) * bs])
            hashes.append(h)
            parent = h
            if not all(s.feed(i, h) for s in scans):
                break
            k = i + 1
            if all(s.valid(k, h) for s in kv_scans):
                kv_best = k
                if all(s.valid(k, h) for s in other_scans):
                    best = k
        return Hit(best, hashes[:best], kv_best)

    # -- allocation --------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int, state_loaded: bool = False) -> bool:
        """Cover `num_computed_tokens + num_new_tokens` tokens with blocks (see class docstring).

        With empty block tables, prefix hits (and a state slot) are taken first and
        `num_computed_tokens` is reset to the hit count. Returns False, changing nothing but the
        release of blocks behind a sliding window, if a group is too small.
        `state_loaded` (admission only): the state comes from elsewhere; K/V hits suffice, and no
        checkpoint is restored or saved for these tokens (`state_slot_manager.py`).
        """
        admitted = bool(seq.block_tables[0])
        if state_loaded and admitted:
            raise ValueError("state_loaded applies to an admission (empty block tables) only")
        if admitted:
            for m in self.managers:
                m.trim(seq)
        if num_new_tokens < 0:
            raise ValueError("num_new_tokens must be >= 0")
        hit: Hit | None = None
        if admitted:
            if seq.num_computed_tokens + num_new_tokens > len(seq.block_table) * self.block_size:
                # Checking up front makes failure side-effect free: nothing to roll back. (The
                # common decode step skips it: the last block still has room.)
                if not all(m.fits(seq, num_new_tokens, None) for m in self.managers):
                    return False
        else:
            hit = self.lookup(seq, state_loaded)
            if not all(m.fits(seq, num_new_tokens, hit) for m in self.managers):
                return False
            self._admit(seq, hit, restore=not state_loaded)
        for m in self.managers:
            m.grow(seq, num_new_tokens, state_loaded)
        return True

    def _admit(self, seq: Sequence, hit: Hit, restore: bool) -> None:
        """Take `hit` in every group and count it; `seq` starts computing after it."""
        seq.block_tables = [[] for _ in self.pools]
        for m in self.managers:
            m.take_hit(seq, hit, restore)
        num_hit_tokens = hit.blocks * self.block_size
        seq.block_hashes = list(hit.hashes)
        seq.num_computed_tokens = num_hit_tokens
        if seq.num_cached_prompt_tokens is None:
            seq.num_cached_prompt_tokens = min(num_hit_tokens, seq.num_prompt_tokens)
        if self.enable_prefix_caching:
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += num_hit_tokens
            self.prefix_kv_hits += hit.kv_blocks * self.block_size

    def checkpoint_chunk(self, seq: Sequence, start: int, num_new_tokens: int) -> int:
        """`num_new_tokens` of a prefill chunk from `start`, shortened where a group needs the
        chunk to end earlier (state checkpoints: on the last checkpoint position it reaches)."""
        for m in self.managers:
            num_new_tokens = m.cut_chunk(seq, start, num_new_tokens)
        return num_new_tokens

    def pop_state_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's (src, dst) state-slot copies: restores before the forward, saves after it."""
        return self._state.pop_copies() if self._state is not None else ([], [])

    def give_back_before(self, seq: Sequence, group: int, first_kept: int) -> None:
        """Release the blocks of table entries before `first_kept` in paged group `group` (a
        sliding window's blocks no query will read: a KV load skips them); they become `NULL_BLOCK`."""
        self.paged_managers[group].give_back_before(seq, first_kept)

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
        for m in self.managers:
            m.commit(seq, computed)
        if not self.enable_prefix_caching:
            return
        first = len(seq.block_hashes)
        num_full = computed // bs
        if num_full <= first:
            return
        tokens = seq.token_ids
        for i in range(first, num_full):
            parent = seq.block_hashes[-1] if seq.block_hashes else salt_root(seq.params.cache_salt)
            seq.block_hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs]))
        for m in self.managers:
            m.cache_blocks(seq, first, num_full)

    def free(self, seq: Sequence) -> None:
        """Release every block and the state slot of `seq`; clear its block tables and hashes."""
        for m in self.managers:
            m.free(seq)
        seq.block_tables = [[] for _ in self.pools]
        seq.block_hashes = []
        if seq.state_slot is not None:
            raise RuntimeError(f"{seq.request_id} holds a state slot but the model has no state groups")

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (and state checkpoint); unreferenced ones go back to the free list.

        Blocks in use keep their contents and owners but lose their hash, so no later request
        can hit K/V computed before the reset (e.g. with older weights); pending checkpoint saves
        are not registered. Always succeeds.
        """
        for m in self.managers:
            m.reset_prefix_cache()
        return True
