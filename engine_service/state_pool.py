"""Per-request state slots: the pool a model's state cache groups (recurrent / convolution state) share.

A slot index is valid in every state group at once (the runner allocates, per state group and
layer, tensors `[num_slots + 1, *shape]`; the last index is scratch). The block manager takes a
slot when it admits a request and returns it wherever the request's blocks are returned:
finish, abort, error and preemption (a preempted request is recomputed, so its state is too).
"""

from __future__ import annotations

from collections import deque


class StateSlotPool:
    """Hands out slot indices `0..num_slots-1`, each to at most one request at a time.

    Invariant: `num_free + num_used == num_slots`, and a slot is either in the free queue or
    held, never both (a double release raises).
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError("a state slot pool needs at least one slot")
        self.num_slots = num_slots
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
        """The index past the pool where padded CUDA-graph rows write (never handed out)."""
        return self.num_slots

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
