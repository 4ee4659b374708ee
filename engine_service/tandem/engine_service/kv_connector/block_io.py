"""Reads and writes whole KV blocks of every paged cache group (the worker side's KV memory).

A block of paged group g, as it travels, is the bytes of that block in every layer of the group,
layer after layer in the group's `layer_ids` order: for a full or sliding-window attention layer
`kv[:, block]` (K then V, `[2, block_size, kv_heads, head_dim]`), for a latent layer
`latent[block]`. Both engines build the same layout from the same model, so equal `block_bytes`
is the handshake's sanity check (the consumer refuses a frame of another size).

State groups (per-request convolution/recurrent state of hybrid models) are not blocks: a
request's state slot travels as one more unit next to its blocks, read and written by the sibling
`state_io.StateSlotIO` (all state layers of one slot, in a fixed order; `remote_state_slot` in the
transfer parameters names the producer's slot). `KVBlockIO` covers the paged groups only.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from tandem.engine_service.cache.cache_spec import CacheLayout, FullAttentionSpec, LatentSpec
from tandem.engine_service.cache.cache_tensors import CacheTensors

# A pull's blocks leave the device in chunks of about this many bytes (at least one block): the
# next chunk's gather and device-to-host copy run while the current one is sent.
SEND_CHUNK_BYTES = 64 << 20
# Received blocks go to the device in chunks of about this many bytes (bounds the device staging).
WRITE_CHUNK_BYTES = 256 << 20


class KVBlockIO:
    """Gathers blocks of a paged group into bytes and scatters bytes back, over every layer.

    Invariants: `layers[g]` lists group g's cache tensors with the block dimension each has
    (1 for K/V tensors, 0 for latent ones); `block_bytes[g]` is the size of one block of group g
    across those layers; reads and writes touch only the named blocks.
    """

    def __init__(self, layout: CacheLayout, tensors: CacheTensors) -> None:
        if not layout.paged_groups:
            raise ValueError("KV transfer needs at least one paged cache group")
        self.layers: list[list[tuple[torch.Tensor, int]]] = []
        for group in layout.paged_groups:
            entries = []
            for layer in group.layer_ids:
                if isinstance(group.spec, FullAttentionSpec):
                    entries.append((tensors.kv_caches[layer], 1))
                elif isinstance(group.spec, LatentSpec):
                    entries.append((tensors.latent[layer], 0))
                else:  # pragma: no cover - a new paged spec kind must be taught here
                    raise TypeError(f"no block I/O for {type(group.spec).__name__}")
            self.layers.append(entries)
        self.block_bytes = [sum(_block_nbytes(t, dim) for t, dim in g) for g in self.layers]
        first = self.layers[0][0][0]
        self.device = first.device

    @property
    def num_groups(self) -> int:
        return len(self.layers)

    def gather_rows(self, group: int, block_ids: list[int]) -> torch.Tensor:
        """The named blocks of `group` as one `[n, block_bytes[group]]` uint8 tensor on the cache's
        device, row j = block `block_ids[j]` (every layer of the group, in order): each layer is
        gathered straight into its columns, so the blocks cross to the host (if at all) in one copy."""
        n = len(block_ids)
        rows = torch.empty((n, self.block_bytes[group]), dtype=torch.uint8, device=self.device)
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)  # every layer's index
        for t, dim, region in self._regions(group, rows):
            region.copy_(t.index_select(dim, idx).movedim(dim, 0))
        return rows

    def read_block_views(self, group: int, block_ids: list[int]) -> list[memoryview]:
        """Each named block of `group` as a read-only view of one host buffer (no copy per block)."""
        if not block_ids:
            return []
        host = self.gather_rows(group, block_ids).cpu().numpy()
        return [memoryview(host[j]).toreadonly() for j in range(len(block_ids))]

    def read_blocks(self, group: int, block_ids: list[int]) -> list[bytes]:
        """Each named block of `group` as bytes (every layer of the group, in order)."""
        return [bytes(v) for v in self.read_block_views(group, block_ids)]

    def iter_block_views(self, group: int, block_ids: list[int]) -> Iterator[memoryview]:
        """Each named block of `group` as a read-only host view, produced lazily (the pull server's
        reader): blocks leave the device in chunks of about `SEND_CHUNK_BYTES`; on CUDA each chunk
        is gathered and copied into pinned host memory asynchronously, one chunk ahead of the one
        being consumed, so the copies overlap the sending. A view stays valid while it is referenced."""
        if not block_ids:
            return
        per = max(1, SEND_CHUNK_BYTES // self.block_bytes[group])
        chunks = [block_ids[i:i + per] for i in range(0, len(block_ids), per)]
        staged = self._stage(group, chunks[0])
        for k in range(len(chunks)):
            host, ready = staged
            if k + 1 < len(chunks):
                staged = self._stage(group, chunks[k + 1])
            if ready is not None:
                ready.synchronize()
            rows = host.numpy()
            for j in range(rows.shape[0]):
                yield memoryview(rows[j]).toreadonly()

    def _stage(self, group: int, block_ids: list[int]) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """The blocks' rows on the host, and (CUDA) the event after which they are there."""
        rows = self.gather_rows(group, block_ids)
        if self.device.type != "cuda":
            return rows, None
        host = torch.empty(rows.shape, dtype=torch.uint8, pin_memory=True)
        host.copy_(rows, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))  # the cache's device, not this thread's default
        return host, ready

    def host_rows(self, group: int, n: int) -> torch.Tensor:
        """An uninitialised `[n, block_bytes[group]]` uint8 host tensor to receive blocks into
        (pinned when the cache is on CUDA, so `write_rows` copies it to the device asynchronously)."""
        pin = self.device.type == "cuda"
        return torch.empty((n, self.block_bytes[group]), dtype=torch.uint8, pin_memory=pin)

    def write_blocks(self, group: int, block_ids: list[int], data: list) -> None:
        """Write `data[j]` (bytes-like, from `read_blocks` on an engine with the same layout) into
        block `block_ids[j]` of every layer of `group`: one host buffer, one copy to the device,
        then each layer's columns scattered there."""
        if len(block_ids) != len(data):
            raise ValueError("one bytes object per block")
        if not block_ids:
            return
        size = self.block_bytes[group]
        for j, d in enumerate(data):
            if len(d) != size:
                raise ValueError(f"block {j} of group {group}: {len(d)} bytes, expected {size}")
        host = np.empty((len(data), size), dtype=np.uint8)
        for j, d in enumerate(data):
            host[j] = np.frombuffer(d, dtype=np.uint8)
        self.write_rows(group, block_ids, torch.from_numpy(host))

    def write_rows(self, group: int, block_ids: list[int], rows: torch.Tensor) -> None:
        """Write row j of the host `[n, block_bytes[group]]` uint8 tensor `rows` (`host_rows`)
        into block `block_ids[j]` of every layer of `group`: chunks of about `WRITE_CHUNK_BYTES`
        go to the device (asynchronously from pinned memory) and each layer's columns are
        scattered there, on the current stream."""
        if rows.shape != (len(block_ids), self.block_bytes[group]) or rows.dtype != torch.uint8:
            raise ValueError(f"rows {tuple(rows.shape)} {rows.dtype} for {len(block_ids)} blocks of "
                             f"{self.block_bytes[group]} bytes")
        per = max(1, WRITE_CHUNK_BYTES // self.block_bytes[group])
        for start in range(0, len(block_ids), per):
            chunk = rows[start:start + per].to(self.device, non_blocking=rows.is_pinned())
            idx = torch.tensor(block_ids[start:start + per], dtype=torch.long, device=self.device)
            for t, dim, region in self._regions(group, chunk):
                # The layer's columns made contiguous as bytes (row copies) before the scatter: much
                # cheaper on the CPU than an element-wise strided copy of the transposed view.
                block_major = region.view(torch.uint8).contiguous().view(t.dtype).view(region.shape)
                t.index_copy_(dim, idx, block_major.movedim(0, dim))

    def _regions(self, group: int, rows: torch.Tensor):
        """(layer tensor, its block dim, that layer's columns of `rows` viewed as `[n, *block shape]`
        in the layer's dtype) for every layer of `group`."""
        offset = 0
        for t, dim in self.layers[group]:
            nbytes = _block_nbytes(t, dim)
            shape = list(t.shape)
            del shape[dim]
            yield t, dim, rows[:, offset:offset + nbytes].view(t.dtype).view(rows.shape[0], *shape)
            offset += nbytes

    def copy_blocks_from(self, group: int, remote: list[torch.Tensor], remote_ids: list[int],
                         local_ids: list[int]) -> None:
        """Device copy: block `remote_ids[j]` of the remote layer tensors `remote` (the same
        group's layers on another engine, e.g. opened over CUDA IPC) into `local_ids[j]` here."""
        if len(remote) != len(self.layers[group]):
            raise ValueError(f"group {group}: {len(remote)} remote layers, {len(self.layers[group])} here")
        if not local_ids:
            return
        for (t, dim), r in zip(self.layers[group], remote):
            if r.shape[:dim] != t.shape[:dim] or r.shape[dim + 1:] != t.shape[dim + 1:] or r.dtype != t.dtype:
                raise ValueError(f"remote layer {tuple(r.shape)} {r.dtype} does not match {tuple(t.shape)} {t.dtype}")
        # Ids forming one ascending run are a view (`narrow`), not a gather: a run on both sides
        # is one copy per layer, a run on one side reads or writes in place (one pass over the
        # bytes instead of a gather into a temporary and a scatter out of it).
        r_run, l_run = _run_start(remote_ids), _run_start(local_ids)
        n = len(local_ids)
        ridx: dict[torch.device, torch.Tensor] = {}  # one index tensor per device, not per layer
        lidx = torch.tensor(local_ids, dtype=torch.long, device=self.device) if l_run is None else None
        for (t, dim), r in zip(self.layers[group], remote):
            if r_run is not None:
                src = r.narrow(dim, r_run, n)
            else:
                if r.device not in ridx:
                    ridx[r.device] = torch.tensor(remote_ids, dtype=torch.long, device=r.device)
                src = r.index_select(dim, ridx[r.device])
            src = src.to(t.device)
            if l_run is not None:
                t.narrow(dim, l_run, n).copy_(src)
            else:
                t.index_copy_(dim, lidx, src)


def _run_start(ids: list[int]) -> int | None:
    """The first id when `ids` is one ascending run (i, i+1, ...), else None."""
    first = ids[0]
    return first if ids == list(range(first, first + len(ids))) else None


def _block_nbytes(t: torch.Tensor, dim: int) -> int:
    return t.numel() // t.shape[dim] * t.element_size()
