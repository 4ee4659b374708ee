"""Connections to engine replicas and the choice of replica for each request.

Routing is least-in-flight among replicas whose readiness check passes. A replica that fails a
call with UNAVAILABLE, or whose health check fails, is taken out of rotation until its health
recovers, so a dead engine costs one failed call rather than a hang.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
import structlog
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.frontend.engine_mux import MuxChannel
from tandem.v1 import common_pb2, engine_pb2, engine_pb2_grpc

log = structlog.get_logger(__name__)

ENGINE_SERVICE = "tandem.v1.Engine"
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class NoEngineAvailable(RuntimeError):
    """No engine replica is ready to take a request (maps to UNAVAILABLE)."""


@dataclass
class EngineReplica:
    """One engine address: its channel, stubs, load and health."""

    address: str
    channel: grpc.aio.Channel
    stub: engine_pb2_grpc.EngineStub
    health: health_pb2_grpc.HealthStub
    in_flight: int = 0
    healthy: bool = False
    model_info: dict = field(default_factory=dict)
    mux: MuxChannel | None = None  # the multiplexed subscription, opened on first use

    def open_call(self, request: engine_pb2.EngineRequest, timeout: float | None, metadata, multiplexed: bool):
        """Starts one engine request: a per-request Stream call, or a call on the shared
        multiplexed subscription. Both iterate `EngineResponse`s and have `cancel()`."""
        if multiplexed:
            if self.mux is None:
                self.mux = MuxChannel(self.stub, self.address)
            return self.mux.call(request, timeout, metadata)
        return self.stub.Stream(request, timeout=timeout, metadata=metadata)

    async def utility(self, command: int, request_id: str = "", timeout: float = 10.0) -> dict:
        resp = await self.stub.Utility(
            common_pb2.UtilityRequest(command=command, request_id=request_id), timeout=timeout
        )
        return json_format.MessageToDict(resp.result)

    async def check(self, timeout: float = 2.0) -> bool:
        try:
            resp = await self.health.Check(health_pb2.HealthCheckRequest(service=ENGINE_SERVICE), timeout=timeout)
            self.healthy = resp.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            self.healthy = False
        return self.healthy


class EnginePool:
    """All engine replicas known to this frontend."""

    def __init__(self, addresses: list[str], channel_options: list | None = None, credentials=None,
                 interceptors: list | None = None, transport: str = "stream") -> None:
        """`credentials` secure the channels (TLS/mTLS); `interceptors` (asyncio client
        interceptors) add per-call metadata such as the engine's bearer token."""
        if not addresses:
            raise ValueError("at least one engine address is needed")
        if transport not in ("stream", "mux"):
            raise ValueError(f"unknown engine transport {transport!r} (stream or mux)")
        # "stream": one engine Stream call per choice; "mux": one Subscribe stream per replica.
        self.multiplexed = transport == "mux"
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.keepalive_time_ms", 20_000),
            ("grpc.keepalive_timeout_ms", 10_000),
        ] + list(channel_options or [])
        self.replicas: list[EngineReplica] = []
        for address in addresses:
            if credentials is not None:
                channel = grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)
            else:
                channel = grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
            self.replicas.append(
                EngineReplica(address, channel, engine_pb2_grpc.EngineStub(channel), health_pb2_grpc.HealthStub(channel))
            )
        self._monitor: asyncio.Task | None = None

    async def wait_ready(self, timeout: float = 600.0, poll: float = 0.25) -> None:
        """Waits until every replica is ready (or `timeout`), then reads their model info."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            states = await asyncio.gather(*(r.check() for r in self.replicas))
            if all(states):
                break
            if loop.time() > deadline:
                missing = [r.address for r in self.replicas if not r.healthy]
                raise TimeoutError(f"engine replicas not ready: {missing}")
            await asyncio.sleep(poll)
        for r in self.replicas:
            r.model_info = await r.utility(common_pb2.UTILITY_COMMAND_MODEL_INFO)

    def start_monitor(self, interval: float = 1.0) -> None:
        self._monitor = asyncio.ensure_future(self._watch(interval))

    async def _watch(self, interval: float) -> None:
        while True:
            await asyncio.gather(*(r.check() for r in self.replicas))
            await asyncio.sleep(interval)

    @property
    def any_healthy(self) -> bool:
        return any(r.healthy for r in self.replicas)

    def pick(self) -> EngineReplica:
        candidates = [r for r in self.replicas if r.healthy]
        if not candidates:
            raise NoEngineAvailable("no engine replica is ready")
        return min(candidates, key=lambda r: r.in_flight)

    def mark_failed(self, replica: EngineReplica) -> None:
        if replica.healthy:
            log.warning("engine_replica_unavailable", address=replica.address)
        replica.healthy = False

    async def close(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
        for r in self.replicas:
            if r.mux is not None:
                await r.mux.close()
        await asyncio.gather(*(r.channel.close() for r in self.replicas), return_exceptions=True)

    def limits_info(self) -> dict:
        """The most restrictive model limits across replicas (they serve the same model)."""
        infos = [r.model_info for r in self.replicas if r.model_info]
        if not infos:
            raise NoEngineAvailable("no engine replica reported its model")
        return {
            "vocab_size": int(min(i["vocab_size"] for i in infos)),
            "max_model_len": int(min(i["max_model_len"] for i in infos)),
            "kv_capacity_tokens": int(min(i["kv_blocks"] * i["block_size"] for i in infos)),
            "model": infos[0].get("model", ""),
        }
