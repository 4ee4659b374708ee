"""The engine's OpenTelemetry spans of each request, built from the core's timestamps.

The core process keeps no tracer: it already stamps every request (arrival at the gRPC side,
first scheduled step, first token; all `time.monotonic()`, one clock for every process of the
host) and sends the stamps with the request's final output. This step listener, in the gRPC
process, turns them into spans once the request has ended, whatever the transport (Stream,
Generate, or a mux Submit whose outputs arrive on a Subscribe stream):

    engine.request   arrival → the step that ended it   (SERVER, child of the frontend's span)
      engine.queued  arrival → first scheduled step
      engine.prefill first scheduled step → first token (prompt chunks, and any preemption before it)
      engine.decode  first token → end

A phase the request never reached is left out (aborted while queued: `engine.queued` alone, up
to the end). `engine.request` carries the request ID, the token counts and the finish reason.
The servicer makes one only when tracing is on (`tandem.tracing.Tracing.enabled`): without it
nothing is registered and no listener runs. Invariant: a registered request is forgotten at its
final output, which every admitted request gets (the core's death aside, which ends the process).
"""

from __future__ import annotations

import time

from opentelemetry import trace
from opentelemetry.context import Context

from tandem.core_protocol import RequestOutput, StopSequence, StopToken
from tandem.tracing import epoch_ns

REQUEST_SPAN = "engine.request"


class RequestSpans:
    """Step listener (`CoreClient.step_listeners`) that records each traced request's spans."""

    def __init__(self, tracer: trace.Tracer) -> None:
        self.tracer = tracer
        # request id -> (the caller's context, the RPC that admitted it): requests in flight.
        self._pending: dict[str, tuple[Context, str]] = {}

    def begin(self, request_id: str, parent: Context, method: str) -> None:
        """Remembers an admitted request's parent context until its final output."""
        self._pending[request_id] = (parent, method)

    def on_step(self, outputs: list[RequestOutput], step_time: float, stepped: bool = True,
                timestamp: float | None = None) -> None:
        if not self._pending:
            return
        now_ns, now_mono_ns = time.time_ns(), time.monotonic_ns()
        end = timestamp or now_mono_ns / 1e9
        for o in outputs:
            if o.finished:
                begun = self._pending.pop(o.request_id, None)
                if begun is not None:
                    self._record(o, end, begun[0], begun[1], now_ns, now_mono_ns)

    def _record(self, o: RequestOutput, end: float, parent: Context, method: str, now_ns: int,
                now_mono_ns: int) -> None:
        def ns(t: float) -> int:
            return epoch_ns(t, now_ns, now_mono_ns)

        arrival = o.arrival_time or end
        reason = o.finish_reason.value if o.finish_reason is not None else "error"
        attributes = {
            "tandem.request_id": o.request_id,
            "tandem.method": method,
            "tandem.finish_reason": reason,
            "gen_ai.response.finish_reasons": [reason],
            "gen_ai.usage.input_tokens": o.num_prompt_tokens,
            "gen_ai.usage.output_tokens": o.num_output_tokens,
            "tandem.prompt_tokens": o.num_prompt_tokens,
            "tandem.completion_tokens": o.num_output_tokens,
            "tandem.cached_prompt_tokens": o.num_cached_prompt_tokens,
        }
        if isinstance(o.stop_reason, StopToken):
            attributes["tandem.stop_token_id"] = o.stop_reason.token_id
        elif isinstance(o.stop_reason, StopSequence):
            attributes["tandem.stop_sequence_index"] = o.stop_reason.index
        span = self.tracer.start_span(REQUEST_SPAN, context=parent, kind=trace.SpanKind.SERVER,
                                      attributes=attributes, start_time=ns(arrival))
        if o.error:
            span.set_status(trace.StatusCode.ERROR, o.error)
        inside = trace.set_span_in_context(span)
        marks = [("engine.queued", arrival), ("engine.prefill", o.first_scheduled_time),
                 ("engine.decode", o.first_token_time)]
        reached = [(name, t) for name, t in marks if t is not None]
        for i, (name, start) in enumerate(reached):
            stop = reached[i + 1][1] if i + 1 < len(reached) else end
            self.tracer.start_span(name, context=inside, start_time=ns(start)).end(end_time=ns(max(start, stop)))
        span.end(end_time=ns(end))
