"""The engine replica's Prometheus metrics, with vLLM's names and meanings under `tandem:`.

Two sources, chosen so the engine core pays nothing:

- Gauges and counters are read at scrape time from `CoreClient.stats_snapshot`, the
  `EngineStats` every step's `CoreOutputs` already carries. Its totals are monotonic since start, so
  they are exposed directly as counters: no deltas to keep, nothing done per step.
- Per-request histograms (TTFT, inter-token latency, end-to-end, queue time, token counts) and
  finished-request counts come from a step listener on the gRPC server's event loop (with the
  multiprocess core, off the core's process entirely): a dict lookup and one
  histogram observation per sequence that produced a token, plus a few at its end.

The three gauges the Gateway API inference extension reads are `tandem:num_requests_waiting`,
`tandem:num_requests_running` and `tandem:kv_cache_usage_perc`. With `--metrics-names vllm` the
families vLLM also has (`VLLM_ALIASES`) are exposed a second time under `vllm:` (an
`AliasCollector`, made at scrape time), plus `vllm:lora_requests_info` (no adapters), so the
GIE endpoint picker and the llm-d dashboards read this engine as they read vLLM. `model_name`
is the served name (`--served-model-name`, else `--model`).
"""

from __future__ import annotations

import time
from typing import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tandem.core_protocol import FinishReason, RequestOutput
from tandem.engine_service.api.core_client import CoreClient
from tandem.metrics import (
    ITL_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    STEP_BUCKETS,
    TTFT_BUCKETS,
    VLLM_PREFIX,
    AliasCollector,
    name,
    new_registry,
    token_buckets,
)

LABELS = ["model_name"]

# The families whose name and meaning are vLLM's, aliased under `vllm:` with --metrics-names vllm.
VLLM_ALIASES = (
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens", "generation_tokens",
    "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "cache_config_info",
    "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
    "request_queue_time_seconds", "request_prompt_tokens", "request_generation_tokens", "request_success",
)

# (metric base name, snapshot key, help) for the values read from the stats snapshot.
_GAUGES = (
    ("num_requests_running", "num_running", "Requests in the running batch (scheduled each step)."),
    ("num_requests_waiting", "num_waiting", "Requests waiting to be scheduled (new or preempted)."),
    ("kv_cache_usage_perc", "kv_usage",
     "Fraction of KV-cache blocks held by requests, 0..1 (blocks kept only for prefix reuse are free)."),
    ("state_checkpoints_used", "state_checkpoints_used",
     "State checkpoint slots holding a checkpoint or a save in flight (models with recurrent state)."),
    ("kv_transfer_leases_active", "kv_leases_active",
     "Producer: finished prefills whose blocks wait under a lease for the decode leg's pull."),
    ("kv_transfer_loading_requests", "kv_loading_requests",
     "Consumer: requests holding blocks while their KV is pulled from a producer."),
)
_COUNTERS = (
    ("prompt_tokens", "prompt_tokens_total", "Prompt tokens of requests admitted to the engine."),
    ("generation_tokens", "generation_tokens_total", "Tokens generated (sampled) by the engine."),
    ("prefix_cache_queries", "prefix_cache_queries", "Tokens looked up in the prefix cache at admission."),
    ("prefix_cache_hits", "prefix_cache_hits", "Of the tokens looked up, those served from the prefix cache."),
    ("prefix_cache_kv_hits", "prefix_cache_kv_hits",
     "Of the tokens looked up, those whose KV blocks were cached; above prefix_cache_hits only for models "
     "with recurrent state, whose hits end at the last state checkpoint."),
    ("state_checkpoint_saves", "state_checkpoint_saves", "State checkpoints saved for prefix caching."),
    ("num_preemptions", "num_preemptions", "Requests preempted (recompute) because KV blocks ran out."),
    ("engine_steps", "steps_total", "Engine steps that ran the model."),
    # Disaggregated prefill/decode (zero on an engine without a --kv-role).
    ("kv_transfer_tokens_loaded", "kv_remote_tokens_loaded",
     "Prompt tokens whose KV this engine pulled from a producer engine instead of computing."),
    ("kv_transfer_blocks_pulled", "kv_remote_blocks_pulled", "KV blocks pulled from producer engines."),
    ("kv_transfer_bytes_pulled", "kv_remote_bytes_pulled", "KV bytes pulled from producer engines."),
    ("kv_transfer_load_failures", "kv_remote_load_failures", "KV pulls that failed (the request ended with an error)."),
    ("kv_transfer_leases_expired", "kv_leases_expired", "Producer leases that expired without a pull."),
)


