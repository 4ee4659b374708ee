"""tandem/tracing.py: trace context from call metadata and into the next hop's, the IDs a log line
carries, the endpoint check, and the engine's spans from the core's timestamps (an in-memory
exporter on the real SDK; the OTLP path end to end is tests/integration/test_tracing_otlp.py)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tandem.core_protocol import CoreInfo, CoreOutputs, EngineStats, FinishReason, RequestOutput, StopToken
from tandem.engine_service.api.core_client import CoreClient
from tandem.engine_service.api.request_spans import RequestSpans
from tandem.engine_service.api.server import EngineServicer
from tandem.proto_wire import Limits
from tandem.request_scope import RequestScope
from tandem.tracing import (
    NO_TRACER,
    Tracing,
    check_otlp_endpoint,
    epoch_ns,
    log_fields,
    outgoing_metadata,
    parent_context,
)
from tandem.v1 import engine_pb2

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"
VALID = f"00-{TRACE}-{SPAN}-01"


@pytest.fixture
def recorded():
    """An SDK tracer whose spans land in memory as they end."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider.get_tracer("test"), exporter
    provider.shutdown()


def test_parent_context_reads_traceparent_and_tracestate_from_metadata():
    parent = parent_context([("x-other", "1"), ("traceparent-bin", b"\x00"), ("TraceParent", VALID),
                             ("tracestate", "congo=t61rcWkgMzE"), ("tracestate", "rojo=00f067aa0ba902b7")])
    ctx = trace.get_current_span(parent).get_span_context()
    assert trace.format_trace_id(ctx.trace_id) == TRACE and trace.format_span_id(ctx.span_id) == SPAN
    assert ctx.trace_flags.sampled and ctx.is_remote
    assert ctx.trace_state.to_header() == "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"


@pytest.mark.parametrize("metadata", [None, [], [("tracestate", "a=b")],
                                      [("traceparent", f"00-{'0' * 32}-{SPAN}-01")],
                                      [("traceparent", f"00-{TRACE.upper()}-{SPAN}-01")],
                                      [("traceparent", f"ff-{TRACE}-{SPAN}-01")]])
def test_missing_or_invalid_traceparent_gives_no_parent(metadata):
    assert not trace.get_current_span(parent_context(metadata)).get_span_context().is_valid


def test_the_no_op_tracer_passes_the_callers_context_on_unchanged():
    parent = parent_context([("traceparent", VALID), ("tracestate", "a=b")])
    span = NO_TRACER.start_span("x", context=parent)
    assert not span.is_recording()
    assert dict(outgoing_metadata(span)) == {"traceparent": VALID, "tracestate": "a=b"}
    assert log_fields(span, parent) == {"trace_id": TRACE, "parent_span_id": SPAN}
    untraced = parent_context(None)
    nothing = NO_TRACER.start_span("x", context=untraced)
    assert outgoing_metadata(nothing) == () and log_fields(nothing, untraced) == {}


def test_a_recording_span_is_the_next_hops_parent(recorded):
    tracer, _ = recorded
    parent = parent_context([("traceparent", VALID)])
    span = tracer.start_span("x", context=parent)
    own = trace.format_span_id(span.get_span_context().span_id)
    assert own != SPAN
    assert dict(outgoing_metadata(span)) == {"traceparent": f"00-{TRACE}-{own}-01"}
    assert log_fields(span, parent) == {"trace_id": TRACE, "span_id": own, "parent_span_id": SPAN}
    root = tracer.start_span("y", context=parent_context(None))  # no caller: a new trace
    assert trace.format_trace_id(root.get_span_context().trace_id) != TRACE
    assert "parent_span_id" not in log_fields(root, parent_context(None))


def test_an_unsampled_caller_is_not_recorded(recorded):
    tracer, _ = recorded
    span = tracer.start_span("x", context=parent_context([("traceparent", f"00-{TRACE}-{SPAN}-00")]))
    assert not span.is_recording()
    assert dict(outgoing_metadata(span))["traceparent"].endswith("-00")


def test_tracing_without_an_endpoint_is_the_no_op_tracer():
    tracing = Tracing.start(None, "tandem-frontend")
    assert tracing.tracer is NO_TRACER and not tracing.enabled
    tracing.shutdown()


@pytest.mark.parametrize("text", ["127.0.0.1:4317", "grpc://h:4317", "http://h", "http://:4317", "http://h:0",
                                  "http://h:99999", "https://h:x"])
def test_otlp_endpoint_needs_a_scheme_host_and_port(text):
    with pytest.raises(ValueError, match="http://HOST:PORT"):
        check_otlp_endpoint(text)


