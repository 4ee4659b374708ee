"""CUDA IPC transport: the consumer opens the producer's cache tensors and copies blocks on the GPU.

Two engine processes on one host (the same GPU, or two GPUs with peer access) need not move KV
through the host: the producer exports a CUDA IPC handle per paged-group layer tensor
(`export_handles`), sent over the TCP KV connection (`wire.IpcHandles`, msgpack fields, never
pickle); the consumer opens them once per producer (`open_handles`, cached by torch per
allocation) and copies the leased blocks device to device (`KVBlockIO.copy_blocks_from`). The
TCP connection stays open while the consumer copies, so the lease stays pinned; closing it
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
from tandem.engine_service.kv_connector.wire import IpcHandles


class IpcChannel:
    """Exports this engine's paged-group layer tensors and opens another engine's."""

    def export_handles(self, block_io: KVBlockIO) -> IpcHandles:
        raise NotImplementedError

    def open_handles(self, handles: IpcHandles) -> list[list[torch.Tensor]]:
        raise NotImplementedError


class CudaIpcChannel(IpcChannel):
    """The real CUDA IPC channel (torch's storage sharing; fields travel as msgpack)."""

    def __init__(self) -> None:
        self._opened: dict[str, list[list[torch.Tensor]]] = {}
        self._exported: IpcHandles | None = None

    def export_handles(self, block_io: KVBlockIO) -> IpcHandles:
        # The cache tensors live as long as the engine: their handles are exported once.
        if self._exported is None:
            self._exported = self._export(block_io)
        return self._exported

    def _export(self, block_io: KVBlockIO) -> IpcHandles:
        if block_io.device.type != "cuda":
            raise RuntimeError("cuda_ipc needs the KV cache on a CUDA device")
        groups = []
        for layers in block_io.layers:
            entries = []
            for t, _ in layers:
                storage = t.untyped_storage()
                (device, handle, size_bytes, offset_bytes, rc_handle, rc_offset, ev_handle,
                 ev_sync) = storage._share_cuda_()
                entries.append([list(t.shape), list(t.stride()), t.storage_offset(), str(t.dtype).removeprefix("torch."),
                                int(device), bytes(handle), int(size_bytes), int(offset_bytes), bytes(rc_handle),
                                int(rc_offset), bytes(ev_handle) if ev_handle else b"", bool(ev_sync)])
            groups.append(entries)
        props = torch.cuda.get_device_properties(block_io.device)
        return IpcHandles(device_uuid=str(getattr(props, "uuid", block_io.device)), groups=groups)

    def open_handles(self, handles: IpcHandles) -> list[list[torch.Tensor]]:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        key = repr([[e[5], e[7]] for g in handles.groups for e in g])
        if key in self._opened:
            return self._opened[key]
        out = []
        for entries in handles.groups:
            layers = []
            for (shape, stride, offset, dtype, device, handle, size_bytes, offset_bytes, rc_handle, rc_offset,
                 ev_handle, ev_sync) in entries:
                layers.append(rebuild_cuda_tensor(
                    torch.Tensor, torch.Size(shape), tuple(stride), offset, torch.UntypedStorage,
                    getattr(torch, dtype), device, handle, size_bytes, offset_bytes, False, rc_handle, rc_offset,
                    ev_handle or None, ev_sync))
            out.append(layers)
        self._opened[key] = out
        return out


class InProcessChannel(IpcChannel):
    """CPU stand-in (tests): two engines in one process; a registry key stands for the handles."""

    _registry: dict[str, list[list[torch.Tensor]]] = {}

    def __init__(self) -> None:
        self._key: str | None = None

    def export_handles(self, block_io: KVBlockIO) -> IpcHandles:
        if self._key is None:
            self._key = f"inproc-{uuid.uuid4().hex}"
            InProcessChannel._registry[self._key] = [[t for t, _ in layers] for layers in block_io.layers]
        return IpcHandles(device_uuid=self._key, groups=[])

    def open_handles(self, handles: IpcHandles) -> list[list[torch.Tensor]]:
        try:
            return InProcessChannel._registry[handles.device_uuid]
        except KeyError:
            raise RuntimeError(f"no in-process KV memory registered as {handles.device_uuid}") from None
