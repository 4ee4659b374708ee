"""Per-request CPU cost of Tandem's tracing (tandem/tracing.py), off and on.

What one request costs each service for its trace, measured on the real code paths without the
rest of the request:

- frontend: `parent_context` of the call's metadata, the request's span (`RequestScope`'s
  `start_span`), its log fields, the engine hop's metadata, the span's end with its attributes;
- engine: `RequestSpans` (one `engine.request` span and its three phases from the core's
  timestamps), per finished request.

"off" is the no-op tracer (no --otlp-endpoint), with and without a client `traceparent`; "on" is
the SDK with a `BatchSpanProcessor` and the OTLP/gRPC exporter sending to a receiver in this
process (its Export handler does nothing), so the export thread's work is in the process CPU time
too (`cpu us/req`: time.process_time over the run, flushing every 1000 requests).

    python bench/probes/tracing_probe.py [--requests 20000]
"""

from __future__ import annotations

import argparse
import secrets
import time
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from tandem.core_protocol import FinishReason, RequestOutput, StopToken
from tandem.engine_service.api.request_spans import RequestSpans
from tandem.request_scope import _end_span
from tandem.tracing import NO_TRACER, Tracing, log_fields, outgoing_metadata, parent_context
from opentelemetry import trace


class SpanCounter(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP receiver that counts the spans exported to it (tracing_served_probe.py uses it too)."""

    def __init__(self) -> None:
        self.spans = 0

    def Export(self, request, context):
        self.spans += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        return trace_service_pb2.ExportTraceServiceResponse()


def frontend_request(tracer, metadata) -> None:
    parent = parent_context(metadata)
    span = tracer.start_span("tandem.v1.Frontend/Generate", context=parent, kind=trace.SpanKind.SERVER,
                             attributes={"rpc.system": "grpc", "rpc.service": "tandem.v1.Frontend",
                                         "rpc.method": "Generate"})
    log_fields(span, parent)
    outgoing_metadata(span)
    if span.is_recording():
        _end_span(span, {"request_id": "r", "internal_request_ids": ["r-0"], "method": "Generate", "code": "OK",
                         "latency_s": 0.1, "finish_reasons": ["stop"], "prompt_tokens": 37, "completion_tokens": 8,
                         "cached_prompt_tokens": 32, "ttft_s": 0.02}, "OK")


def engine_request(spans: RequestSpans, metadata, i: int) -> None:
    rid = f"r-{i}"
    spans.begin(rid, parent_context(metadata), "Submit")
    now = time.monotonic()
    spans.on_step([RequestOutput(request_id=rid, finished=True, finish_reason=FinishReason.STOP,
                                 stop_reason=StopToken(2), num_prompt_tokens=37, num_output_tokens=8,
                                 num_cached_prompt_tokens=32, arrival_time=now - 0.1, first_scheduled_time=now - 0.09,
                                 first_token_time=now - 0.05)], 0.01, True, now)


def measure(name: str, n: int, fn, flush=None, chunk: int = 1000) -> None:
    """Runs `fn` n times in chunks, flushing the exporter after each (the batch queue holds 2048
    spans: a tight loop would overflow it and drop spans whose export then goes uncounted)."""
    for i in range(chunk):  # warm-up
        fn(i)
    if flush:
        flush()
    wall, cpu = 0.0, time.process_time()
    for start in range(0, n, chunk):
        t = time.perf_counter()
        for i in range(start, min(n, start + chunk)):
            fn(i)
        wall += time.perf_counter() - t
        if flush:
            flush()
    cpu = time.process_time() - cpu
    print(f"| {name} | {wall / n * 1e6:.2f} | {cpu / n * 1e6:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=20000)
    n = ap.parse_args().requests
    traced = (("traceparent", f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"),
              ("user-agent", "grpc-python/1.0"), ("authorization", "Bearer x"))
    untraced = (("user-agent", "grpc-python/1.0"), ("authorization", "Bearer x"))

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    sink = SpanCounter()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    tracing = Tracing.start(f"http://127.0.0.1:{port}", "probe")
    flush = tracing.provider.force_flush

    print("| path | wall us/req (caller's thread) | cpu us/req (process) |")
    print("|---|---|---|")
    measure("frontend, off, no traceparent", n, lambda i: frontend_request(NO_TRACER, untraced))
    measure("frontend, off, client traceparent", n, lambda i: frontend_request(NO_TRACER, traced))
    measure("frontend, on (1 span)", n, lambda i: frontend_request(tracing.tracer, traced), flush)
    spans = RequestSpans(tracing.tracer)
    measure("engine, on (4 spans)", n, lambda i: engine_request(spans, traced, i), flush, chunk=500)
    tracing.shutdown()
    server.stop(0)
    print(f"spans received: {sink.spans}")


if __name__ == "__main__":
    main()
