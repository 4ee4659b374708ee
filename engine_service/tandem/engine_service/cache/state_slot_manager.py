"""State groups (`StateSpec`: recurrent and convolution state of Gated DeltaNet / Mamba layers):
one state slot per running request, and the state checkpoints that let prefix caching resume.

A slot index is valid in every state group at once, so one manager serves all of a layout's
state groups. The slot is taken at admission and given back by `free` (finish, abort, error,
preemption: a preempted request is recomputed, so its state is too).

State checkpoints: K/V blocks alone cannot resume a prefix, because the recurrent state after
it is needed too. A prefill chunk that ends on a checkpoint position `p` (a multiple of
`checkpoint_stride`, itself a multiple of the block size, within the tokens known at admission)
saves the request's slot into a checkpoint slot after the forward (`grow` queues the copy);
once the block ending at `p` is hashed (`cache_blocks`), the checkpoint is registered under that
block's hash and belongs to it (dropped when a paged pool evicts the block, or LRU when
checkpoint slots run out). A lookup then holds only at positions with a checkpoint, and
admission restores that checkpoint into the request's slot before the forward (`take_hit`).
The scheduler cuts prefill chunks at checkpoint positions (`cut_chunk`). Without checkpoint
slots (or without prefix caching) a model with state groups gets no prefix hits.

A request whose state comes from elsewhere (a disaggregated decode leg pulls the producer's
state after its whole prompt) is admitted with `state_loaded=True`: its hit needs the K/V
blocks only, no checkpoint is restored into its slot (the pulled state covers more than any
local one), and none is saved by that admission's chunk (the slot holds nothing until the pull
is written).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.engine_service.cache.group_manager import GroupManager, Hit
from tandem.engine_service.cache.state_pool import CheckpointSlots, StateSlotPool
from tandem.engine_service.config import check_checkpoint_stride
from tandem.engine_service.sequence import Sequence


@dataclass
class _Checkpointing:
    """One admitted request's checkpoint books: positions up to `limit` may be saved; `pending`
    holds (position, checkpoint slot, cache generation) of saves not registered yet."""

    limit: int
    pending: list[tuple[int, int, int]] = field(default_factory=list)


class CheckpointScan:
    """A lookup's state condition: a hit holds where a checkpoint was registered, or anywhere
    when the state is loaded from elsewhere."""

    def __init__(self, checkpoints: CheckpointSlots | None, state_loaded: bool) -> None:
        self._checkpoints = checkpoints
        self._state_loaded = state_loaded

    def feed(self, index: int, block_hash: int) -> bool:
        return True

    def valid(self, num_blocks: int, block_hash: int) -> bool:
        return self._state_loaded or (self._checkpoints is not None and block_hash in self._checkpoints)


class StateSlotManager(GroupManager):
    """Request state slots of every state group, and their checkpoints (when prefix caching and
    checkpoint slots are both on). `checkpoint_stride` must pass `check_checkpoint_stride`."""

    kind = "state"
    paged = False

    def __init__(self, block_size: int, num_slots: int, num_checkpoint_slots: int = 0,
                 checkpoint_stride: int = 0, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.slots = StateSlotPool(num_slots, num_checkpoint_slots)
        self.checkpoints: CheckpointSlots | None = None
        self.checkpoint_stride = 0
        if num_checkpoint_slots and enable_prefix_caching:
            check_checkpoint_stride(checkpoint_stride, block_size)
            self.checkpoints = CheckpointSlots(num_slots, num_checkpoint_slots)
            self.checkpoint_stride = checkpoint_stride
        self._books: dict[Sequence, _Checkpointing] = {}
        self._generation = 0  # bumped by reset_prefix_cache: older pending saves are not registered
        # This step's slot -> slot copies, with the request each belongs to: (src, dst, seq).
        self._copies_before: list[tuple[int, int, Sequence]] = []
        self._copies_after: list[tuple[int, int, Sequence]] = []

    # -- lookup and allocation ---------------------------------------------------------------
    def hit_scan(self, state_loaded: bool) -> CheckpointScan:
        return CheckpointScan(self.checkpoints, state_loaded)

    def fits(self, seq: Sequence, num_new_tokens: int, hit: Hit | None) -> bool:
        """An admission needs a free slot unless the request holds one."""
        return hit is None or seq.state_slot is not None or self.slots.num_free > 0

    def take_hit(self, seq: Sequence, hit: Hit, restore: bool) -> None:
        if seq.state_slot is None:
            seq.state_slot = self.slots.take()
        if self.checkpoints is not None:
            self._books[seq] = _Checkpointing(seq.num_known_tokens)
            if hit.blocks and restore:
                src = self.checkpoints.restore(hit.hashes[hit.blocks - 1])
                self._copies_before.append((src, seq.state_slot, seq))

    def grow(self, seq: Sequence, num_new_tokens: int, state_loaded: bool) -> None:
        """A chunk ending on a checkpoint position within the limit saves the state there."""
        checkpoints = self.checkpoints
        if checkpoints is None or state_loaded:
            return
        end = seq.num_computed_tokens + num_new_tokens
        if num_new_tokens < 1 or end % self.checkpoint_stride:
            return
        books = self._books.get(seq)
        if books is None or end > books.limit or seq.state_slot is None or not checkpoints.can_take():
            return
        if any(pos == end for pos, _, _ in books.pending):
            return  # the same position scheduled again (cannot happen today; never save twice)
        slot = checkpoints.take()
        books.pending.append((end, slot, self._generation))
        self._copies_after.append((seq.state_slot, slot, seq))

    def cut_chunk(self, seq: Sequence, start: int, num_new_tokens: int) -> int:
        """`num_new_tokens`, shortened so a chunk from `start` ends on the last checkpoint
        position it reaches (so its state can be saved there); unchanged without checkpoints,
        when it reaches none, or when every checkpoint slot is pending."""
        checkpoints = self.checkpoints
        if checkpoints is None or num_new_tokens < 1:
            return num_new_tokens
        books = self._books.get(seq)
        limit = books.limit if books is not None else seq.num_known_tokens
        end = min(start + num_new_tokens, limit)
        p = end - end % self.checkpoint_stride
        if p <= start or not checkpoints.can_take():
            return num_new_tokens
        return p - start

    def pop_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's (src, dst) slot copies: restores before the forward, saves after it."""
        before = [(src, dst) for src, dst, _ in self._copies_before]
        after = [(src, dst) for src, dst, _ in self._copies_after]
        self._copies_before = []
        self._copies_after = []
        return before, after

    # -- after a step ------------------------------------------------------------------------
    def cache_blocks(self, seq: Sequence, first: int, end: int) -> None:
        """Register pending saves whose block (the one ending at their position) is hashed."""
        checkpoints = self.checkpoints
        books = self._books.get(seq) if checkpoints is not None else None
        if books is None or not books.pending:
            return
        hashed = len(seq.block_hashes) * self.block_size
        keep = []
        for pos, slot, generation in books.pending:
            if pos > hashed:
                keep.append((pos, slot, generation))
            elif generation != self._generation:
                checkpoints.release(slot)  # computed before a cache reset
            else:
                checkpoints.register(seq.block_hashes[pos // self.block_size - 1], slot)
        books.pending = keep

    def free(self, seq: Sequence) -> None:
        """Free the request's pending checkpoint slots, drop its queued copies, release its slot."""
        if self.checkpoints is not None:
            books = self._books.pop(seq, None)
            if books is not None:
                for _, slot, _ in books.pending:
                    self.checkpoints.release(slot)
            if self._copies_before:
                self._copies_before = [c for c in self._copies_before if c[2] is not seq]
            if self._copies_after:
                self._copies_after = [c for c in self._copies_after if c[2] is not seq]
        if seq.state_slot is not None:
            self.slots.release(seq.state_slot)
            seq.state_slot = None

    def reset_prefix_cache(self) -> None:
        """Forget every registered checkpoint; saves still pending will not be registered."""
        if self.checkpoints is not None:
            self.checkpoints.reset()
            self._generation += 1

    def reset_counters(self) -> None:
        if self.checkpoints is not None:
            self.checkpoints.reset_counters()

    def eviction_listener(self) -> Callable[[int], None] | None:
        """A checkpoint belongs to its cached block and goes when a pool evicts the block."""
        return self.checkpoints.drop if self.checkpoints is not None else None

    def usage(self) -> dict[str, dict[str, int]]:
        out = {"state_slots": {"total": self.slots.num_slots, "used": self.slots.num_used}}
        if self.checkpoints is not None:
            # "used": registered (reusable, like cached blocks) or pending (owned by a request).
            ck = self.checkpoints
            out["state_checkpoints"] = {"total": ck.num_slots, "used": ck.num_registered + ck.num_pending,
                                        "pending": ck.num_pending}
        return out
