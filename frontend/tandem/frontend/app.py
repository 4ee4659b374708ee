"""Frontend process entry point: connect to engines, load the tokenizer, serve, drain, exit."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import structlog
from grpc_health.v1 import health_pb2

from tandem.cli_options import DEFAULT_ENGINE_ADDRESS, FrontendServingArgs, MetricsArgs, ServerArgs, TracingArgs
from tandem.frontend.abort_relay import AbortRelay, socket_address
from tandem.frontend.disaggregation import DisaggregatedPools
from tandem.frontend.engine_pool import EnginePool
from tandem.frontend.metrics import FrontendMetrics
from tandem.frontend.request_builder import RequestBuilder
from tandem.frontend.request_ids import RequestIdMap
from tandem.frontend.server import SERVICE_NAME, FrontendServicer
from tandem.frontend.tokenize_pool import TokenizePool
from tandem.frontend.tokenizer import TextTokenizer
from tandem.grpc_service import add_service, enable_reflection
from tandem.health import add_health
from tandem.metrics import new_registry, start_metrics_endpoint
from tandem.proto_wire import Limits
from tandem.security import SecurityOptions, add_port
from tandem.shutdown import StopSignals
from tandem.tracing import Tracing
from tandem.v1 import engine_pb2, frontend_pb2

log = structlog.get_logger(__name__)

MAX_MESSAGE_BYTES = 16 * 1024 * 1024


@dataclass
class FrontendOptions(ServerArgs, FrontendServingArgs, MetricsArgs, TracingArgs):
    """Everything `serve_frontend` needs, validated by the CLI that builds it.

    The settings that are flags (address, request defaults, reflection, tokenizer, served name,
    engine transport, metrics, tracing) are the fields of the `tandem.cli_options` classes it
    extends, declared there once; the CLI fills them with `tandem.options.from_args`. A `metrics_host` of
    None binds the service's own `host`; a `tokenizer` of None loads the engine's model directory.
    The fields below are what the CLI resolves (engine lists, credentials) or the worker
    launcher sets.
    """

    engines: list[str] = field(default_factory=lambda: [DEFAULT_ENGINE_ADDRESS])
    engine_resolve_interval: float = 5.0  # seconds between lookups of `dns:///` engine names
    engine_wait_timeout: float = 900.0
    security: SecurityOptions = field(default_factory=SecurityOptions)  # clients → frontend (server side)
    engine_security: SecurityOptions = field(default_factory=SecurityOptions)  # frontend → engines (client side)
    tokenizer_workers: int = 2  # threads tokenizing prompts, each with its own tokenizer
    max_pending_tokenize: int = 256  # prompts queued for those threads before RESOURCE_EXHAUSTED
    listen_when_ready: bool = False  # extra workers on a shared port listen only once ready
    # Disaggregated prefill/decode: both set (they replace `engines`), every request runs a
    # prefill leg on one of `prefill_engines` and a decode leg on one of `decode_engines`.
    prefill_engines: list[str] = field(default_factory=list)
    decode_engines: list[str] = field(default_factory=list)
    # Several workers on one port (`tandem/frontend/workers.py`): this one's index and their count, and
    # the private folder of their relay sockets (an ABORT reaching the wrong worker is relayed).
    relay_dir: str | None = None
    worker_index: int = 0
    num_workers: int = 1

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill_engines and self.decode_engines)


def _engine_pool(options: FrontendOptions, addresses: list[str]) -> EnginePool:
    engine_security = options.engine_security
    return EnginePool(addresses, channel_options=engine_security.channel_options(),
                      credentials=engine_security.channel_credentials(),
                      interceptors=engine_security.aio_client_interceptors(),
                      transport=options.engine_transport, resolve_interval=options.engine_resolve_interval)


def engine_default_max_tokens(model_info: engine_pb2.EngineModelInfo, fallback: int) -> int:
    """The max_tokens an engine gives a request that sets none, as its GetModelInfo reports it
    (its generation config's, else its --default-max-tokens); `fallback` (the frontend's own
    --default-max-tokens) for an engine that reports none. The frontend validates with it, so a
    request is judged by the value the engine will use, and the disaggregated legs split it."""
    defaults = model_info.sampling_defaults
    return defaults.max_tokens if defaults.HasField("max_tokens") and defaults.max_tokens > 0 else fallback


async def build_request_builder(options: FrontendOptions, pool: EnginePool,
                                disaggregated: DisaggregatedPools | None = None) -> RequestBuilder:
    """Waits for the engines (both pools when disaggregated), then loads the tokenizer and the
    model's limits (the stricter of the two pools')."""
    pools = disaggregated if disaggregated is not None else pool
    await pools.wait_ready(timeout=options.engine_wait_timeout)
    limits_info = pools.limits_info()
    reported = pool.reporting_model_info()
    # The engine reports its model's directory, or for dummy weights a tokenizer made to fit.
    path = options.tokenizer or reported.tokenizer_path or reported.model_path
    if not path:
        raise RuntimeError(f"the engine reports no tokenizer for {reported.model!r}: pass "
                           f"--tokenizer DIR (a directory with tokenizer.json or tokenizer_config.json)")
    loop = asyncio.get_running_loop()
    tokenizer = await loop.run_in_executor(None, TextTokenizer.from_pretrained, path)
    await loop.run_in_executor(None, lambda: tokenizer.max_token_bytes)  # ~1 s, computed once, off the loop
    limits = Limits(
        vocab_size=limits_info.vocab_size,
        max_model_len=limits_info.max_model_len,
        default_max_tokens=engine_default_max_tokens(reported, options.default_max_tokens),
        kv_capacity_tokens=limits_info.kv_capacity_tokens,
    )
    name = options.served_model_name or limits_info.model
    return RequestBuilder(tokenizer, limits, name, aliases=(str(path),))


async def attach_builder(servicer: FrontendServicer, options: FrontendOptions, pool: EnginePool) -> None:
    """Loads what the request path needs (off the event loop) and starts serving requests."""
    builder = await build_request_builder(options, pool, servicer.disaggregated)
    loop = asyncio.get_running_loop()
    tokenize_pool = await loop.run_in_executor(None, TokenizePool, builder.tokenizer, options.tokenizer_workers,
                                               options.max_pending_tokenize)
    servicer.attach(builder, tokenize_pool)


async def serve_frontend(options: FrontendOptions, ready: asyncio.Event | None = None,
                         on_stop: Callable[[], None] | None = None,
                         on_force: Callable[[], None] | None = None) -> int:
    """Serves until SIGTERM/SIGINT, then drains (`tandem.shutdown`); `on_stop` runs when the
    signal arrives (it lets extra frontend workers start draining at the same moment), and
    `on_force` when a second one ends the drain at once. The spans still batched are sent before
    it returns."""
    tracing = Tracing.start(options.otlp_endpoint, options.service_name("frontend"))
    try:
        return await _serve_frontend(options, ready, on_stop, on_force, tracing)
    finally:
        tracing.shutdown()


async def _serve_frontend(options: FrontendOptions, ready: asyncio.Event | None,
                          on_stop: Callable[[], None] | None, on_force: Callable[[], None] | None,
                          tracing: Tracing) -> int:
    server = grpc.aio.server(
        interceptors=options.security.server_interceptors(),
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.keepalive_time_ms", 20_000),
            ("grpc.http2.max_pings_without_data", 0),
        ]
    )
    health = await add_health(server, SERVICE_NAME)
    engine_security = options.engine_security
    disaggregated = None
    if options.disaggregated:
        disaggregated = DisaggregatedPools(_engine_pool(options, options.prefill_engines),
                                           _engine_pool(options, options.decode_engines))
        pool = disaggregated.prefill
    else:
        pool = _engine_pool(options, options.engines)
    engine_addresses = options.prefill_engines + options.decode_engines if disaggregated else options.engines
    registry = new_registry()
    relay = None
    if options.relay_dir is not None and options.num_workers > 1:
        relay = AbortRelay(options.relay_dir, options.worker_index, options.num_workers)
    servicer = FrontendServicer(pool, RequestIdMap(), FrontendMetrics(disaggregated or pool, registry),
                                access=options.security.access_policy(), disaggregated=disaggregated, relay=relay,
                                trust_kv_callers=options.trust_kv_callers, worker_index=options.worker_index,
                                num_workers=options.num_workers, tracer=tracing.tracer)
    metrics_host = options.metrics_host if options.metrics_host is not None else options.host
    metrics_endpoint = (
        start_metrics_endpoint(registry, metrics_host, options.metrics_port)
        if options.metrics_port is not None else None
    )
    add_service(server, servicer, frontend_pb2.DESCRIPTOR.services_by_name["Frontend"])
    if options.enable_reflection:
        enable_reflection(server, [frontend_pb2.DESCRIPTOR.services_by_name["Frontend"].full_name])
    if options.listen_when_ready:
        # An extra worker on a shared port: the kernel would hand it connections at once, so it
        # listens only once it can serve (the first worker answers health meanwhile).
        await attach_builder(servicer, options, pool)
    bound = add_port(server, f"{options.host}:{options.port}", options.security)
    if bound == 0:
        raise RuntimeError(f"cannot bind {options.host}:{options.port}")
    if relay is not None:  # the siblings' relayed ABORTs (plaintext, in the parent's 0700 folder)
        server.add_insecure_port(socket_address(options.relay_dir, options.worker_index))
    await server.start()
    log.info("frontend_listening", address=f"{options.host}:{bound}", engines=engine_addresses,
             disaggregated=disaggregated is not None,
             **options.security.summary("server"), engine_link=engine_security.summary("client"))
    options.security.warn_if_weak("server", options.host)
    engine_security.warn_if_weak("client", engine_addresses[0].rsplit(":", 1)[0])
    http_runner = None
    if options.http_port is not None:
        from tandem.frontend.http_server import start_http  # aiohttp only when the HTTP face is on

        http_runner, http_bound = await start_http(servicer, options.host, options.http_port, options.security,
                                                   reuse_port=options.num_workers > 1)
        log.info("frontend_http_listening", address=f"{options.host}:{http_bound}")
    if servicer.builder is None:
        await attach_builder(servicer, options, pool)
    (disaggregated or pool).start_monitor()
    await health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    log.info("frontend_ready")
    if ready is not None:
        ready.set()

    signals = StopSignals(on_stop=on_stop, on_force=on_force)
    signals.install()
    await signals.stop.wait()
    (disaggregated or pool).stopping()
    await health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
    servicer.accepting = False
    await signals.drain(lambda: len(servicer.ids), options.drain_timeout)
    await health.enter_graceful_shutdown()
    if http_runner is not None:
        await http_runner.cleanup()
    await server.stop(grace=0 if signals.force.is_set() else 2.0)
    await (disaggregated or pool).close()
    if relay is not None:
        await relay.close()
    servicer.close()
    if metrics_endpoint is not None:
        metrics_endpoint.close()
    log.info("frontend_stopped")
    return 130 if signals.force.is_set() else 0


def run_frontend(options: FrontendOptions, on_stop: Callable[[], None] | None = None,
                 on_ready: Callable[[], None] | None = None, on_force: Callable[[], None] | None = None) -> int:
    """`on_ready` runs once the frontend serves (its engines ready) and handles its signals.
    Returns 0 after a drain, 130 when a second signal cut it short."""
    if on_ready is None:
        return asyncio.run(serve_frontend(options, on_stop=on_stop, on_force=on_force))

    async def main() -> int:
        ready = asyncio.Event()
        serving = asyncio.ensure_future(serve_frontend(options, ready=ready, on_stop=on_stop, on_force=on_force))
        waiting = asyncio.ensure_future(ready.wait())
        await asyncio.wait([serving, waiting], return_when=asyncio.FIRST_COMPLETED)
        if ready.is_set():
            await asyncio.sleep(0)  # serve_frontend installs its signal handlers first
            on_ready()
        else:
            waiting.cancel()
        return await serving

    return asyncio.run(main())
