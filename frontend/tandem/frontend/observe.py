"""What the frontend records about one client call: trace span, log context, metrics, ending line."""

from __future__ import annotations

from opentelemetry import trace

from tandem.frontend.metrics import FrontendMetrics
from tandem.request_scope import RequestScope
from tandem.tracing import NO_TRACER, outgoing_metadata, parent_context


class RequestObservation(RequestScope):
    """A client call's `RequestScope` plus its metrics record (`tracker`).

    Its span (`span_name`, a child of the client's W3C `traceparent` when it sends one) is the
    parent of the request's engine calls: `engine_metadata()` carries it to them, so the
    engine's spans and both services' log lines of the request share one `trace_id`.
    """

    def __init__(self, context, method: str, metrics: FrontendMetrics, request_id: str = "",
                 tracer: trace.Tracer = NO_TRACER, span_name: str | None = None,
                 span_attributes: dict | None = None) -> None:
        super().__init__(context, "frontend", method, parent_context(context.invocation_metadata()), tracer,
                         span_name=span_name, span_attributes=span_attributes, request_id=request_id)
        self.tracker = metrics.track(method)
        self.on_end(_record)

    def registered(self, external_id: str, internal_ids: list[str]) -> None:
        """The request has its IDs: every later log line of it names them."""
        self.bind(request_id=external_id, internal_request_ids=list(internal_ids))

    def engine_metadata(self) -> tuple[tuple[str, str], ...]:
        return outgoing_metadata(self.span)


def _record(obs: RequestObservation) -> None:
    tracker = obs.tracker
    tracker.end(obs.code)
    fields: dict = {"finish_reasons": tracker.finish_reasons()}
    usage = tracker.usage
    if usage is not None:
        fields.update(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                      cached_prompt_tokens=usage.cached_prompt_tokens)
    if tracker.first_token is not None:
        fields["ttft_s"] = round(tracker.first_token - tracker.arrival, 6)
    obs.note(**fields)
