"""OpenTelemetry for Tandem: each process's tracer, and W3C trace context in gRPC metadata.

The OpenTelemetry API and SDK do the work (IDs, sampling, `traceparent`/`tracestate` parsing
and limits, batching, OTLP export); this module holds only what they do not:

- `Tracing.start(endpoint, service_name)`: a process's tracer. With an OTLP endpoint it is the
  SDK's (spans batched by a `BatchSpanProcessor` and sent over OTLP/gRPC; the SDK's `OTEL_BSP_*`
  and `OTEL_TRACES_SAMPLER` variables apply; the default sampler follows the caller's sampled
  flag). Without one it is the API's no-op tracer: a "span" is the caller's context passed on
  unchanged, so nothing is allocated, recorded or sent and the caller's trace still reaches the
  engine (and both services' log lines) intact.
- `parent_context(metadata)` / `outgoing_metadata(span)`: trace context from a call's metadata
  (gRPC, or HTTP headers in the same shape) and into the next hop's.
- `log_fields(span, parent)` / `caller_log_fields(parent)`: the IDs a request's log lines carry.
- `epoch_ns(monotonic)`: a `time.monotonic()` reading (the engine core's timestamps) as the
  wall-clock nanoseconds spans are stamped with.

A tracer is passed to the servicers that record spans (no global provider): tests and tools
that run several servers in one process keep them apart.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
_HEADERS = (TRACEPARENT, TRACESTATE)
_PROPAGATOR = TraceContextTextMapPropagator()
NO_TRACER: trace.Tracer = trace.NoOpTracer()
INSTRUMENTATION_NAME = "tandem"


def check_otlp_endpoint(text: str) -> str:
    """An OTLP/gRPC collector address: `http://HOST:PORT` (plaintext) or `https://HOST:PORT`
    (TLS, the system's root certificates). The scheme is required: it decides whether the spans
    travel encrypted, which is not left to a guess."""
    scheme, sep, rest = str(text).partition("://")
    host, colon, port = rest.rstrip("/").rpartition(":")
    if not sep or scheme not in ("http", "https") or not colon or not host or not port.isdigit() \
            or not 1 <= int(port) <= 65535:
        raise ValueError(f"expected http://HOST:PORT (plaintext) or https://HOST:PORT (TLS), got {text!r}")
    return str(text)


@dataclass
class Tracing:
    """One process's tracer and, when it exports, the SDK provider to flush at shutdown."""

    tracer: trace.Tracer = NO_TRACER
    provider: Any = None  # opentelemetry.sdk.trace.TracerProvider when exporting

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    @classmethod
    def start(cls, endpoint: str | None, service_name: str) -> "Tracing":
        """The no-op tracer without `endpoint`; else an SDK tracer exporting to it over OTLP/gRPC."""
        if not endpoint:
            return cls()
        # The SDK and exporter load only when tracing is on.
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        endpoint = check_otlp_endpoint(endpoint)
        provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=endpoint.startswith("http://"))
        provider.add_span_processor(BatchSpanProcessor(exporter))
        return cls(provider.get_tracer(INSTRUMENTATION_NAME, _version()), provider)

    def shutdown(self) -> None:
        """Sends the spans still batched and stops the exporter (a no-op when not exporting)."""
        if self.provider is not None:
            self.provider.shutdown()
            self.provider = None


def _version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tandem-common")
    except PackageNotFoundError:
        return None


def parent_context(metadata: Iterable[tuple[str, str | bytes]] | None) -> Context:
    """The caller's trace context from call metadata (keys in any case; binary `-bin` values and
    repeated `tracestate` entries handled); an empty context when it sends none or an invalid one
    (the SDK then starts a trace; the no-op tracer has nothing to pass on)."""
    carrier: dict[str, list[str]] = {}
    for key, value in metadata or ():
        if isinstance(value, bytes):
            continue
        key = key.lower()
        if key in _HEADERS:
            carrier.setdefault(key, []).append(value)
    if TRACEPARENT not in carrier:
        return Context()
    return _PROPAGATOR.extract(carrier)


def outgoing_metadata(span: trace.Span) -> tuple[tuple[str, str], ...]:
    """Metadata naming `span` as the parent of a downstream call (empty when it has no valid
    context: no trace to continue)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return tuple(carrier.items())


def log_fields(span: trace.Span, parent: Context) -> dict[str, str]:
    """`trace_id`, this process's `span_id` when it records one, and the caller's span as
    `parent_span_id`; nothing when the request belongs to no trace."""
    fields: dict[str, str] = {}
    caller = trace.get_current_span(parent).get_span_context()
    own = span.get_span_context()
    if own.is_valid:
        fields["trace_id"] = trace.format_trace_id(own.trace_id)
        if span.is_recording():
            fields["span_id"] = trace.format_span_id(own.span_id)
    if caller.is_valid:
        fields["parent_span_id"] = trace.format_span_id(caller.span_id)
    return fields


def caller_log_fields(parent: Context) -> dict[str, str]:
    """`log_fields` of a request recorded by no span of this process: the caller's trace and span."""
    return log_fields(trace.get_current_span(parent), parent)


def epoch_ns(monotonic: float, now_ns: int | None = None, now_monotonic_ns: int | None = None) -> int:
    """`monotonic` (a `time.monotonic()` reading of this host, any process) as nanoseconds since
    the epoch; `now_ns` / `now_monotonic_ns` pin the two clocks' offset (one pair per batch)."""
    if now_ns is None:
        now_ns = time.time_ns()
    if now_monotonic_ns is None:
        now_monotonic_ns = time.monotonic_ns()
    return now_ns - now_monotonic_ns + int(monotonic * 1e9)
