"""NIXL transport (optional): the consumer READs the leased blocks straight into its own blocks.

NIXL (`nixl-cu13` on the package index; `pip install 'tandem-serve[nixl]'`) moves memory between
registered regions of two agents over UCX (RDMA where the hardware has it, shared memory or TCP
otherwise), CPU or GPU memory alike. Both engines register every paged-group layer tensor with an
agent of their own. The TCP KV connection carries the handshake: the consumer sends
`NixlHandshake(lease)`, the producer answers `NixlMemory` — its agent's metadata and, per layer,
where each block's chunks lie (`LayerRegion`) — and keeps the connection open, the lease pinned,
until the consumer closes it after the READ completed. A K/V layer's block is two contiguous
chunks (K and V), a latent layer's one; a READ names every chunk of every pulled block.

Unlike the TCP transport the data lands in the consumer's cache while the worker's steps run, so
a cancelled NIXL load is waited for (its READ completes into blocks that nobody reads yet) before
the worker acknowledges the cancellation: a cancelled load still never writes after its blocks
changed hands. No checksum: nothing is framed by us (NIXL/UCX own the wire).

`nixl_available()` says whether the package imports; an engine offers `nixl` only then.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import structlog
import torch

from tandem.engine_service.kv_connector.block_io import KVBlockIO
from tandem.engine_service.kv_connector.wire import LayerRegion, NixlMemory

log = structlog.get_logger(__name__)


def _nixl_module():
    try:
        import nixl_cu13 as nixl  # the CUDA 13 build on PyPI
    except ImportError:
        import nixl  # type: ignore[no-redef]  # other builds
    return nixl


def nixl_available() -> bool:
    try:
        _nixl_module()
        return True
    except Exception:  # noqa: BLE001 - a broken install is "not available", said in the log
        return False


def layer_regions(io: KVBlockIO) -> list[list[LayerRegion]]:
    """Per paged group, per layer: the region layout of this engine's cache tensors."""
    out = []
    for layers in io.layers:
        regions = []
        for t, dim in layers:
            el = t.element_size()
            if dim == 1:  # [2, blocks, ...]: K chunk then V chunk of each block
                regions.append(LayerRegion(t.data_ptr(), t.stride(1) * el, t.stride(0) * el, t.stride(1) * el, 2))
            else:  # [blocks, ...]
                regions.append(LayerRegion(t.data_ptr(), t.stride(0) * el, 0, t.stride(0) * el, 1))
        out.append(regions)
    return out


def chunk_descriptors(regions: list[LayerRegion], block_ids: list[int], device_id: int) -> np.ndarray:
    """Nx3 (address, length, device id) of every chunk of `block_ids` in every layer, in a fixed
    order (layer, chunk, block), so a local and a remote list pair up entry by entry."""
    rows = []
    ids = np.asarray(block_ids, dtype=np.int64)
    for r in regions:
        for c in range(r.num_chunks):
            addr = r.base + ids * r.block_stride + c * r.chunk_stride
            rows.append(np.stack([addr, np.full_like(addr, r.chunk_bytes), np.full_like(addr, device_id)], axis=1))
    if not rows:
        return np.zeros((0, 3), dtype=np.int64)
    return np.concatenate(rows, axis=0)  # (layer, chunk, block) order: the same on both sides


class NixlEndpoint:
    """One engine's NIXL agent with its cache tensors registered (producer and consumer alike).

    Invariants: the registered tensors live as long as the engine (they are the cache); a remote
    agent is added once per producer and reused; `read` returns only when the READ has ended.
    """

    def __init__(self, name: str, io: KVBlockIO) -> None:
        nixl = _nixl_module()
        self.io = io
        self.name = name
        self.agent = nixl.nixl_agent(name, nixl.nixl_agent_config(backends=["UCX"]))
        self.mem_type = "VRAM" if io.device.type == "cuda" else "DRAM"
        self.device_id = (io.device.index or 0) if io.device.type == "cuda" else 0
        for layers in io.layers:
            for t, _ in layers:
                self.agent.register_memory(t)
        self.regions = layer_regions(io)
        self._remotes: dict[bytes, str] = {}
        self._lock = threading.Lock()

    def memory(self) -> NixlMemory:
        """What a consumer needs to READ from this engine (the handshake's answer)."""
        return NixlMemory(agent_metadata=self.agent.get_agent_metadata(), device_id=self.device_id,
                          groups=self.regions)

    def read(self, remote_metadata: bytes, remote_device_id: int, remote_regions: list[list[LayerRegion]],
             remote_ids: list[list[int]], local_ids: list[list[int]], timeout_s: float) -> None:
        """READ blocks `remote_ids[g]` of the remote agent into `local_ids[g]` here; raises
        RuntimeError when the transfer fails or times out (after it has ended)."""
        with self._lock:
            agent_name = self._remotes.get(remote_metadata)
            if agent_name is None:
                agent_name = self.agent.add_remote_agent(remote_metadata)
                if isinstance(agent_name, bytes):
                    agent_name = agent_name.decode()
                self._remotes[remote_metadata] = agent_name
        if len(remote_regions) != len(self.regions):
            raise RuntimeError(f"producer has {len(remote_regions)} cache groups, this engine {len(self.regions)}")
        local_rows, remote_rows = [], []
        for g, (mine, theirs) in enumerate(zip(self.regions, remote_regions)):
            if len(mine) != len(theirs) or any(a.chunk_bytes != b.chunk_bytes or a.num_chunks != b.num_chunks
                                               for a, b in zip(mine, theirs)):
                raise RuntimeError(f"group {g}: the producer's layers differ from this engine's")
            local_rows.append(chunk_descriptors(mine, local_ids[g], self.device_id))
            remote_rows.append(chunk_descriptors(theirs, remote_ids[g], remote_device_id))
        local = np.concatenate(local_rows) if local_rows else np.zeros((0, 3), dtype=np.int64)
        remote = np.concatenate(remote_rows) if remote_rows else np.zeros((0, 3), dtype=np.int64)
        if len(local) == 0:
            return
        handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(local, self.mem_type),
                                            self.agent.get_xfer_descs(remote, self.mem_type), agent_name)
        try:
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + timeout_s
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"NIXL READ did not finish within {timeout_s:.0f} s")
                time.sleep(0.0002)
                state = self.agent.check_xfer_state(handle)
            if state == "ERR":
                raise RuntimeError("NIXL READ failed")
        finally:
            self.agent.release_xfer_handle(handle)
        if self.io.device.type == "cuda":
            torch.cuda.synchronize(self.io.device)
