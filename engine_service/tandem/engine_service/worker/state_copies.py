"""Slot -> slot copies over every state tensor: how checkpoints are saved and restored.

The runner's state tensors (`CacheTensors.state[group][layer]`, each `[slots, *shape]`) share
one slot index space (request slots, checkpoint slots, scratch; see `state_pool.py`). A step's
copies are applied as one `index_select` + one `index_copy_` per tensor for the whole list,
never a Python loop per request, and without a host sync (the indices travel through pinned
memory on CUDA).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


def check_copies(pairs: Sequence[tuple[int, int]], num_slots: int) -> None:
    """Raise ValueError unless every index is within `0..num_slots-1` and destinations are distinct
    (a destination written twice by one `index_copy_` would be undefined)."""
    dsts = [dst for _, dst in pairs]
    if len(set(dsts)) != len(dsts):
        raise ValueError(f"state copies write a slot twice: {list(pairs)}")
    for src, dst in pairs:
        if not (0 <= src < num_slots and 0 <= dst < num_slots):
            raise ValueError(f"state copy {src} -> {dst} outside the {num_slots} slots")
        if src == dst:
            raise ValueError(f"state copy {src} -> {dst} copies a slot onto itself")


def copy_state_slots(tensors: Iterable[torch.Tensor], pairs: Sequence[tuple[int, int]]) -> None:
    """For each (src, dst) in `pairs`, copy slot `src` to slot `dst` in every tensor (dim 0).

    The copies of one call read before any of them writes (`index_select` first), so a slot
    may be a source and a destination in the same call. Queued on the current stream; nothing waits.
    """
    tensors = list(tensors)
    if not pairs or not tensors:
        return
    device = tensors[0].device
    idx = torch.tensor(pairs, dtype=torch.int64)
    if device.type == "cuda":
        idx = idx.pin_memory().to(device, non_blocking=True)
    else:
        idx = idx.to(device)
    src, dst = idx[:, 0], idx[:, 1]
    for t in tensors:
        t.index_copy_(0, dst, t.index_select(0, src))
