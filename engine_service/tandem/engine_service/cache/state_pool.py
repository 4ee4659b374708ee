"""Per-request state slots and state checkpoints: the slot indices of a model's state cache groups.

A slot index is valid in every state group at once (the runner allocates, per state group and
layer, tensors `[num_slots + num_checkpoint_slots + 1, *shape]`). The index space is

    0 .. num_slots-1                         request slots (`StateSlotPool`)
    num_slots .. num_slots+num_checkpoints-1 checkpoint slots (`CheckpointSlots`)
    num_slots + num_checkpoints              scratch (padded CUDA-graph rows write there)

The block manager takes a request slot when it admits a request and returns it wherever the
request's blocks are returned: finish, abort, error and preemption (a preempted request is
recomputed, so its state is too).

A checkpoint slot holds a copy of a request's state after the first `p` tokens of a prefix,
`p` a multiple of the checkpoint stride (a multiple of the block size); it is keyed by the
chained hash of the block that ends at `p`, so it belongs to that cached block: it is dropped
when the block is evicted, and the least recently used checkpoint is dropped when a new one
needs a slot. Together with the K/V blocks of the prefix it lets a hybrid model (KV layers plus
recurrent layers) resume at `p` instead of recomputing the prefix.
"""

from __future__ import annotations

from collections import OrderedDict, deque


class StateSlotPool:
    """Hands out request slot indices `0..num_slots-1`, each to at most one request at a time.

    Invariant: `num_free + num_used == num_slots`, and a slot is either in the free queue or
    held, never both (a double release raises). `scratch_slot` is past the checkpoint slots.
    """

    def __init__(self, num_slots: int, num_checkpoint_slots: int = 0) -> None:
        if num_slots < 1:
            raise ValueError("a state slot pool needs at least one slot")
        if num_checkpoint_slots < 0:
            raise ValueError("num_checkpoint_slots must be >= 0")
        self.num_slots = num_slots
        self.num_checkpoint_slots = num_checkpoint_slots
        self._free: deque[int] = deque(range(num_slots))
        self._held: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._held)

    @property
    def scratch_slot(self) -> int:
        """The index past the request and checkpoint slots where padded CUDA-graph rows write
        (never handed out)."""
        return self.num_slots + self.num_checkpoint_slots

    def take(self) -> int:
        if not self._free:
            raise RuntimeError("no free state slot")
        slot = self._free.popleft()
        self._held.add(slot)
        return slot

    def release(self, slot: int) -> None:
        if slot not in self._held:
            raise RuntimeError(f"state slot {slot} released but not held")
        self._held.remove(slot)
        self._free.append(slot)


class CheckpointSlots:
    """State checkpoint slots `first .. first + num_slots - 1`: free, pending or registered.

    - *pending*: taken for a save this step (`take`); the request that took it owns it until
      its block is hashed (`register`) or the request ends (`release`).
    - *registered*: holds the state after the prefix whose last block hash is the key; kept in
      least-recently-used order (a restore counts as a use) and dropped (`drop`) with its
      block, or evicted by `take` when no slot is free.

    Invariant: `num_free + num_pending + num_registered == num_slots`; a slot is in exactly one
    of the three sets, and a hash maps to at most one slot.
    """

    def __init__(self, first: int, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError("num_slots must be >= 0")
        self.first = first
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(first, first + num_slots))
        self._pending: set[int] = set()
        self._by_hash: OrderedDict[int, int] = OrderedDict()  # block hash -> slot, LRU first
        self.reset_counters()

    def reset_counters(self) -> None:
        """Zero the totals (what a warm-up leaves in them); the slots are untouched."""
        self.num_evicted = 0  # registered checkpoints dropped to make room for a new one
        self.num_saved = 0  # checkpoints registered
        self.num_restored = 0  # checkpoints copied into a request's slot

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def num_registered(self) -> int:
        return len(self._by_hash)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._by_hash

    def hashes(self) -> list[int]:
        """Registered checkpoints' block hashes, least recently used first."""
        return list(self._by_hash)

    def can_take(self) -> bool:
        """Whether `take` would succeed (a free slot, or a registered one to evict)."""
        return bool(self._free or self._by_hash)

    def take(self) -> int:
        """A slot for a new save: a free one, else the least recently used checkpoint's."""
        if self._free:
            slot = self._free.popleft()
        elif self._by_hash:
            _, slot = self._by_hash.popitem(last=False)
            self.num_evicted += 1
        else:
            raise RuntimeError("every checkpoint slot is pending")
        self._pending.add(slot)
        return slot

    def register(self, block_hash: int, slot: int) -> bool:
        """A pending slot now holds the state after the prefix ending with block `block_hash`.
        If that prefix already has a checkpoint, the slot is freed instead (False)."""
        self._require_pending(slot)
        self._pending.remove(slot)
        if block_hash in self._by_hash:
            self._free.append(slot)
            return False
        self._by_hash[block_hash] = slot
        self.num_saved += 1
        return True

    def release(self, slot: int) -> None:
        """A pending slot that will not be registered (its request ended first)."""
        self._require_pending(slot)
        self._pending.remove(slot)
        self._free.append(slot)

    def restore(self, block_hash: int) -> int:
        """The slot of `block_hash`'s checkpoint, marked most recently used."""
        self._by_hash.move_to_end(block_hash)
        self.num_restored += 1
        return self._by_hash[block_hash]

    def drop(self, block_hash: int) -> None:
        """The block the checkpoint belongs to was evicted: free its slot (no-op without one)."""
        slot = self._by_hash.pop(block_hash, None)
        if slot is not None:
            self._free.append(slot)

    def reset(self) -> None:
        """Forget every registered checkpoint (pending ones stay with their requests)."""
        self._free.extend(self._by_hash.values())
        self._by_hash.clear()

    def _require_pending(self, slot: int) -> None:
        if slot not in self._pending:
            raise RuntimeError(f"checkpoint slot {slot} is not pending")
