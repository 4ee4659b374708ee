"""Connections to engine replicas and the choice of replica for each request.

Routing is least-in-flight among replicas whose readiness check passes. A replica that fails a
call with UNAVAILABLE, or whose health check fails, is taken out of rotation until its health
recovers, so a dead engine costs one failed call rather than a hang. The frontend is ready as
soon as one replica is (readiness quorum of one); the monitor keeps probing the others, and
each joins the rotation when it first passes and its model matches.

Replicas may also come from DNS names (`dns:///name:port`, `engine_discovery.py`), resolved at
start and then every `resolve_interval` seconds by the monitor: an address that appears becomes
a replica (it joins as any other, once healthy and matching); one that disappears is drained: it
takes no new request, and once nothing is in flight on it (checked from the next round on, so
a request that picked it just before is counted) its channel is closed and it leaves the pool.
A failed lookup keeps the name's previous addresses.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc
import structlog
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.frontend.engine_discovery import EngineName, Resolver, engine_address, parse_engine_name, resolve_name
from tandem.frontend.engine_mux import MuxChannel
from tandem.frontend.rpc_error import rpc_error
from tandem.v1 import common_pb2, engine_pb2, engine_pb2_grpc

log = structlog.get_logger(__name__)

ENGINE_SERVICE = "tandem.v1.Engine"
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class NoEngineAvailable(RuntimeError):
    """No engine replica is ready to take a request (maps to UNAVAILABLE)."""


@dataclass(frozen=True)
class PoolLimits:
    """The strictest limits over the replicas that reported their model (GetModelInfo's
    integers, as they came): every request is judged by these."""

    model: str
    vocab_size: int
    max_model_len: int
    kv_capacity_tokens: int


@dataclass
class EngineReplica:
    """One engine address: its channel, stubs, load and health."""

    address: str
    channel: grpc.aio.Channel
    stub: engine_pb2_grpc.EngineStub
    health: health_pb2_grpc.HealthStub
    in_flight: int = 0
    healthy: bool = False
    model_info: engine_pb2.EngineModelInfo | None = None  # its GetModelInfo answer, once read
    mux: MuxChannel | None = None  # the multiplexed subscription, opened on first use
    draining: bool = False  # its DNS name no longer lists it: no new requests, closed when idle

    @property
    def routable(self) -> bool:
        """Requests may go here: it answers health checks, its model was read, it is not draining."""
        return self.healthy and self.model_info is not None and not self.draining

    def open_call(self, request: engine_pb2.EngineRequest, timeout: float | None, metadata, multiplexed: bool):
        """Starts one engine request: a per-request Stream call, or a call on the shared
        multiplexed subscription. Both iterate `EngineResponse`s and have `cancel()`."""
        if multiplexed:
            if self.mux is None:
                self.mux = MuxChannel(self.stub, self.address)
            return self.mux.call(request, timeout, metadata)
        return self.stub.Stream(request, timeout=timeout, metadata=metadata)

    async def utility(self, command: int, request_id: str = "", timeout: float = 10.0) -> dict:
        """The engine's Utility answer. A replica the pool closed after the caller listed it (its
        name stopped listing it while a STATS round went over the replicas) raises UNAVAILABLE,
        as an unreachable engine does, rather than grpc's UsageError."""
        try:
            resp = await self.stub.Utility(
                common_pb2.UtilityRequest(command=command, request_id=request_id), timeout=timeout
            )
        except grpc.aio.UsageError:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE,
                            f"engine {self.address} left the pool (its channel is closed)") from None
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
                 interceptors: list | None = None, transport: str = "stream", resolve: Resolver | None = None,
                 resolve_interval: float = 5.0) -> None:
        """`addresses` are `host:port` addresses and `dns:///name:port` names; `resolve` looks a
        name up (default `engine_discovery.resolve_name`), again every `resolve_interval`
        seconds. `credentials` secure the channels (TLS/mTLS); `interceptors` (asyncio client
        interceptors) add per-call metadata such as the engine's bearer token."""
        if not addresses:
            raise ValueError("at least one engine address is needed")
        if transport not in ("stream", "mux"):
            raise ValueError(f"unknown engine transport {transport!r} (stream or mux)")
        # "stream": one engine Stream call per choice; "mux": one Subscribe stream per replica.
        self.multiplexed = transport == "mux"
        self._channel_options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.keepalive_time_ms", 20_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            # A replica that was down is re-dialled at least every 5 s (gRPC's default backoff
            # grows to 120 s), so it rejoins the rotation soon after it comes up.
            ("grpc.initial_reconnect_backoff_ms", 500),
            ("grpc.max_reconnect_backoff_ms", 5_000),
        ] + list(channel_options or [])
        self._credentials, self._interceptors = credentials, interceptors
        self.names: list[EngineName] = []
        self.replicas: list[EngineReplica] = []
        for target in addresses:
            name = parse_engine_name(target)
            if name is not None:
                self.names.append(name)
            elif target not in (r.address for r in self.replicas):
                self.replicas.append(self._new_replica(target))
        self._static = {r.address for r in self.replicas}  # given as addresses: never drained
        self._resolve = resolve or resolve_name
        self.resolve_interval = resolve_interval
        self._resolved: dict[EngineName, list[str]] = {}  # each name's addresses at its last good lookup
        self._next_resolve = 0.0
        self._monitor: asyncio.Task | None = None
        # The limits the frontend was set up with (from the replicas ready at start); a replica
        # joining later must match them.
        self._reference: PoolLimits | None = None
        self._incompatible: set[str] = set()

    def _new_replica(self, address: str) -> EngineReplica:
        kwargs = {"options": self._channel_options, "interceptors": self._interceptors}
        if self._credentials is not None:
            channel = grpc.aio.secure_channel(address, self._credentials, **kwargs)
        else:
            channel = grpc.aio.insecure_channel(address, **kwargs)
        return EngineReplica(address, channel, engine_pb2_grpc.EngineStub(channel), health_pb2_grpc.HealthStub(channel))

    async def refresh(self) -> None:
        """Looks every name up once: new addresses become replicas, addresses no name lists any
        more (and that were not given as addresses) start draining, returning ones stop."""
        if not self.names:
            return
        for name in self.names:
            try:
                self._resolved[name] = [engine_address(ip, name.port) for ip in await self._resolve(name.host, name.port)]
            except OSError as exc:  # keep what the last good lookup said
                log.warning("engine_name_lookup_failed", name=str(name), error=str(exc))
        listed = {a for addresses in self._resolved.values() for a in addresses}
        replicas = list(self.replicas)
        known = {r.address: r for r in replicas}
        for address in sorted(listed - known.keys()):
            log.info("engine_discovered", address=address)
            replicas.append(self._new_replica(address))
        for r in replicas:
            if r.address in listed and r.draining:
                log.info("engine_listed_again", address=r.address)
                r.draining = False
            elif r.address not in listed and r.address not in self._static and not r.draining:
                log.info("engine_draining", address=r.address, reason="its name no longer lists it",
                         in_flight=r.in_flight)
                r.draining = True
        self.replicas = replicas

    async def _maybe_refresh(self) -> None:
        now = asyncio.get_running_loop().time()
        if self.names and now >= self._next_resolve:
            self._next_resolve = now + self.resolve_interval
            await self.refresh()

    async def _reap(self, drained: set[str]) -> None:
        """Closes and drops the replicas in `drained` (draining since the last round) that have
        nothing in flight."""
        gone = [r for r in self.replicas if r.draining and r.address in drained and r.in_flight == 0]
        if not gone:
            return
        self.replicas = [r for r in self.replicas if r not in gone]
        for r in gone:
            log.info("engine_removed", address=r.address)
            if r.mux is not None:
                await r.mux.close()
            await r.channel.close()

    async def wait_ready(self, timeout: float = 600.0, poll: float = 0.25) -> None:
        """Waits until at least one replica is ready (a quorum of one: the frontend can serve),
        or raises TimeoutError after `timeout`; reads the ready replicas' model info. The others
        keep being probed by the monitor (`start_monitor`) and join when they pass."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            await self._maybe_refresh()
            states = await asyncio.gather(*(r.check() for r in self.replicas if not r.draining))
            if any(states):
                break
            if loop.time() > deadline:
                names = [str(n) for n in self.names]
                raise TimeoutError(f"no engine replica ready after {timeout:.0f}s: "
                                   f"{[r.address for r in self.replicas] + names}")
            await asyncio.sleep(poll)
        for r in self.replicas:
            if r.healthy:
                await self._learn_model(r)
        if not any(r.model_info is not None for r in self.replicas):
            raise NoEngineAvailable("no ready engine replica reported its model")
        self._reference = self.limits_info()
        missing = [r.address for r in self.replicas if r.model_info is None]
        if missing:
            log.warning("engine_replicas_not_ready_yet",
                        ready=[r.address for r in self.replicas if r.model_info is not None], waiting=missing)

    async def _learn_model(self, replica: EngineReplica) -> None:
        """Reads a replica's model info; one that serves a different model or a smaller context
        than the frontend was set up with stays out of rotation."""
        try:
            info = await replica.stub.GetModelInfo(engine_pb2.EngineModelInfoRequest(), timeout=10.0)
        except grpc.aio.AioRpcError as exc:
            log.warning("engine_model_info_failed", address=replica.address, code=exc.code().name)
            replica.healthy = False
            return
        ref = self._reference
        if ref is not None and (info.model != ref.model or info.vocab_size != ref.vocab_size
                                or info.max_model_len < ref.max_model_len
                                or info.kv_capacity_tokens < ref.kv_capacity_tokens):
            log.warning("engine_replica_incompatible", address=replica.address, model=info.model)
            self._incompatible.add(replica.address)  # never routed to; not asked again
            return
        replica.model_info = info
        if ref is not None:
            log.info("engine_replica_joined", address=replica.address)

    def start_monitor(self, interval: float = 1.0) -> None:
        self._monitor = asyncio.ensure_future(self._watch(interval))

    async def _watch(self, interval: float) -> None:
        while True:
            await self.probe()
            await asyncio.sleep(interval)

    async def probe(self) -> None:
        """One round: the names looked up when due, draining replicas with nothing in flight
        closed, health checks; a replica ready for the first time has its model read."""
        drained = {r.address for r in self.replicas if r.draining}
        await self._maybe_refresh()
        await self._reap(drained)
        await asyncio.gather(*(r.check() for r in self.replicas))
        for r in self.replicas:
            if r.healthy and r.model_info is None and r.address not in self._incompatible:
                await self._learn_model(r)

    @property
    def any_healthy(self) -> bool:
        return any(r.routable for r in self.replicas)

    def pick(self) -> EngineReplica:
        candidates = [r for r in self.replicas if r.routable]
        if not candidates:
            raise NoEngineAvailable("no engine replica is ready")
        return min(candidates, key=lambda r: r.in_flight)

    def mark_failed(self, replica: EngineReplica) -> None:
        if replica.healthy:
            log.warning("engine_replica_unavailable", address=replica.address)
        replica.healthy = False

    def stopping(self) -> None:
        """The frontend drains: engines stopping alongside it (as under `tandem serve`) are expected."""
        for r in self.replicas:
            if r.mux is not None:
                r.mux.stopping()

    async def close(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
        for r in self.replicas:
            if r.mux is not None:
                await r.mux.close()
        await asyncio.gather(*(r.channel.close() for r in self.replicas), return_exceptions=True)

    def reporting_model_info(self) -> engine_pb2.EngineModelInfo:
        """A replica's GetModelInfo answer (every replica serves the same model)."""
        info = next((r.model_info for r in self.replicas if r.model_info is not None), None)
        if info is None:
            raise NoEngineAvailable("no engine replica reported its model")
        return info

    def limits_info(self) -> PoolLimits:
        """The most restrictive model limits across replicas (they serve the same model)."""
        infos = [r.model_info for r in self.replicas if r.model_info is not None]
        if not infos:
            raise NoEngineAvailable("no engine replica reported its model")
        return PoolLimits(
            model=infos[0].model,
            vocab_size=min(i.vocab_size for i in infos),
            max_model_len=min(i.max_model_len for i in infos),
            kv_capacity_tokens=min(i.kv_capacity_tokens for i in infos),
        )