class _SnapshotCollector(Collector):
    """Exposes the engine's last stats snapshot; runs on the scrape thread, never on the engine's."""

    def __init__(self, engine: CoreClient, model_name: str, block_size: int, num_blocks: int,
                 prefix_caching: bool) -> None:
        self._engine = engine
        self._labels = [model_name]
        self._config = {"block_size": str(block_size), "num_gpu_blocks": str(num_blocks),
                        "enable_prefix_caching": str(prefix_caching)}

    def collect(self) -> Iterable[Metric]:
        snap = self._engine.stats_snapshot  # replaced whole after each step: a consistent view
        for base, key, help_text in _GAUGES:
            g = GaugeMetricFamily(name(base), help_text, labels=LABELS)
            g.add_metric(self._labels, float(getattr(snap, key)))
            yield g
        for base, key, help_text in _COUNTERS:
            c = CounterMetricFamily(name(base), help_text, labels=LABELS)
            c.add_metric(self._labels, float(getattr(snap, key)))
            yield c
        info = GaugeMetricFamily(name("cache_config_info"), "KV-cache configuration (value is always 1).",
                                 labels=list(self._config))
        info.add_metric(list(self._config.values()), 1.0)
        yield info


class _LoraInfoCollector(Collector):
    """`vllm:lora_requests_info` as vLLM exposes it without adapters: GIE's LoRA-affinity
    scorer reads its labels (`max_lora` 0, no running or waiting adapters)."""

    def collect(self) -> Iterable[Metric]:
        g = GaugeMetricFamily(VLLM_PREFIX + "lora_requests_info", "Running and waiting LoRA adapters (none: Tandem "
                              "serves no adapters); the value is the scrape time.",
                              labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        g.add_metric(["0", "", ""], time.time())
        yield g


class EngineMetrics:
    """Registers the engine's metrics and listens to its steps (see the module docstring).

    `names`: "tandem" (the `tandem:` families only) or "vllm" (also `vllm:` aliases)."""

    def __init__(self, engine: CoreClient, model_name: str, registry: CollectorRegistry | None = None,
                 names: str = "tandem") -> None:
        self.registry = registry if registry is not None else new_registry(process_metrics=False)
        self._engine = engine
        info = engine.info
        snapshot = _SnapshotCollector(engine, model_name, info.block_size, info.kv_blocks, info.enable_prefix_caching)
        self.registry.register(snapshot)
        r = self.registry
        families: list[Collector] = [snapshot]

        def hist(base: str, help_text: str, buckets) -> Histogram:
            parent = Histogram(name(base), help_text, LABELS, buckets=buckets, registry=r)
            families.append(parent)
            return parent.labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Arrival at the engine to the first generated token.",
                         TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds",
                        "Time between consecutive engine steps that gave one request tokens.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival at the engine to the request's end.",
                        REQUEST_LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Arrival at the engine to its first scheduled step.",
                          REQUEST_LATENCY_BUCKETS)
        self.step = hist("engine_step_seconds", "Duration of one engine step (schedule, model, sample).",
                         STEP_BUCKETS)
        max_len = max(1, info.max_model_len)
        self.prompt_len = hist("request_prompt_tokens", "Prompt tokens per finished request.", token_buckets(max_len))
        self.output_len = hist("request_generation_tokens", "Generated tokens per finished request.",
                               token_buckets(max_len))
        success = Counter(name("request_success"), "Requests ended, by finish reason (stop, length, abort, error).",
                          LABELS + ["finished_reason"], registry=r)
        # Children made up front: every reason's series exists from the start (rate() needs it)
        # and the listener does a dict lookup instead of a labels() call.
        self.success = {reason: success.labels(model_name, reason.value) for reason in FinishReason}
        families.append(success)
        if names == "vllm":
            r.register(AliasCollector(families, VLLM_ALIASES))
            r.register(_LoraInfoCollector())
        elif names != "tandem":
            raise ValueError(f"metric names: expected 'tandem' or 'vllm', got {names!r}")
        self._last_token_time: dict[str, float] = {}
        engine.step_listeners.append(self.on_step)

    # -- step listener -----------------------------------------------------------------------
    def on_step(self, outputs: list[RequestOutput], step_time: float, stepped: bool = True,
                timestamp: float | None = None) -> None:
        """Step listener: runs on the event loop for each step that produced outputs; times are
        taken at `timestamp`, the core's clock when it sent the step (the same monotonic clock)."""
        now = timestamp or time.monotonic()
        if stepped:  # outputs from aborts alone come without a model step
            self.step.observe(step_time)
        last = self._last_token_time
        for o in outputs:
            if o.new_token_ids:
                previous = last.get(o.request_id)
                if previous is None:
                    if o.arrival_time:
                        self.ttft.observe(now - o.arrival_time)
                else:
                    self.itl.observe(now - previous)
                last[o.request_id] = now
            if o.finished:
                last.pop(o.request_id, None)
                self._on_finished(o, now)

    def _on_finished(self, o: RequestOutput, now: float) -> None:
        if not o.arrival_time:
            # An abort of a request the engine no longer had (it finished in the same step the
            # consumer went away) is already counted; an add that failed validation is not.
            if o.finish_reason == FinishReason.ERROR:
                self.success[FinishReason.ERROR].inc()
            return
        self.success[o.finish_reason or FinishReason.ERROR].inc()
        self.e2e.observe(now - o.arrival_time)
        if o.first_scheduled_time is not None:
            self.queue.observe(max(0.0, o.first_scheduled_time - o.arrival_time))
        self.prompt_len.observe(o.num_prompt_tokens)
        self.output_len.observe(o.num_output_tokens)
