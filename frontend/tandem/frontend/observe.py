"""What the frontend records about one client call: trace, log context, metrics, ending line."""

from __future__ import annotations

from tandem.frontend.metrics import FrontendMetrics
from tandem.request_scope import RequestScope
from tandem.tracing import TraceContext


class RequestObservation(RequestScope):
    """A client call's `RequestScope` plus its metrics record (`tracker`).

    Continues the client's W3C trace (or starts one); `engine_metadata()` carries it to the
    engine calls so both services' log lines of the request share one `trace_id`.
    """

    def __init__(self, context, method: str, metrics: FrontendMetrics, request_id: str = "") -> None:
        super().__init__(context, "frontend", method, TraceContext.from_metadata(context.invocation_metadata()),
                         request_id=request_id)
        self.tracker = metrics.track(method)
        self.on_end(_record)

    def registered(self, external_id: str, internal_ids: list[str]) -> None:
        """The request has its IDs: every later log line of it names them."""
        self.bind(request_id=external_id, internal_request_ids=list(internal_ids))

    def engine_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.trace.outgoing_metadata()


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
