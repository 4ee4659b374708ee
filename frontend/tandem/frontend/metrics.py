"""The frontend's Prometheus metrics: client requests as the client sees them.

Named `tandem:frontend_<name>` so that a query over both services' targets never mixes the
frontend's view (which includes tokenization, routing and the engine hop) with the engine's
(`tandem:<name>`, vLLM's names). Latency histograms and token counters are per client request
(token counters from the usage the client receives); finish reasons are per choice, like the
engine's requests.
"""

from __future__ import annotations

import time
from typing import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tandem.metrics import ITL_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS, name, new_registry
from tandem.v1 import common_pb2

# Finish reasons by proto value, as the engine's metric labels spell them.
_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
}


def reason_label(value: int) -> str:
    return _REASONS.get(value, "unspecified")


class _ReplicaCollector(Collector):
    """Health and load of each engine replica, read from the pool at scrape time."""

    def __init__(self, pool) -> None:
        self._pool = pool

    def collect(self) -> Iterable[Metric]:
        healthy = GaugeMetricFamily(name("frontend_engine_healthy"),
                                    "1 if the engine replica passes its readiness check and is in rotation.",
                                    labels=["address"])
        in_flight = GaugeMetricFamily(name("frontend_engine_in_flight"),
                                      "Client requests this frontend has in flight on the engine replica.",
                                      labels=["address"])
        for replica in list(self._pool.replicas):
            healthy.add_metric([replica.address], 1.0 if replica.healthy else 0.0)
            in_flight.add_metric([replica.address], float(replica.in_flight))
        yield healthy
        yield in_flight


class FrontendMetrics:
    """Defines the frontend's metrics; `track()` starts the record of one client request."""

    def __init__(self, pool=None, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else new_registry(process_metrics=False)
        r = self.registry
        if pool is not None:
            r.register(_ReplicaCollector(pool))
        self.requests = Counter(name("frontend_requests"), "Client requests ended, by method and gRPC status.",
                                ["method", "code"], registry=r)
        self.in_flight = Gauge(name("frontend_requests_in_flight"), "Client requests in flight.", registry=r)
        self.choices = Counter(name("frontend_request_success"),
                               "Choices that ended with a finish reason (stop, length, abort, error).",
                               ["finished_reason"], registry=r)
        self.prompt_tokens = Counter(name("frontend_prompt_tokens"),
                                     "Prompt tokens of completed client requests (their usage.prompt_tokens).",
                                     registry=r)
        self.generation_tokens = Counter(name("frontend_generation_tokens"),
                                         "Completion tokens of completed client requests (usage.completion_tokens).",
                                         registry=r)
        self.ttft = Histogram(name("frontend_time_to_first_token_seconds"),
                              "Arrival at the frontend to the first token from the engine.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(name("frontend_inter_token_latency_seconds"),
                             "Time between consecutive token-carrying engine messages of one choice.",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(name("frontend_e2e_request_latency_seconds"),
                             "Arrival at the frontend to the end of the client call, any outcome.",
                             buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        # Created up front so each series exists at zero from the start (rate() needs that).
        for reason in _REASONS.values():
            self.choices.labels(reason)

    def track(self, method: str) -> "RequestTracker":
        return RequestTracker(self, method)


class RequestTracker:
    """Timing and outcome of one client request, fed from the request path, recorded at its end."""

    __slots__ = ("_m", "method", "arrival", "first_token", "_last", "_reasons", "_usage", "_ended")

    def __init__(self, metrics: FrontendMetrics, method: str) -> None:
        self._m = metrics
        self.method = method
        self.arrival = time.monotonic()
        self.first_token: float | None = None
        self._last: dict[int, float] = {}  # choice index -> time of its last token-carrying message
        self._reasons: dict[int, int] = {}
        self._usage: common_pb2.Usage | None = None
        self._ended = False
        metrics.in_flight.inc()

    def on_engine_message(self, choice: int, num_tokens: int) -> None:
        """An engine message for `choice` arrived carrying `num_tokens` tokens."""
        if not num_tokens:
            return
        now = time.monotonic()
        if self.first_token is None:
            self.first_token = now
            self._m.ttft.observe(now - self.arrival)
        previous = self._last.get(choice)
        if previous is not None:
            self._m.itl.observe(now - previous)
        self._last[choice] = now

    def on_response(self, msg) -> None:
        """A message about to go to the client: remembers finish reasons and the final usage."""
        for c in msg.choices:
            if c.finish_reason:
                self._reasons[c.index] = c.finish_reason
        if msg.HasField("usage"):
            self._usage = msg.usage

    @property
    def usage(self) -> common_pb2.Usage | None:
        return self._usage

    def finish_reasons(self) -> list[str]:
        return [reason_label(self._reasons[i]) for i in sorted(self._reasons)]

    def end(self, code: str) -> None:
        """Records the request's outcome once; later calls do nothing."""
        if self._ended:
            return
        self._ended = True
        m = self._m
        m.in_flight.dec()
        m.requests.labels(self.method, code).inc()
        m.e2e.observe(time.monotonic() - self.arrival)
        for value in self._reasons.values():
            m.choices.labels(reason_label(value)).inc()
        if self._usage is not None:
            m.prompt_tokens.inc(self._usage.prompt_tokens)
            m.generation_tokens.inc(self._usage.completion_tokens)
