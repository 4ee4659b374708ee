"""Issue 21, acceptance 5: a real `tandem serve --otlp-endpoint` (the embedded model, the default
mux transport, HTTP on) sends its spans to an OTLP receiver started here (the OpenTelemetry
collector protocol's TraceService over gRPC, from `opentelemetry-proto`): the frontend's span of a
gRPC or HTTP request is a child of the client's `traceparent`, the engine's spans of each choice
are children of the frontend's, all under the client's trace ID; the `request_end` log lines of
both services (the engine's for mux requests too) name the same trace and spans."""

from __future__ import annotations

import json
import secrets
import threading
import time
import urllib.request
from concurrent import futures
from dataclasses import dataclass

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from tandem.client import TandemClient

SERVICE = "traced"  # --otlp-service-name: the frontend's; the engine child's is traced-engine
ENGINE_PHASES = {"engine.queued", "engine.prefill", "engine.decode"}


@dataclass
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every span exported to it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[Span] = []

    def Export(self, request, context):
        with self._lock:
            for rs in request.resource_spans:
                resource = {a.key: _value(a.value) for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self._spans.append(Span(resource.get("service.name"), s.name, s.trace_id.hex(),
                                                s.span_id.hex(), s.parent_span_id.hex(),
                                                {a.key: _value(a.value) for a in s.attributes}))
        return trace_service_pb2.ExportTraceServiceResponse()

    def of_trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self._spans if s.trace_id == trace_id]

    def wait(self, trace_id: str, done, timeout: float = 30.0) -> list[Span]:
        """The trace's spans once `done(spans)` holds (or whatever arrived by the timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.of_trace(trace_id)
            if done(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.05)


@pytest.fixture(scope="module")
def receiver(get_free_port):
    port = get_free_port()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    sink = OtlpReceiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    sink.endpoint = f"http://127.0.0.1:{port}"
    yield sink
    server.stop(0)


@pytest.fixture(scope="module")
def traced_serve(receiver, launch_serve, get_free_port, tmp_path_factory):  # the receiver outlives the server
    http_port = get_free_port()
    log_file = tmp_path_factory.mktemp("logs") / "serve.log"
    # A short batch delay (the SDK's OTEL_BSP_SCHEDULE_DELAY, ms): spans arrive within the test.
    _, frontend, _ = launch_serve(["--otlp-endpoint", receiver.endpoint, "--otlp-service-name", SERVICE,
                                   "--http-port", str(http_port), "--frontend-workers", "1"],
                                  env={"OTEL_BSP_SCHEDULE_DELAY": "100", "TANDEM_LOG_LEVEL": "info"},
                                  stderr=log_file)
    return {"frontend": frontend, "http": f"http://127.0.0.1:{http_port}", "log": log_file}


def _request_ends(path, want: set, timeout: float = 15.0) -> dict[tuple[str, str], dict]:
    """`request_end` lines by (service, request_id), once those of `want` are all there."""
    deadline = time.monotonic() + timeout
    while True:
        ends = {}
        for raw in path.read_text(errors="replace").splitlines():
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            if isinstance(line, dict) and line.get("event") == "request_end":
                ends[(line.get("service"), line.get("request_id"))] = line
        if want <= ends.keys() or time.monotonic() > deadline:
            return ends
        time.sleep(0.05)


def _client_trace() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def _engine_spans_complete(n: int):
    def done(spans: list[Span]) -> bool:
        requests = [s for s in spans if s.name == "engine.request"]
        return len(requests) == n and sum(s.name in ENGINE_PHASES for s in spans) == 3 * n and any(
            s.service == SERVICE for s in spans)
    return done


def _check_engine_spans(spans: list[Span], frontend: Span, internal_ids: list[str], completion_tokens: list[int]):
    """One engine.request per choice under the frontend's span, its three phases under it."""
    requests = sorted((s for s in spans if s.name == "engine.request"), key=lambda s: s.attributes["tandem.request_id"])
    assert [s.attributes["tandem.request_id"] for s in requests] == sorted(internal_ids)
    for req, tokens in zip(requests, completion_tokens):
        assert req.service == f"{SERVICE}-engine"
        assert req.parent_span_id == frontend.span_id
        assert req.attributes["tandem.method"] == "Submit"  # serve's default transport: mux
        assert req.attributes["gen_ai.usage.input_tokens"] == frontend.attributes["tandem.prompt_tokens"]
        assert req.attributes["gen_ai.usage.output_tokens"] == tokens
        assert req.attributes["tandem.finish_reason"] == "length"
        assert req.attributes["tandem.cached_prompt_tokens"] >= 0
        phases = {s.name: s for s in spans if s.parent_span_id == req.span_id}
        assert set(phases) == ENGINE_PHASES
        assert all(s.service == f"{SERVICE}-engine" for s in phases.values())


