"""Prometheus plumbing shared by both services: registries, buckets and the HTTP endpoint.

Metric names follow vLLM's scheme, `tandem:<name>`: prometheus_client accepts ':' in metric
names (the exposition format reserves it for recording rules by convention only, and vLLM uses
it the same way), never in label names. Counters are declared without `_total`; the client
library appends it on exposition.

Each service keeps its metrics in its own `CollectorRegistry` rather than the library's global
one, so tests can build several services in one process and nothing registered by a third-party
import leaks into the scrape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import structlog
from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

log = structlog.get_logger(__name__)

PREFIX = "tandem:"

# Seconds. Wide on purpose: a CPU-only replica takes seconds where a GPU takes milliseconds,
# and a queue under overload can hold a request for minutes.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3,
                0.5, 0.75, 1.0, 2.5, 5.0, 10.0)


def token_buckets(max_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_len` (for per-request token-count histograms)."""
    out: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_len:
                return tuple(out)
            out.append(value)
        exponent += 1


def name(base: str) -> str:
    """`tandem:<base>`: the one place the prefix is applied."""
    return PREFIX + base


VLLM_PREFIX = "vllm:"


def renamed(metric: Metric, prefix: str) -> Metric:
    """A copy of `metric` (a `tandem:` family) under `prefix`: its name and its samples' names
    (`_total`, `_bucket`, `_sum`, `_count`) with `tandem:` replaced; labels and values shared."""
    copy = Metric(prefix + metric.name[len(PREFIX):], metric.documentation, metric.type, metric.unit)
    copy.samples = [s._replace(name=prefix + s.name[len(PREFIX):]) for s in metric.samples]
    return copy


class AliasCollector(Collector):
    """Re-exposes chosen `tandem:` families of `sources` under `prefix` (`vllm:` for the
    gateways and dashboards that read vLLM's names) at scrape time.

    The aliases are made while a scrape runs, from the sources' own samples: no second
    observation per token, and an alias can never disagree with its original. `bases` are the
    names without prefix (`num_requests_waiting`); families of the sources not listed are left out.
    """

    def __init__(self, sources: Iterable[Collector], bases: Iterable[str], prefix: str = VLLM_PREFIX) -> None:
        self._sources = list(sources)
        self._names = {PREFIX + b for b in bases}
        self._prefix = prefix

    def collect(self) -> Iterable[Metric]:
        for source in self._sources:
            for metric in source.collect():
                if metric.name in self._names:
                    yield renamed(metric, self._prefix)


def new_registry(process_metrics: bool = True) -> CollectorRegistry:
    """A per-service registry, with the standard process/platform/GC collectors if asked."""
    registry = CollectorRegistry(auto_describe=True)
    if process_metrics:
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
    return registry


@dataclass
class MetricsEndpoint:
    """A running /metrics HTTP server (its own daemon thread); `port` is the bound one."""

    host: str
    port: int
    _server: Any
    _thread: Any

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def start_metrics_endpoint(registry: CollectorRegistry, host: str, port: int) -> MetricsEndpoint:
    """Serves `registry` in the Prometheus text format on http://host:port/ (any path).

    The server runs on its own thread, so a scrape never waits on the asyncio loop or the
    engine core; collectors that read engine state read the core's last stats snapshot.
    """
    # The `_created` timestamp series double the scrape's size and nothing here reads them
    # (vLLM turns them off too). The switch is process-wide; only server processes get here.
    disable_created_metrics()
    server, thread = start_http_server(port, addr=host, registry=registry)
    bound = server.server_address[1]
    log.info("metrics_listening", address=f"{host}:{bound}")
    return MetricsEndpoint(host, bound, server, thread)
