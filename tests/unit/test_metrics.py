"""Metric bookkeeping without servers: the engine's step listener and snapshot collector, the
frontend's request tracker, and how a call's outcome is named."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tandem.core_protocol import EngineStats, FinishReason
from tandem.core_protocol import RequestOutput as StepOutput
from tandem.engine_service.api.metrics import EngineMetrics
from tandem.frontend.metrics import FrontendMetrics
from tandem.metrics import token_buckets
from tandem.request_scope import RequestScope, grpc_outcome
from tandem.tracing import parent_context
from tandem.v1 import common_pb2, frontend_pb2

MODEL = {"model_name": "m"}


def _snapshot(**overrides) -> EngineStats:
    return EngineStats(kv_blocks_total=100, **overrides)


def _fake_core_client():
    info = SimpleNamespace(block_size=16, kv_blocks=100, enable_prefix_caching=True, max_model_len=2048)
    return SimpleNamespace(info=info, stats_snapshot=_snapshot(), step_listeners=[])


def _value(registry, name: str, **labels) -> float:
    v = registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


def test_snapshot_is_exposed_as_gauges_and_counters():
    engine = _fake_core_client()
    metrics = EngineMetrics(engine, "m")
    engine.stats_snapshot = _snapshot(num_running=3, num_waiting=2, kv_usage=0.25, prompt_tokens_total=40,
                                      generation_tokens_total=7, prefix_cache_queries=40, prefix_cache_hits=16,
                                      num_preemptions=1, steps_total=9)
    r = metrics.registry
    assert _value(r, "tandem:num_requests_running", **MODEL) == 3
    assert _value(r, "tandem:num_requests_waiting", **MODEL) == 2
    assert _value(r, "tandem:kv_cache_usage_perc", **MODEL) == 0.25
    assert _value(r, "tandem:prompt_tokens_total", **MODEL) == 40
    assert _value(r, "tandem:generation_tokens_total", **MODEL) == 7
    assert _value(r, "tandem:prefix_cache_queries_total", **MODEL) == 40
    assert _value(r, "tandem:prefix_cache_hits_total", **MODEL) == 16
    assert _value(r, "tandem:num_preemptions_total", **MODEL) == 1
    assert _value(r, "tandem:engine_steps_total", **MODEL) == 9
    # The exposition parses, and the counters are typed as counters (the gateway reads gauges).
    families = {f.name: f.type for f in text_string_to_metric_families(generate_latest(r).decode())}
    assert families["tandem:num_requests_waiting"] == "gauge"
    assert families["tandem:kv_cache_usage_perc"] == "gauge"
    assert families["tandem:generation_tokens"] == "counter"
    assert families["tandem:time_to_first_token_seconds"] == "histogram"


def test_step_listener_times_tokens_and_counts_endings():
    engine = _fake_core_client()
    metrics = EngineMetrics(engine, "m")
    assert engine.step_listeners == [metrics.on_step]
    r = metrics.registry
    arrival = 1.0  # monotonic seconds, long ago: every latency is positive

    def step(outputs, steps_total):
        stepped = steps_total != engine.stats_snapshot.steps_total
        engine.stats_snapshot = _snapshot(steps_total=steps_total)
        metrics.on_step(outputs, 0.01, stepped)

    step([StepOutput("a", new_token_ids=[1], arrival_time=arrival),
          StepOutput("b", new_token_ids=[2], arrival_time=arrival)], 1)
    step([StepOutput("a", new_token_ids=[3], arrival_time=arrival),
          StepOutput("b", new_token_ids=[4], arrival_time=arrival)], 2)
    step([StepOutput("a", new_token_ids=[5], arrival_time=arrival, finished=True,
                     finish_reason=FinishReason.LENGTH, num_prompt_tokens=10, num_output_tokens=3,
                     first_scheduled_time=arrival + 0.5)], 3)
    # b is aborted from the inbox: no model step ran for this listener call.
    step([StepOutput("b", finished=True, finish_reason=FinishReason.ABORT, num_prompt_tokens=10,
                     num_output_tokens=2, arrival_time=arrival)], 3)
    # An abort of a request the engine no longer had (arrival 0) is not a second ending...
    step([StepOutput("a", finished=True, finish_reason=FinishReason.ABORT)], 3)
    # ...but an add that failed validation is an error ending.
    step([StepOutput("c", finished=True, finish_reason=FinishReason.ERROR, error="bad")], 3)

    assert _value(r, "tandem:time_to_first_token_seconds_count", **MODEL) == 2
    assert _value(r, "tandem:inter_token_latency_seconds_count", **MODEL) == 3  # a: 2, b: 1
    assert _value(r, "tandem:engine_step_seconds_count", **MODEL) == 3
    assert _value(r, "tandem:e2e_request_latency_seconds_count", **MODEL) == 2
    assert _value(r, "tandem:request_queue_time_seconds_count", **MODEL) == 1
    assert _value(r, "tandem:request_queue_time_seconds_sum", **MODEL) == pytest.approx(0.5)
    assert _value(r, "tandem:request_generation_tokens_sum", **MODEL) == 5
    assert _value(r, "tandem:request_prompt_tokens_sum", **MODEL) == 20
    for reason, expected in (("length", 1), ("abort", 1), ("error", 1), ("stop", 0)):
        assert _value(r, "tandem:request_success_total", finished_reason=reason, **MODEL) == expected, reason
    assert metrics._last_token_time == {}  # nothing kept for ended requests


def test_vllm_names_alias_the_gateway_families_with_the_served_name():
    engine = _fake_core_client()
    metrics = EngineMetrics(engine, "served-name", names="vllm")
    engine.stats_snapshot = _snapshot(num_running=3, num_waiting=2, kv_usage=0.25, prompt_tokens_total=40)
    metrics.on_step([StepOutput("a", new_token_ids=[1], arrival_time=1.0)], 0.01, True)
    r = metrics.registry
    served = {"model_name": "served-name"}
    for base, value in (("num_requests_running", 3), ("num_requests_waiting", 2), ("kv_cache_usage_perc", 0.25),
                        ("prompt_tokens_total", 40), ("time_to_first_token_seconds_count", 1)):
        assert _value(r, f"vllm:{base}", **served) == value, base
        assert _value(r, f"tandem:{base}", **served) == value, base  # the tandem: names stay
    assert _value(r, "vllm:request_success_total", finished_reason="stop", **served) == 0
    assert r.get_sample_value("vllm:request_success_total", {"finished_reason": "stop", **served}) is not None
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(r).decode())}
    assert families["vllm:num_requests_waiting"].type == "gauge"
    assert families["vllm:time_to_first_token_seconds"].type == "histogram"
    assert families["vllm:request_success"].type == "counter"
    assert families["vllm:lora_requests_info"].samples[0].labels["max_lora"] == "0"
    assert "vllm:engine_steps" not in families  # Tandem's own families keep their one name
    # A later snapshot shows through the alias at the next scrape (nothing is copied ahead).
    engine.stats_snapshot = _snapshot(num_waiting=7)
    assert _value(r, "vllm:num_requests_waiting", **served) == 7


def test_tandem_names_by_default():
    r = EngineMetrics(_fake_core_client(), "m").registry
    assert not [f for f in text_string_to_metric_families(generate_latest(r).decode()) if f.name.startswith("vllm:")]
    with pytest.raises(ValueError):
        EngineMetrics(_fake_core_client(), "m", names="other")


def test_frontend_tracker_records_one_request():
    m = FrontendMetrics()
    r = m.registry
    t = m.track("Stream")
    assert _value(r, "tandem:frontend_requests_in_flight") == 1
    t.on_engine_message(0, 0)  # the partial-usage message carries no token: not a first token
    assert _value(r, "tandem:frontend_time_to_first_token_seconds_count") == 0
    t.on_engine_message(0, 1)
    t.on_engine_message(1, 1)
    t.on_engine_message(0, 2)
    t.on_engine_message(1, 1)
    final = frontend_pb2.GenerateStreamResponse()
    final.choices.add(index=0, finish_reason=common_pb2.FINISH_REASON_LENGTH)
    final.choices.add(index=1, finish_reason=common_pb2.FINISH_REASON_STOP)
    final.usage.prompt_tokens, final.usage.completion_tokens = 7, 5
    t.on_response(final)
    t.end("OK")
    t.end("OK")  # a second end changes nothing
    assert _value(r, "tandem:frontend_requests_in_flight") == 0
    assert _value(r, "tandem:frontend_requests_total", method="Stream", code="OK") == 1
    assert _value(r, "tandem:frontend_time_to_first_token_seconds_count") == 1
    assert _value(r, "tandem:frontend_inter_token_latency_seconds_count") == 2  # one per choice
    assert _value(r, "tandem:frontend_e2e_request_latency_seconds_count") == 1
    assert _value(r, "tandem:frontend_prompt_tokens_total") == 7
    assert _value(r, "tandem:frontend_generation_tokens_total") == 5
    assert _value(r, "tandem:frontend_request_success_total", finished_reason="length") == 1
    assert _value(r, "tandem:frontend_request_success_total", finished_reason="stop") == 1
    assert t.finish_reasons() == ["length", "stop"]


def test_frontend_replica_gauges():
    replicas = [SimpleNamespace(address="10.0.0.1:50052", healthy=True, in_flight=2),
                SimpleNamespace(address="10.0.0.2:50052", healthy=False, in_flight=0)]
    m = FrontendMetrics(SimpleNamespace(replicas=replicas))
    assert _value(m.registry, "tandem:frontend_engine_healthy", address="10.0.0.1:50052") == 1
    assert _value(m.registry, "tandem:frontend_engine_healthy", address="10.0.0.2:50052") == 0
    assert _value(m.registry, "tandem:frontend_engine_in_flight", address="10.0.0.1:50052") == 2
    replicas[1].healthy = True  # read at scrape time, not at registration
    assert _value(m.registry, "tandem:frontend_engine_healthy", address="10.0.0.2:50052") == 1


class _Context:
    def __init__(self, code=None, remaining=None):
        self._code, self._remaining = code, remaining

    def code(self):
        return self._code

    def time_remaining(self):
        return self._remaining


def test_grpc_outcome_names():
    assert grpc_outcome(None, _Context()) == "OK"
    assert grpc_outcome(grpc.aio.AbortError, _Context(grpc.StatusCode.INVALID_ARGUMENT)) == "INVALID_ARGUMENT"
    assert grpc_outcome(asyncio.CancelledError, _Context(remaining=5.0)) == "CANCELLED"
    assert grpc_outcome(GeneratorExit, _Context(remaining=None)) == "CANCELLED"
    assert grpc_outcome(asyncio.CancelledError, _Context(remaining=0.0)) == "DEADLINE_EXCEEDED"
    assert grpc_outcome(RuntimeError, _Context()) == "UNKNOWN"


def test_token_buckets():
    assert token_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert token_buckets(300) == (1, 2, 5, 10, 20, 50, 100, 200)


def test_cancel_after_the_final_response_is_ok():
    def end_with_cancel(final_sent: bool) -> str:
        scope = RequestScope(_Context(remaining=5.0), "engine", "Stream", parent_context(None),
                             request_id="r")
        with pytest.raises(asyncio.CancelledError):
            with scope:
                if final_sent:
                    scope.final_response_sent()
                raise asyncio.CancelledError
        return scope.code

    assert end_with_cancel(final_sent=False) == "CANCELLED"
    assert end_with_cancel(final_sent=True) == "OK"