def test_grpc_generate_spans_nest_under_the_clients_trace(traced_serve, receiver):
    trace_id, client_span, traceparent = _client_trace()
    with TandemClient(traced_serve["frontend"], metadata=[("traceparent", traceparent)]) as c:
        reply = c.generate("Hello there", max_tokens=4, temperature=0.0, ignore_eos=True, n=2,
                           request_id="otlp-grpc")
    spans = receiver.wait(trace_id, _engine_spans_complete(2))
    (frontend,) = [s for s in spans if s.name == "tandem.v1.Frontend/Generate"]
    assert frontend.service == SERVICE and frontend.parent_span_id == client_span
    assert frontend.attributes["rpc.system"] == "grpc" and frontend.attributes["rpc.method"] == "Generate"
    assert frontend.attributes["tandem.request_id"] == "otlp-grpc"
    assert frontend.attributes["tandem.code"] == "OK"
    assert frontend.attributes["tandem.completion_tokens"] == reply.usage.completion_tokens == 8
    assert frontend.attributes["tandem.prompt_tokens"] == reply.usage.prompt_tokens
    internal_ids = frontend.attributes["tandem.internal_request_ids"]
    _check_engine_spans(spans, frontend, internal_ids, [4, 4])

    # The log lines name the same trace: the frontend's its own span, each engine line (a mux
    # request's, method Submit) the frontend's span as its parent.
    ends = _request_ends(traced_serve["log"], {("frontend", "otlp-grpc")} | {("engine", i) for i in internal_ids})
    fe = ends[("frontend", "otlp-grpc")]
    assert (fe["trace_id"], fe["span_id"], fe["parent_span_id"]) == (trace_id, frontend.span_id, client_span)
    for internal_id in internal_ids:
        en = ends[("engine", internal_id)]
        assert en["method"] == "Submit" and en["code"] == "OK" and en["completion_tokens"] == 4
        assert (en["trace_id"], en["parent_span_id"]) == (trace_id, frontend.span_id) and "span_id" not in en


def test_http_chat_completion_spans_nest_under_the_traceparent_header(traced_serve, receiver):
    trace_id, client_span, traceparent = _client_trace()
    with urllib.request.urlopen(traced_serve["http"] + "/v1/models", timeout=30) as resp:
        model = json.loads(resp.read())["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0,
            "ignore_eos": True}
    req = urllib.request.Request(traced_serve["http"] + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "traceparent": traceparent},
                                 method="POST")
    with urllib.request.urlopen(req, timeout=60) as resp:
        reply = json.loads(resp.read())
    spans = receiver.wait(trace_id, _engine_spans_complete(1))
    (frontend,) = [s for s in spans if s.name == "POST /v1/chat/completions"]
    assert frontend.service == SERVICE and frontend.parent_span_id == client_span
    assert frontend.attributes["http.request.method"] == "POST"
    assert frontend.attributes["http.route"] == "/v1/chat/completions"
    assert frontend.attributes["tandem.request_id"] == reply["id"].removeprefix("chatcmpl-")
    _check_engine_spans(spans, frontend, frontend.attributes["tandem.internal_request_ids"],
                        [reply["usage"]["completion_tokens"]])


def test_a_refused_request_is_one_frontend_span_with_its_status(traced_serve, receiver):
    trace_id, client_span, traceparent = _client_trace()
    with TandemClient(traced_serve["frontend"], metadata=[("traceparent", traceparent)]) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.generate("Hello", max_tokens=4, top_p=2.0)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    spans = receiver.wait(trace_id, lambda s: len(s) >= 1)
    assert [(s.name, s.parent_span_id, s.attributes["tandem.code"]) for s in spans] == [
        ("tandem.v1.Frontend/Generate", client_span, "INVALID_ARGUMENT")]