def test_otlp_endpoint_accepts_http_and_https():
    assert check_otlp_endpoint("http://127.0.0.1:4317") == "http://127.0.0.1:4317"
    assert check_otlp_endpoint("https://collector.example:443/") == "https://collector.example:443/"


def test_epoch_ns_keeps_the_distance_between_monotonic_readings():
    now_ns, mono_ns = time.time_ns(), time.monotonic_ns()
    a, b = epoch_ns(10.0, now_ns, mono_ns), epoch_ns(10.25, now_ns, mono_ns)
    assert b - a == 250_000_000
    assert abs(epoch_ns(mono_ns / 1e9, now_ns, mono_ns) - now_ns) < 1000


class _Call:
    """The parts of a gRPC servicer context RequestScope and the engine servicer read; the caller
    sends VALID as its traceparent."""

    def __init__(self, code=None) -> None:
        self._code = code

    def code(self):
        return self._code

    def time_remaining(self):
        return 5.0

    def invocation_metadata(self):
        return (("traceparent", VALID),)

    def peer(self):
        return "ipv4:127.0.0.1:1"

    def auth_context(self):
        return {}

    async def abort(self, code, details=""):
        raise AssertionError(f"aborted: {code} {details}")


def test_a_request_scope_is_one_span_carrying_its_ending_line(recorded):
    tracer, exporter = recorded
    parent = parent_context([("traceparent", VALID)])
    with RequestScope(_Call(), "frontend", "Generate", parent, tracer, span_name="tandem.v1.Frontend/Generate",
                      span_attributes={"rpc.method": "Generate"}, request_id="r1") as scope:
        scope.note(finish_reasons=["stop", "length"], prompt_tokens=37, unexported={"a": 1})
        assert exporter.get_finished_spans() == ()  # open until the call ends
    (span,) = exporter.get_finished_spans()
    assert span.name == "tandem.v1.Frontend/Generate" and span.kind == trace.SpanKind.SERVER
    assert trace.format_span_id(span.parent.span_id) == SPAN
    a = span.attributes
    assert a["rpc.method"] == "Generate" and a["tandem.request_id"] == "r1" and a["tandem.code"] == "OK"
    assert a["tandem.finish_reasons"] == ("stop", "length") and a["tandem.prompt_tokens"] == 37
    assert "tandem.unexported" not in a and "tandem.trace_id" not in a
    assert span.status.status_code == trace.StatusCode.UNSET

    with pytest.raises(grpc.aio.AbortError):
        with RequestScope(_Call(grpc.StatusCode.INTERNAL), "frontend", "Stream", parent, tracer):
            raise grpc.aio.AbortError()
    failed = exporter.get_finished_spans()[-1]
    assert failed.attributes["tandem.code"] == "INTERNAL" and failed.status.status_code == trace.StatusCode.ERROR


def _finished(request_id: str, arrival: float, scheduled: float | None, first_token: float | None,
              reason: FinishReason = FinishReason.STOP) -> RequestOutput:
    return RequestOutput(request_id=request_id, finished=True, finish_reason=reason, stop_reason=StopToken(2),
                         num_prompt_tokens=37, num_output_tokens=8, num_cached_prompt_tokens=32,
                         arrival_time=arrival, first_scheduled_time=scheduled, first_token_time=first_token)


def test_engine_request_spans_from_the_cores_timestamps(recorded):
    tracer, exporter = recorded
    spans = RequestSpans(tracer)
    parent = parent_context([("traceparent", VALID)])
    spans.begin("r-0", parent, "Submit")
    spans.on_step([RequestOutput(request_id="r-0", new_token_ids=[5])], 0.01, True, 100.3)  # not finished
    assert exporter.get_finished_spans() == ()
    spans.on_step([_finished("r-0", 100.0, 100.1, 100.3), _finished("other", 1.0, None, None)], 0.01, True, 101.0)
    got = {s.name: s for s in exporter.get_finished_spans()}
    assert set(got) == {"engine.request", "engine.queued", "engine.prefill", "engine.decode"}
    req = got["engine.request"]
    assert trace.format_trace_id(req.context.trace_id) == TRACE
    assert trace.format_span_id(req.parent.span_id) == SPAN and req.kind == trace.SpanKind.SERVER
    assert req.attributes["tandem.request_id"] == "r-0" and req.attributes["tandem.method"] == "Submit"
    assert req.attributes["gen_ai.usage.input_tokens"] == 37 and req.attributes["gen_ai.usage.output_tokens"] == 8
    assert req.attributes["tandem.cached_prompt_tokens"] == 32 and req.attributes["tandem.finish_reason"] == "stop"
    assert req.attributes["tandem.stop_token_id"] == 2
    assert req.end_time - req.start_time == pytest.approx(1.0e9, abs=1e3)
    for name, (start, end) in {"engine.queued": (0.0, 0.1), "engine.prefill": (0.1, 0.3),
                               "engine.decode": (0.3, 1.0)}.items():
        s = got[name]
        assert s.parent.span_id == req.context.span_id
        assert (s.start_time - req.start_time) / 1e9 == pytest.approx(start, abs=1e-6), name
        assert (s.end_time - req.start_time) / 1e9 == pytest.approx(end, abs=1e-6), name


