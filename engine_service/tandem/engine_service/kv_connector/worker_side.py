"""The connector's worker side: runs the loads a step plan names and writes them into the cache.

`KVConnectorWorker.apply(metadata)` (each plan, before the step runs) cancels the loads the plan
cancels, releases the leases it names, then starts the new loads, each on a background thread
that only talks to the producer (TCP: receives and checks every block's bytes; CUDA IPC: the
handshake, opening the producer's tensors; for a hybrid model, TCP also receives the state slot
and CUDA IPC opens the producer's state tensors too; NIXL: the handshake and the READ into the local
blocks, waited for when cancelled; never asked for a load with state). `poll()` (right after `apply`, on the worker's
thread, before the step's forward) writes every finished load into the cache tensors (and its state into the request's slot) — so the
cache is only ever written by the thread that runs the model, in stream order with its steps,
and never for a load the same plan cancelled — and returns a `KVLoadReport`. A cancelled load's result is dropped unread:
its blocks may already belong to another request.

Invariants: a load id is in `_loads` from `apply` until `poll` reports it (finished or failed)
or it is cancelled; a finished load is reported only after its blocks are written; every load's
connection is closed by the time it leaves `_loads` (the producer releases the lease then).
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog
import torch

from tandem.engine_service.kv_connector.auth import KVCredentials
from tandem.engine_service.kv_connector.block_io import KVBlockIO
from tandem.engine_service.kv_connector.cuda_ipc import IpcChannel
from tandem.engine_service.kv_connector.metadata import KVConnectorMetadata, KVLoadReport, LoadSpec
from tandem.engine_service.kv_connector.nixl_transport import NixlEndpoint
from tandem.engine_service.kv_connector.state_io import StateSlotIO
from tandem.engine_service.kv_connector.tcp_transport import (
    TransferError,
    connect,
    num_parts,
    pull_parts,
    refusal,
    release_lease,
)
from tandem.engine_service.kv_connector.wire import (
    IpcHandles,
    IpcHandlesRequest,
    NixlHandshake,
    NixlMemory,
    PullError,
    WireError,
    frame_limit,
    recv_message,
    send_message,
)

log = structlog.get_logger(__name__)


@dataclass(eq=False)
class _Load:
    spec: LoadSpec
    started: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)
    sock: socket.socket | None = None
    more_socks: list[socket.socket] = field(default_factory=list)  # TCP: the pull's other parts' connections
    rows: list[torch.Tensor] | None = None  # TCP: per group, the pulled blocks' host rows
    state: bytes | None = None  # TCP: the pulled state slot (hybrid models)
    remote: list[list[torch.Tensor]] | None = None  # CUDA IPC: the producer's layer tensors
    remote_state: list[torch.Tensor] | None = None  # CUDA IPC: the producer's state tensors
    written: bool = False  # NIXL: the READ already put the blocks in place
    error: str | None = None
    refused: bool = False  # the producer refused what the request's parameters named
    ended: threading.Event = field(default_factory=threading.Event)  # the load thread is done

    def close(self) -> None:
        socks, self.sock, self.more_socks = [self.sock, *self.more_socks], None, []
        for sock in socks:
            if sock is None:
                continue
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


class KVConnectorWorker:
    """Starts, cancels and completes KV loads for one worker (see the module docstring)."""

    def __init__(self, block_io: KVBlockIO, ipc: IpcChannel | None = None, timeout_s: float = 60.0,
                 nixl: Callable[[], NixlEndpoint] | None = None, state_io: StateSlotIO | None = None,
                 credentials: KVCredentials | None = None) -> None:
        self.credentials = credentials or KVCredentials()
        self._tls = self.credentials.client_context()
        self.block_io = block_io
        self.state_io = state_io  # hybrid models: the request state slots' memory
        self.ipc = ipc
        self.nixl = nixl  # the consumer's NIXL endpoint, made on first use (None: no NIXL here)
        self.timeout_s = timeout_s
        self._loads: dict[str, _Load] = {}
        self._done: queue.Queue[_Load] = queue.Queue()
        self._ready: list[_Load] = []
        self.blocks_loaded = 0
        self.bytes_loaded = 0
        self.load_seconds = 0.0

    @property
    def num_loading(self) -> int:
        return len(self._loads)

    def apply(self, metadata: KVConnectorMetadata | None) -> None:
        if not metadata:
            return
        for rid in metadata.cancel_loads:
            load = self._loads.pop(rid, None)
            if load is not None:
                load.cancelled.set()
                if load.spec.transport == "nixl":
                    # A READ in flight writes into the request's blocks: let it end before they
                    # may change hands (the READ has its own timeout).
                    load.ended.wait(self.timeout_s + 5)
                load.close()
        for host, port, lease_id, secret in metadata.release_leases:
            threading.Thread(target=release_lease, args=(host, port, lease_id, secret, self.credentials),
                             name="tandem-kv-release", daemon=True).start()
        for spec in metadata.start_loads:
            if spec.request_id in self._loads:
                raise ValueError(f"a load for {spec.request_id} is already running")
            load = _Load(spec)
            self._loads[spec.request_id] = load
            threading.Thread(target=self._run, args=(load,), name="tandem-kv-load", daemon=True).start()

    def wait(self, timeout: float) -> bool:
        """Block up to `timeout` seconds for a load to complete; whether one did."""
        try:
            self._ready.append(self._done.get(timeout=timeout))
            return True
        except queue.Empty:
            return False

    def poll(self) -> KVLoadReport:
        """Write every completed load into the cache; report finished and failed ones."""
        report = KVLoadReport()
        while True:
            try:
                self._ready.append(self._done.get_nowait())
            except queue.Empty:
                break
        ready, self._ready = self._ready, []
        for load in ready:
            rid = load.spec.request_id
            if self._loads.get(rid) is not load:
                load.close()
                continue  # cancelled: its blocks are not its own any more
            del self._loads[rid]
            try:
                if load.error is None:
                    n_bytes = self._write(load)
                    report.finished.append(rid)
                    report.blocks_loaded += load.spec.num_blocks
                    report.bytes_loaded += n_bytes
                    report.seconds += time.perf_counter() - load.started
                else:
                    report.failed[rid] = load.error
                    if load.refused:
                        report.refused.append(rid)
            except Exception as exc:  # a write that fails fails the request, not the engine
                log.warning("kv_load_write_failed", request_id=rid, error=str(exc))
                report.failed[rid] = f"KV load could not be written: {exc}"
                report.write_failed.append(rid)
            finally:
                load.close()
        self.blocks_loaded += report.blocks_loaded
        self.bytes_loaded += report.bytes_loaded
        self.load_seconds += report.seconds
        return report

    def close(self) -> None:
        for load in self._loads.values():
            load.cancelled.set()
            load.close()
        self._loads.clear()

    # -- worker thread: writes ------------------------------------------------------------------
    def _write(self, load: _Load) -> int:
        spec, io = load.spec, self.block_io
        n_bytes = 0
        for g, local in enumerate(spec.local_block_ids):
            if load.written:
                pass
            elif load.remote is not None:
                io.copy_blocks_from(g, load.remote[g], spec.remote_block_ids[g], local)
            else:
                assert load.rows is not None
                io.write_rows(g, local, load.rows[g])
            n_bytes += len(local) * io.block_bytes[g]
        if spec.local_state_slot is not None:
            n_bytes += self._write_state(load)
        if load.remote is not None and io.device.type == "cuda":
            torch.cuda.current_stream(io.device).synchronize()  # before the lease is released
        return n_bytes

    def _write_state(self, load: _Load) -> int:
        spec, sio = load.spec, self.state_io
        if sio is None:
            raise RuntimeError("a load with a state slot on an engine without state groups")
        assert spec.local_state_slot is not None and spec.remote_state_slot is not None
        if load.remote is not None:
            if load.remote_state is None:
                raise RuntimeError("the producer exported no state tensors")
            sio.copy_slot_from(load.remote_state, spec.remote_state_slot, spec.local_state_slot)
        else:
            if load.state is None:
                raise RuntimeError("the pull brought no state")
            sio.write_slot(spec.local_state_slot, load.state)
        return sio.slot_bytes

    # -- load threads: talk to the producer -----------------------------------------------------
    def _run(self, load: _Load) -> None:
        spec = load.spec
        try:
            load.sock = connect(spec.remote_host, spec.remote_port, self.timeout_s, self._tls)
            load.sock.settimeout(self.timeout_s)
            if load.cancelled.is_set():
                return
            if spec.transport == "cuda_ipc":
                load.remote = self._open_ipc(load)
            elif spec.transport == "nixl":
                if spec.remote_state_slot is not None:
                    raise TransferError("NIXL does not move state slots (the scheduler picks TCP for them)")
                self._read_nixl(load)
                load.written = True
                load.close()
            else:
                state_bytes = self.state_io.slot_bytes if self.state_io is not None else 0
                if spec.remote_state_slot is not None and self.state_io is None:
                    raise TransferError("this engine has no state groups to write the producer's state into")
                # Received straight into host rows (pinned on CUDA) that `_write` copies to the device;
                # a large pull in parts over several connections at once.
                rows = [self.block_io.host_rows(g, len(ids)) for g, ids in enumerate(spec.remote_block_ids)]
                for _ in range(num_parts(spec.remote_block_ids, self.block_io.block_bytes) - 1):
                    load.more_socks.append(connect(spec.remote_host, spec.remote_port, self.timeout_s, self._tls))
                    load.more_socks[-1].settimeout(self.timeout_s)
                if load.cancelled.is_set():
                    return
                pulled = pull_parts([load.sock, *load.more_socks], spec.lease_id, spec.remote_block_ids,
                                    self.block_io.block_bytes, spec.remote_state_slot, state_bytes,
                                    rows=[r.numpy() for r in rows], token=self.credentials.token,
                                    lease_secret=spec.lease_secret, prompt_digest=spec.prompt_digest)
                load.rows, load.state = rows, pulled.state
                load.close()  # the producer releases the lease as soon as the pull is complete
        except TransferError as exc:
            load.error = f"KV transfer from {spec.remote_engine_id} failed: {exc}"
            load.refused = exc.kind == "refused"
        except Exception as exc:  # never let a load thread die silently
            load.error = f"KV transfer from {spec.remote_engine_id} failed: {type(exc).__name__}: {exc}"
        finally:
            if load.cancelled.is_set():
                load.close()
            if load.error is not None:
                load.close()
                log.warning("kv_load_failed", request_id=spec.request_id, error=load.error)
            load.ended.set()
            self._done.put(load)

    def _handshake(self, load: _Load, request, expected: type, name: str):
        assert load.sock is not None
        try:
            send_message(load.sock, request)
            # Handles and NIXL metadata are small; a larger frame is not a handshake answer.
            msg = recv_message(load.sock, frame_limit(1 << 20))
        except (OSError, WireError) as exc:
            raise TransferError(f"{name} handshake failed: {exc}") from None
        if isinstance(msg, PullError):
            raise refusal(msg)
        if not isinstance(msg, expected):
            raise TransferError(f"unexpected {type(msg).__name__} in a {name} handshake")
        return msg

    def _auth(self, spec: LoadSpec) -> dict[str, str]:
        return {"lease_id": spec.lease_id, "token": self.credentials.token, "lease_secret": spec.lease_secret,
                "prompt_digest": spec.prompt_digest}

    def _read_nixl(self, load: _Load) -> None:
        if self.nixl is None:
            raise TransferError("NIXL is not installed on this engine")
        memory: NixlMemory = self._handshake(load, NixlHandshake(**self._auth(load.spec)), NixlMemory, "NIXL")
        try:
            self.nixl().read(memory.agent_metadata, memory.device_id, memory.groups, load.spec.remote_block_ids,
                             load.spec.local_block_ids, self.timeout_s)
        except RuntimeError as exc:
            raise TransferError(str(exc)) from None

    def _open_ipc(self, load: _Load) -> list[list[torch.Tensor]]:
        if self.ipc is None:
            raise TransferError("this engine has no CUDA IPC channel")
        msg = self._handshake(load, IpcHandlesRequest(**self._auth(load.spec)), IpcHandles, "CUDA IPC")
        remote = self.ipc.open_handles(msg)
        if len(remote) != self.block_io.num_groups:
            raise TransferError(f"producer has {len(remote)} cache groups, this engine {self.block_io.num_groups}")
        if load.spec.remote_state_slot is not None:
            state = self.ipc.open_state(msg)
            here = len(self.state_io.tensors) if self.state_io is not None else 0
            if len(state) != here:
                raise TransferError(f"producer exported {len(state)} state tensors, this engine has {here}")
            assert self.state_io is not None
            slot = load.spec.remote_state_slot
            for r, t in zip(state, self.state_io.tensors):
                if r.shape[1:] != t.shape[1:] or r.dtype != t.dtype or not 0 <= slot < r.shape[0]:
                    raise TransferError(f"producer state tensor {tuple(r.shape)} {r.dtype} (slot {slot}) does not "
                                        f"match this engine's {tuple(t.shape)} {t.dtype}")
            load.remote_state = state
        return remote
