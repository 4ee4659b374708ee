"""Reads and writes one request's state slot over every state group (the worker side's state memory).

A hybrid model (Gated DeltaNet layers next to attention layers) keeps per-request state in state
groups (`cache_spec.StateSpec`): per layer of a state group, one tensor per state shape
(convolution state, then recurrent state), each `[slots, *shape]`, and one slot index valid in
every state group at once (`state_pool.py`). A decode leg needs that state after the prompt as
well as the prompt's K/V blocks, so the state of one slot travels as one unit:

    for each state group (layout order), for each layer (the group's `layer_ids` order),
    for each state shape (the spec's order): the bytes of `tensor[slot]`

Both engines build the same order from the same model, so equal `slot_bytes` is the handshake's
sanity check (the consumer refuses a frame of another size), as `block_bytes` is for blocks.

Invariants: `tensors` lists every state tensor once, in the order above; reads and writes touch
only the named slot; `num_slots` is the request slot count (checkpoint and scratch slots are past
it and are never transferred).
"""

from __future__ import annotations

import torch

from tandem.engine_service.cache.cache_spec import CacheLayout
from tandem.engine_service.cache.cache_tensors import CacheTensors


class StateSlotIO:
    """Gathers one state slot of every state tensor into bytes and scatters bytes back."""

    def __init__(self, layout: CacheLayout, tensors: CacheTensors, num_slots: int) -> None:
        if not layout.state_groups:
            raise ValueError("a layout without state groups has no state slots to move")
        self.tensors: list[torch.Tensor] = []
        for group in layout.state_groups:
            per_layer = tensors.state[group.name]
            for layer in group.layer_ids:
                self.tensors.extend(per_layer[layer])
        self.num_slots = num_slots
        self.slot_bytes = sum(_slot_nbytes(t) for t in self.tensors)
        self.device = self.tensors[0].device

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"state slot {slot} outside the {self.num_slots} request slots")

    def read_slot(self, slot: int) -> bytes:
        """Slot `slot` of every state tensor, concatenated in the fixed order (module docstring)."""
        self._check_slot(slot)
        parts = [t[slot].contiguous().view(torch.uint8).reshape(-1).cpu() for t in self.tensors]
        return torch.cat(parts).numpy().tobytes()

    def write_slot(self, slot: int, data: bytes) -> None:
        """Write `data` (from `read_slot` on an engine with the same layout) into slot `slot`."""
        self._check_slot(slot)
        if len(data) != self.slot_bytes:
            raise ValueError(f"state of {len(data)} bytes, expected {self.slot_bytes}")
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        offset = 0
        for t in self.tensors:
            n = _slot_nbytes(t)
            src = raw[offset:offset + n].view(t.dtype).reshape(t.shape[1:])
            t[slot].copy_(src.to(t.device))
            offset += n

    def copy_slot_from(self, remote: list[torch.Tensor], remote_slot: int, local_slot: int) -> None:
        """Device copy: slot `remote_slot` of the remote state tensors `remote` (the same tensors
        on another engine, e.g. opened over CUDA IPC, in the same order) into `local_slot` here."""
        self._check_slot(local_slot)
        if len(remote) != len(self.tensors):
            raise ValueError(f"{len(remote)} remote state tensors, {len(self.tensors)} here")
        for t, r in zip(self.tensors, remote):
            if r.shape[1:] != t.shape[1:] or r.dtype != t.dtype:
                raise ValueError(f"remote state tensor {tuple(r.shape)} {r.dtype} does not match "
                                 f"{tuple(t.shape)} {t.dtype}")
            if not 0 <= remote_slot < r.shape[0]:
                raise ValueError(f"remote state slot {remote_slot} outside its {r.shape[0]} slots")
        for t, r in zip(self.tensors, remote):
            t[local_slot].copy_(r[remote_slot].to(t.device))


def _slot_nbytes(t: torch.Tensor) -> int:
    return t.numel() // t.shape[0] * t.element_size()