def test_a_request_aborted_while_queued_has_a_queued_span_only(recorded):
    tracer, exporter = recorded
    spans = RequestSpans(tracer)
    spans.begin("r-1", parent_context(None), "Stream")
    spans.on_step([_finished("r-1", 50.0, None, None, FinishReason.ABORT)], 0.0, False, 52.0)
    names = sorted(s.name for s in exporter.get_finished_spans())
    assert names == ["engine.queued", "engine.request"]
    (req,) = [s for s in exporter.get_finished_spans() if s.name == "engine.request"]
    assert req.parent is None and req.attributes["tandem.finish_reason"] == "abort"


class _Core(CoreClient):
    """The real CoreClient bookkeeping (streams, channels, step listeners) with the core replaced
    by a list of the messages sent to it: the test plays the core's outputs."""

    def __init__(self) -> None:
        info = CoreInfo(model="m", model_path=None, architecture="a", max_model_len=64, vocab_size=100,
                        eos_token_ids=[2], dtype="float32", device="cpu", kv_blocks=8, block_size=16,
                        kv_capacity_tokens=128, enable_prefix_caching=False)
        super().__init__(info, EngineStats(), max_waiting_requests=8, max_waiting_tokens=1024)
        self.sent: list = []

    def _send(self, msg) -> None:
        self.sent.append(msg)

    @property
    def alive(self) -> bool:
        return True


@pytest.mark.parametrize("method", ["Stream", "Generate", "Submit"])
def test_every_engine_transport_records_its_requests_spans(recorded, method):
    """The servicer registers each admitted request with the caller's context, whatever RPC
    admitted it, and the core client's step listener records its spans at the final output."""
    tracer, exporter = recorded

    async def scenario():
        core = _Core()
        core._loop = asyncio.get_running_loop()
        spans = RequestSpans(tracer)
        core.step_listeners.append(spans.on_step)
        servicer = EngineServicer(spans=spans)
        servicer.attach(core, Limits(vocab_size=100, max_model_len=64), engine_pb2.EngineModelInfo())
        request = engine_pb2.EngineRequest(request_id="r1", prompt_token_ids=[1, 2])
        request.sampling.max_tokens = 1
        if method == "Submit":
            subscription = servicer.Subscribe(engine_pb2.SubscribeRequest(channel_id="c"), _Call())
            await subscription.__anext__()
            request.channel_id = "c"
            await servicer.Submit(request, _Call())
            reply = subscription.__anext__()
        elif method == "Stream":
            reply = servicer.Stream(request, _Call()).__anext__()
        else:
            reply = servicer.Generate(request, _Call())
        reply = asyncio.ensure_future(reply)
        while not core.sent:
            await asyncio.sleep(0)
        t = core.sent[0].arrival_time
        core._on_outputs(CoreOutputs(outputs=[
            RequestOutput(request_id="r1", new_token_ids=[5], finished=True, finish_reason=FinishReason.LENGTH,
                          num_prompt_tokens=2, num_output_tokens=1, arrival_time=t, first_scheduled_time=t + 0.01,
                          first_token_time=t + 0.02)], stats=EngineStats(), stepped=True, timestamp=t + 0.03))
        await reply

    asyncio.run(scenario())
    got = {s.name: s for s in exporter.get_finished_spans()}
    assert set(got) == {"engine.request", "engine.queued", "engine.prefill", "engine.decode"}
    req = got["engine.request"]
    assert trace.format_span_id(req.parent.span_id) == SPAN and trace.format_trace_id(req.context.trace_id) == TRACE
    assert req.attributes["tandem.method"] == method and req.attributes["gen_ai.usage.output_tokens"] == 1
    assert req.end_time - req.start_time == pytest.approx(0.03e9, abs=1e3)
