"""Engine service entry point: start the gRPC server, start the engine core, serve, drain, exit.

The engine core runs in its own process by default (`engine_core="process"`: this process then
never imports torch) or on a thread of this one (`"thread"`). Health answers from the first
moment (NOT_SERVING while the model loads), so orchestrators can tell "starting" from "dead".
A fatal engine error, or the core process dying, turns readiness NOT_SERVING, fails every
request in flight and makes this process exit non-zero.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from dataclasses import dataclass, field

import grpc
import structlog
from grpc_health.v1 import health_pb2

from tandem.cli_options import EngineCoreArgs, EngineMetricsArgs, EngineServerArgs, MetricsArgs, TracingArgs
from tandem.engine_service.config import EngineConfig
from tandem.engine_service.api.core_client import CoreClient
from tandem.engine_service.api.metrics import EngineMetrics
from tandem.engine_service.api.request_spans import RequestSpans
from tandem.engine_service.api.model_info import engine_model_info
from tandem.engine_service.api.server import SERVICE_NAME, EngineServicer
from tandem.generation_defaults import load_generation_defaults
from tandem.grpc_service import add_service, enable_reflection
from tandem.health import add_health
from tandem.metrics import new_registry, start_metrics_endpoint
from tandem.proto_wire import Limits
from tandem.security import SecurityOptions, add_port
from tandem.shutdown import StopSignals
from tandem.tracing import Tracing
from tandem.v1 import engine_pb2

log = structlog.get_logger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass
class EngineServerOptions(EngineServerArgs, MetricsArgs, EngineMetricsArgs, EngineCoreArgs, TracingArgs):
    """Everything `serve_engine` needs besides the engine's config.

    The settings that are flags (address, request defaults, reflection, metrics, where the core
    runs, tracing) are the fields of the `tandem.cli_options` classes it extends, declared there once;
    the CLI fills them with `tandem.options.from_args`. A `metrics_host` of None binds the
    service's own `host`. The fields below are what the CLI resolves or passes on.
    """

    security: SecurityOptions = field(default_factory=SecurityOptions)  # TLS/mTLS and token
    fail_after_steps: int | None = None  # testing only: inject a fatal engine error
    log_level: str = "info"  # passed on to the core process
    log_format: str = "json"


ENGINE_CORE_MODES = ("process", "thread")


def with_engine_credentials(config: EngineConfig, security: SecurityOptions) -> EngineConfig:
    """`config` whose KV pull port carries the engine service's own credentials: its tokens
    (an admin token is a client token too) and its TLS certificate, key and client CA."""
    kv = dataclasses.replace(config.kv_transfer, auth_tokens=security.tokens + security.admin_tokens,
                             tls_cert=security.tls_cert, tls_key=security.tls_key,
                             tls_client_ca=security.tls_client_ca)
    return dataclasses.replace(config, kv_transfer=kv)


async def start_core(config: EngineConfig, options: EngineServerOptions) -> CoreClient:
    """Loads the model in a core process (or on a thread here) and returns its client."""
    config = with_engine_credentials(config, options.security)
    if options.engine_core == "process":
        from tandem.engine_service.api.mp_client import MultiprocessCoreClient

        return await MultiprocessCoreClient.launch(config, options.fail_after_steps, options.log_level,
                                                   options.log_format)
    if options.engine_core != "thread":
        raise ValueError(f"engine_core must be one of {ENGINE_CORE_MODES}, got {options.engine_core!r}")
    from tandem.engine_service.api.inproc_client import InProcessCoreClient
    from tandem.engine_service.core.warmup import serving_engine

    engine = await asyncio.get_running_loop().run_in_executor(None, serving_engine, config)
    return InProcessCoreClient(engine, options.fail_after_steps)


async def serve_engine(config: EngineConfig, options: EngineServerOptions, ready: asyncio.Event | None = None) -> int:
    """Runs until SIGTERM/SIGINT (exit code 0) or a fatal engine error (exit code 1); the spans
    still batched are sent before it returns."""
    tracing = Tracing.start(options.otlp_endpoint, options.service_name("engine"))
    try:
        return await _serve_engine(config, options, ready, tracing)
    finally:
        tracing.shutdown()


async def _serve_engine(config: EngineConfig, options: EngineServerOptions, ready: asyncio.Event | None,
                        tracing: Tracing) -> int:
    server = grpc.aio.server(
        interceptors=options.security.server_interceptors(),
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ]
    )
    health = await add_health(server, SERVICE_NAME)
    spans = RequestSpans(tracing.tracer) if tracing.enabled else None
    servicer = EngineServicer(options.security.access_policy(), spans)
    add_service(server, servicer, engine_pb2.DESCRIPTOR.services_by_name["Engine"])
    if options.enable_reflection:
        enable_reflection(server, [engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name])
    bound = add_port(server, f"{options.host}:{options.port}", options.security)
    if bound == 0:
        raise RuntimeError(f"cannot bind {options.host}:{options.port}")
    await server.start()
    log.info("engine_listening", address=f"{options.host}:{bound}", model=config.model.model,
             **options.security.summary("server"))
    options.security.warn_if_weak("server", options.host)
    # Served from before the model loads (process metrics only until then), so a scrape tells
    # "loading" from "down".
    registry = new_registry()
    metrics_endpoint = (
        start_metrics_endpoint(registry, options.metrics_host if options.metrics_host is not None else options.host,
                               options.metrics_port)
        if options.metrics_port is not None else None
    )

    loop = asyncio.get_running_loop()
    try:
        core = await start_core(config, options)
    except Exception as exc:
        log.error("engine_core_failed_to_start", error=str(exc))
        await server.stop(grace=0)
        if metrics_endpoint is not None:
            metrics_endpoint.close()
        return 1
    fatal = asyncio.Event()
    core.on_fatal = lambda message: fatal.set()  # called on the event loop
    # Before start: it adds a step listener. model_name is the name clients use.
    EngineMetrics(core, options.served_model_name or config.model.model, registry, names=options.metrics_names)
    if spans is not None:
        core.step_listeners.append(spans.on_step)
    core.start(loop)
    info = core.info
    defaults = load_generation_defaults(config.model.generation_config, config.model.model, info.model_path)
    limits = Limits(
        vocab_size=info.vocab_size,
        max_model_len=info.max_model_len,
        default_max_tokens=defaults.default_max_tokens(options.default_max_tokens),
        kv_capacity_tokens=info.kv_capacity_tokens,
        sampling_defaults=defaults,
    )
    effective = defaults.effective(options.default_max_tokens)
    servicer.attach(core, limits, engine_model_info(info, effective))
    await health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    log.info("engine_ready", kv_blocks=info.kv_blocks, max_model_len=info.max_model_len,
             engine_core=options.engine_core, sampling_defaults=effective)
    if ready is not None:
        ready.set()

    signals = StopSignals()
    signals.install()
    stop = signals.stop
    waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(fatal.wait())]
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for w in waiters:
        w.cancel()

    if fatal.is_set():
        await health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        await asyncio.sleep(0.2)  # let the failed requests' handlers send their status first
        await health.enter_graceful_shutdown()
        await server.stop(grace=1.0)
        core.stop()
        log.error("engine_exiting_after_fatal_error", error=core.fatal_error)
        if metrics_endpoint is not None:
            metrics_endpoint.close()
        return 1
    # Drain: refuse new work, let in-flight requests finish within the timeout.
    await health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
    core.accepting = False
    await signals.drain(lambda: 0 if fatal.is_set() else core.num_in_flight, options.drain_timeout)
    for request_id in core.in_flight_ids():
        core.abort(request_id)
    await health.enter_graceful_shutdown()
    await server.stop(grace=0 if signals.force.is_set() else 2.0)
    core.stop()
    if metrics_endpoint is not None:
        metrics_endpoint.close()
    log.info("engine_stopped")
    return 0


def run_engine(config: EngineConfig, options: EngineServerOptions) -> int:
    torch_threads = os.environ.get("TANDEM_TORCH_THREADS")
    if torch_threads and options.engine_core == "thread":  # the core process reads it itself
        import torch

        torch.set_num_threads(int(torch_threads))
    return asyncio.run(serve_engine(config, options))
