"""Builds one engine's KV connector from its `KVTransferConfig`: the scheduler side, the worker
side (consumers) and the pull server (producers), and reports what it offers (GetModelInfo's `kv_transfer`)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import structlog

from tandem.engine_service.config import KVTransferConfig
from tandem.engine_service.cache.block_manager import BlockManager
from tandem.engine_service.kv_connector.auth import KVCredentials
from tandem.engine_service.kv_connector.block_io import KVBlockIO
from tandem.engine_service.kv_connector.cuda_ipc import CudaIpcChannel, IpcChannel
from tandem.engine_service.kv_connector.leases import LeaseTable
from tandem.engine_service.kv_connector.nixl_transport import NixlEndpoint, nixl_available
from tandem.engine_service.kv_connector.scheduler_side import KVConnectorScheduler, new_engine_id
from tandem.engine_service.kv_connector.state_io import StateSlotIO
from tandem.engine_service.kv_connector.tcp_transport import KVPullServer
from tandem.engine_service.kv_connector.worker_side import KVConnectorWorker

log = structlog.get_logger(__name__)


class _LazyNixl:
    """This engine's NIXL endpoint, made (agent created, cache registered) on first use."""

    def __init__(self, name: str, block_io: KVBlockIO) -> None:
        self._name, self._io = name, block_io
        self._endpoint: NixlEndpoint | None = None
        self._lock = threading.Lock()

    def __call__(self) -> NixlEndpoint:
        with self._lock:
            if self._endpoint is None:
                self._endpoint = NixlEndpoint(self._name, self._io)
            return self._endpoint


@dataclass
class KVConnector:
    """One engine's connector parts. `worker` exists on consumers, `server` on producers.

    Invariant: `scheduler.leases` is the table `server` pins and releases in.
    """

    config: KVTransferConfig
    engine_id: str
    scheduler: KVConnectorScheduler
    worker: KVConnectorWorker | None
    server: KVPullServer | None
    transports: tuple[str, ...]

    def info(self) -> dict[str, Any]:
        """The engine's KV transfer role as GetModelInfo and GetServerInfo report it."""
        address = f"{self.server.host}:{self.server.port}" if self.server is not None else None
        return {"role": self.config.role, "engine_id": self.engine_id, "transfer_address": address,
                "transports": list(self.transports), "lease_seconds": self.config.lease_seconds}

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.worker is not None:
            self.worker.close()


def build_kv_connector(config: KVTransferConfig, block_manager: BlockManager, runner,
                       ipc: IpcChannel | None = None) -> KVConnector | None:
    """The connector of an engine with a KV role (None for role `none`). `runner` provides the
    cache layout and tensors; `ipc` overrides the CUDA IPC channel (tests pass a CPU stand-in)."""
    if not config.enabled:
        return None
    block_io = KVBlockIO(runner.cache_layout, runner.cache_tensors)
    # Hybrid models: a request's state slot travels next to its blocks (one unit per request).
    state_io = (StateSlotIO(runner.cache_layout, runner.cache_tensors, block_manager.state_slots.num_slots)
                if block_manager.state_slots is not None else None)
    engine_id = config.engine_id or new_engine_id()
    if ipc is None and block_io.device.type == "cuda":
        ipc = CudaIpcChannel()
    has_nixl = nixl_available()
    transports = ("tcp",) + (("cuda_ipc",) if ipc is not None else ()) + (("nixl",) if has_nixl else ())
    nixl = _LazyNixl(engine_id, block_io) if has_nixl else None
    credentials = KVCredentials(tokens=config.auth_tokens, tls_cert=config.tls_cert, tls_key=config.tls_key,
                                tls_client_ca=config.tls_client_ca, tls_ca=config.tls_ca)
    leases = LeaseTable()
    server = None
    if config.is_producer:
        if config.transport not in transports:
            why = {"cuda_ipc": "the KV cache on a CUDA device", "nixl": "the nixl-cu13 package (pip install "
                   "'tandem-serve[nixl]')"}[config.transport]
            raise ValueError(f"--kv-transport {config.transport} needs {why}")
        host, port = config.host_port()
        export = (lambda: ipc.export_handles(block_io, state_io)) if ipc is not None else None
        # Every transport this engine has is served (a decode leg may ask for any of them); the
        # advertised one's NIXL registration happens now rather than during the first pull.
        nixl_export = (lambda: nixl().memory()) if nixl is not None else None
        if config.transport == "nixl" and nixl is not None:
            nixl()
        server = KVPullServer(host, port, leases, block_io.iter_block_views, ipc_export=export,
                              nixl_export=nixl_export,
                              read_state=state_io.read_slot if state_io is not None else None,
                              credentials=credentials).start()
    address = (server.host, server.port) if server is not None else None
    scheduler = KVConnectorScheduler(config, block_manager, engine_id, address, leases, transports)
    worker = (KVConnectorWorker(block_io, ipc, nixl=nixl, state_io=state_io, credentials=credentials)
              if config.is_consumer else None)
    log.info("kv_connector_ready", role=config.role, engine_id=engine_id, address=address, transports=transports,
             token_auth=bool(credentials.tokens), tls=credentials.tls, producers=config.producers or [])
    return KVConnector(config, engine_id, scheduler, worker, server, transports)
