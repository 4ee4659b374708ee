"""One RPC's logging scope: request IDs and trace bound into structlog, one line when it ends.

Both services wrap each Generate/Stream call in a `RequestScope`. While it is open every log
line of that call (on its task, and on tasks it starts) carries the IDs and trace; when it
closes it logs exactly one `request_end` line with the gRPC outcome, the latency and whatever
the service noted (finish reasons, token counts). Per-token events are never logged.

With a recording tracer (`tandem.tracing`) the scope is also one OpenTelemetry span, a child of
the caller's: it ends with the scope and carries the ending line's fields as `tandem.*`
attributes, its status an error for the outcomes logged as server faults. With the no-op
tracer the span is the caller's context itself, passed on unchanged and never touched.

gRPC's asyncio server runs each call in its own task, whose context is a copy: bindings cannot
leak between calls. Unbinding on exit uses keys, not context-variable tokens, because an async
generator may be finalised from another context, where resetting a token would raise.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import grpc
import structlog
from opentelemetry import trace
from opentelemetry.context import Context

from tandem.tracing import NO_TRACER, log_fields, parent_context

log = structlog.get_logger(__name__)

# Outcomes that are the server's fault, logged at warning; the rest (client errors, cancels,
# successes) are ordinary request endings.
_SERVER_FAULTS = frozenset({"INTERNAL", "UNKNOWN", "UNAVAILABLE", "DATA_LOSS", "UNIMPLEMENTED"})


def grpc_outcome(exc_type: type[BaseException] | None, context) -> str:
    """The status name a call ends with, judged from the exception leaving its handler."""
    if exc_type is None:
        return "OK"
    remaining = context.time_remaining()
    expired = remaining is not None and remaining <= 0
    if issubclass(exc_type, grpc.aio.AbortError):
        code = context.code()
        if isinstance(code, grpc.StatusCode):
            return code.name
        return "DEADLINE_EXCEEDED" if expired else "UNKNOWN"
    if issubclass(exc_type, (asyncio.CancelledError, GeneratorExit)):
        return "DEADLINE_EXCEEDED" if expired else "CANCELLED"
    # Anything else is a handler failure, unless the call had already ended for the client:
    # then the failure is the handler finding that out (aborting a call whose deadline passed
    # raises), and the client's ending is the outcome.
    if expired:
        return "DEADLINE_EXCEEDED"
    if _already_done(context):
        return "CANCELLED"
    return "UNKNOWN"  # what gRPC reports for an exception the handler did not map


def _already_done(context) -> bool:
    done = getattr(context, "done", None)
    try:
        return bool(done()) if callable(done) else False
    except Exception:  # noqa: BLE001 - a context that cannot tell is taken as live
        return False


class RequestScope:
    """Binds one call's IDs and trace into the log context and logs its single ending line;
    records the call as a span named `span_name` under `parent` when `tracer` records."""

    def __init__(self, context, service: str, method: str, parent: Context, tracer: trace.Tracer = NO_TRACER,
                 span_name: str | None = None, span_attributes: dict | None = None, **ids) -> None:
        self._context = context
        self.service = service
        self.method = method
        self.parent = parent
        self.span = tracer.start_span(span_name or f"{service}.{method}", context=parent,
                                      kind=trace.SpanKind.SERVER, attributes=span_attributes)
        self.fields: dict = {}
        self.code: str | None = None
        self._final_sent = False
        self.latency: float = 0.0
        self.start = time.monotonic()
        self._bound: dict = {}
        self._ids = {k: v for k, v in ids.items() if v}
        self._on_end: list[Callable[["RequestScope"], None]] = []

    @classmethod
    def for_call(cls, context, service: str, method: str, **ids) -> "RequestScope":
        """A scope that continues the caller's trace from the call's metadata (no span of its own)."""
        return cls(context, service, method, parent_context(context.invocation_metadata()), **ids)

    def bind(self, **fields) -> None:
        """Adds fields to every log line of this call from now on (and to its ending line)."""
        structlog.contextvars.bind_contextvars(**fields)
        self._bound.update(fields)

    def note(self, **fields) -> None:
        """Adds fields to the ending line only."""
        self.fields.update(fields)

    def final_response_sent(self) -> None:
        """The call's last message is handed to gRPC: the request itself is complete.

        A cancel after this point is the caller hanging up once it has the end (the frontend
        cancels an engine stream as soon as it reads the final message), so the call is logged
        and counted as OK rather than CANCELLED.
        """
        self._final_sent = True

    def on_end(self, callback: Callable[["RequestScope"], None]) -> None:
        """Runs `callback(scope)` when the call ends, after `code` and `latency` are set."""
        self._on_end.append(callback)

    def __enter__(self) -> "RequestScope":
        self.bind(service=self.service, **log_fields(self.span, self.parent), **self._ids)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.code = grpc_outcome(exc_type, self._context)
        if self._final_sent and self.code == "CANCELLED":
            self.code = "OK"
        self.latency = time.monotonic() - self.start
        try:
            for callback in self._on_end:
                callback(self)
        except Exception:  # observing a request must never change how it ends
            log.exception("request_end_callback_failed")
        # The bound fields are passed explicitly too: a stream closed by the generator finaliser
        # exits in a context where they were never bound.
        line = {**self._bound, "method": self.method, "code": self.code, "latency_s": round(self.latency, 6)}
        line.update(self.fields)
        log_request_end(line)
        structlog.contextvars.unbind_contextvars(*self._bound)
        if self.span.is_recording():
            _end_span(self.span, line, self.code)
        return False


def log_request_end(line: dict) -> None:
    """Logs a request's one `request_end` line: at warning when its `code` is a server fault."""
    emit = log.warning if line.get("code") in _SERVER_FAULTS else log.info
    emit("request_end", **line)


# Fields of the ending line that are the span's own identity, not attributes of it.
_NOT_ATTRIBUTES = frozenset({"trace_id", "span_id", "parent_span_id", "service"})


def _end_span(span: trace.Span, line: dict, code: str) -> None:
    """Ends a call's span with the ending line's fields as `tandem.*` attributes."""
    attributes = {}
    for key, value in line.items():
        if key in _NOT_ATTRIBUTES:
            continue
        if isinstance(value, (list, tuple)):
            value = [str(v) for v in value]
        elif not isinstance(value, (str, bool, int, float)):
            continue
        attributes[f"tandem.{key}"] = value
    span.set_attributes(attributes)  # one call: the SDK takes its lock once, not per attribute
    if code in _SERVER_FAULTS:
        span.set_status(trace.StatusCode.ERROR, code)
    span.end()
