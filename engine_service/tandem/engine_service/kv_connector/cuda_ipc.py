"""CUDA IPC transport: the consumer opens the producer's cache tensors and copies blocks on the GPU.

Two engine processes on one host (the same GPU, or two GPUs with peer access) need not move KV
through the host: the producer exports a CUDA IPC handle per paged-group layer tensor
(`export_handles`), sent over the TCP KV connection (`wire.IpcHandles`, msgpack fields, never
pickle); the consumer opens them once per producer (`open_handles`, cached by torch per
allocation) and copies the leased blocks device to device (`KVBlockIO.copy_blocks_from`). A
hybrid model's state tensors are exported too (`IpcHandles.state`, in `state_io.py`'s order;
`open_state`), and the lease's state slot is copied the same way (`StateSlotIO.copy_slot_from`).
The TCP connection stays open while the consumer copies, so the lease stays pinned; closing it
releases the lease.

Both ends are behind `IpcChannel`, the seam the CPU tests use: `InProcessChannel` "exports" a
registry key and "opens" the same tensors in the same process, so the handshake, the lease
pinning and the block mapping are tested without a GPU; `CudaIpcChannel` is the real one
(checked on a GPU by `tandem.gpu_checks.kv_transfer`). No checksum is computed on this path:
nothing crosses a wire, and the GPU check compares the bytes.
"""

from __future__ import annotations

import uuid

import torch

from tandem.engine_service.kv_connector.block_io import KVBlockIO
from tandem.engine_service.kv_connector.state_io import StateSlotIO
from tandem.engine_service.kv_connector.wire import IpcHandles


class IpcChannel:
    """Exports this engine's paged-group layer tensors (and state tensors) and opens another engine's."""

    def export_handles(self, block_io: KVBlockIO, state_io: StateSlotIO | None = None) -> IpcHandles:
        raise NotImplementedError

    def open_handles(self, handles: IpcHandles) -> list[list[torch.Tensor]]:
        """Per paged group, per layer: the producer's cache tensor."""
        raise NotImplementedError

    def open_state(self, handles: IpcHandles) -> list[torch.Tensor]:
        """The producer's state tensors, in `state_io.py`'s order (empty: it exported none)."""
        raise NotImplementedError


class CudaIpcChannel(IpcChannel):
    """The real CUDA IPC channel (torch's storage sharing; fields travel as msgpack)."""

    def __init__(self) -> None:
        self._opened: dict[str, list[list[torch.Tensor]]] = {}
        self._exported: IpcHandles | None = None

    def export_handles(self, block_io: KVBlockIO, state_io: StateSlotIO | None = None) -> IpcHandles:
        # The cache tensors live as long as the engine: their handles are exported once.
        if self._exported is None:
            self._exported = self._export(block_io, state_io)
        return self._exported

    def _export(self, block_io: KVBlockIO, state_io: StateSlotIO | None) -> IpcHandles:
        if block_io.device.type != "cuda":
            raise RuntimeError("cuda_ipc needs the KV cache on a CUDA device")
        groups = [[_share(t) for t, _ in layers] for layers in block_io.layers]
        state = [_share(t) for t in state_io.tensors] if state_io is not None else []
        props = torch.cuda.get_device_properties(block_io.device)
        return IpcHandles(device_uuid=str(getattr(props, "uuid", block_io.device)), groups=groups, state=state)

    def open_handles(self, handles: IpcHandles) -> list[list[torch.Tensor]]:
        return self._open(handles)[:len(handles.groups)]

    def open_state(self, handles: IpcHandles) -> list[torch.Tensor]:
        (state,) = self._open(handles)[len(handles.groups):] or [[]]
        return state

    def _open(self, handles: IpcHandles) -> list[list[torch.Tensor]]:
        """The paged groups' layer lists, then (when exported) the state tensors as one more list."""
        lists = list(handles.groups) + ([handles.state] if handles.state else [])
        key = repr([[e[5], e[7]] for g in lists for e in g])
        if key not in self._opened:
            self._opened[key] = [[_rebuild(e) for e in entries] for entries in lists]
        return self._opened[key]


def _share(t: torch.Tensor) -> list:
    """One tensor's CUDA IPC handle fields (msgpack-able)."""
    (device, handle, size_bytes, offset_bytes, rc_handle, rc_offset, ev_handle,
     ev_sync) = t.untyped_storage()._share_cuda_()
    return [list(t.shape), list(t.stride()), t.storage_offset(), str(t.dtype).removeprefix("torch."),
            int(device), bytes(handle), int(size_bytes), int(offset_bytes), bytes(rc_handle),
            int(rc_offset), bytes(ev_handle) if ev_handle else b"", bool(ev_sync)]


def _rebuild(entry: list) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    (shape, stride, offset, dtype, device, handle, size_bytes, offset_bytes, rc_handle, rc_offset,
     ev_handle, ev_sync) = entry
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size(shape), tuple(stride), offset, torch.UntypedStorage,
        getattr(torch, dtype), device, handle, size_bytes, offset_bytes, False, rc_handle, rc_offset,
        ev_handle or None, ev_sync)


class InProcessChannel(IpcChannel):
    """CPU stand-in (tests): two engines in one process; a registry key stands for the handles."""

    _registry: dict[str, tuple[list[list[torch.Tensor]], list[torch.Tensor]]] = {}

    def __init__(self) -> None:
        self._key: str | None = None

    def export_handles(self, block_io: KVBlockIO, state_io: StateSlotIO | None = None) -> IpcHandles:
        if self._key is None:
            self._key = f"inproc-{uuid.uuid4().hex}"
            InProcessChannel._registry[self._key] = ([[t for t, _ in layers] for layers in block_io.layers],
                                                     list(state_io.tensors) if state_io is not None else [])
        return IpcHandles(device_uuid=self._key, groups=[])

    def _lookup(self, handles: IpcHandles) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
        try:
            return InProcessChannel._registry[handles.device_uuid]
        except KeyError:
            raise RuntimeError(f"no in-process KV memory registered as {handles.device_uuid}") from None

    def open_handles(self, handles: IpcHandles) -> list[list[torch.Tensor]]:
        return self._lookup(handles)[0]

    def open_state(self, handles: IpcHandles) -> list[torch.Tensor]:
        return self._lookup(handles)[1]
