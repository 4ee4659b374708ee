"""Prometheus metrics, request log lines and trace propagation on a real `tandem serve`.

One server with both metrics endpoints, info-level logs captured to a file, and a batch cap of 3
so that six concurrent requests leave three waiting: the load test can see both gauges move.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
import urllib.request
from collections import defaultdict

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.client import TandemClient

MAX_NUM_SEQS = 3
NUM_REQUESTS = 6
MAX_TOKENS = 48
# Long enough (> 2 blocks of 16 tokens) that later requests reuse earlier ones' prompt blocks.
PROMPT = ("The quick brown fox jumps over the lazy dog while the cat watches from the windowsill, "
          "and then the dog wakes up and chases the fox across the green field towards the river.")


@pytest.fixture(scope="module")
def observed(launch_serve, get_free_port, tmp_path_factory):
    log_file = tmp_path_factory.mktemp("logs") / "serve.log"
    fport, eport = get_free_port(), get_free_port()
    # The stream transport (serve's default is mux): the engine's `request_end` line of a request's
    # own Stream call (a mux request's line: tests/integration/test_tracing_otlp.py).
    server, frontend, _ = launch_serve(
        ["--metrics-host", "127.0.0.1", "--metrics-port", str(fport), "--engine-metrics-port", str(eport),
         "--max-num-seqs", str(MAX_NUM_SEQS), "--num-kv-blocks", "256", "--engine-transport", "stream"],
        env={"TANDEM_LOG_LEVEL": "info"}, stderr=log_file,
    )
    yield {"frontend": frontend, "frontend_metrics": fport, "engine_metrics": eport, "log": log_file}
    server.stop()


class Scrape:
    """One scrape of a /metrics endpoint: sample values by name and labels."""

    def __init__(self, port: int) -> None:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        self.samples: dict[str, list[tuple[dict, float]]] = defaultdict(list)
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                self.samples[s.name].append((s.labels, s.value))

    def get(self, name: str, **labels) -> float:
        """Sum of the samples of `name` whose labels include `labels` (0 when there are none)."""
        return sum(v for lbl, v in self.samples.get(name, []) if all(lbl.get(k) == x for k, x in labels.items()))


def _delta(before: Scrape, after: Scrape, name: str, **labels) -> float:
    return after.get(name, **labels) - before.get(name, **labels)


def test_metrics_follow_a_concurrent_load(observed):
    eport, fport = observed["engine_metrics"], observed["frontend_metrics"]
    e0, f0 = Scrape(eport), Scrape(fport)
    assert e0.get("tandem:num_requests_running") == 0 and e0.get("tandem:num_requests_waiting") == 0
    assert f0.get("tandem:frontend_engine_healthy") == 1

    usages, reasons, errors = [], [], []
    lock = threading.Lock()

    def run(client: TandemClient, i: int) -> None:
        try:
            usage, finish = None, []
            for msg in client.stream(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                     request_id=f"metrics-load-{i}", timeout=120):
                finish += [c.finish_reason for c in msg.choices if c.finish_reason]
                if msg.HasField("usage"):
                    usage = msg.usage
            with lock:
                usages.append(usage)
                reasons.extend(finish)
        except Exception as exc:  # surfaced by the main thread
            with lock:
                errors.append(exc)

    with TandemClient(observed["frontend"]) as client:
        threads = [threading.Thread(target=run, args=(client, i), daemon=True) for i in range(NUM_REQUESTS)]
        for t in threads:
            t.start()
        # Scrape while the streams are open: both gauges, KV use and the frontend's view.
        seen_full_batch = seen_queue = False
        max_kv = max_in_flight = max_replica_in_flight = 0.0
        deadline = time.monotonic() + 120
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            e, f = Scrape(eport), Scrape(fport)
            running, waiting = e.get("tandem:num_requests_running"), e.get("tandem:num_requests_waiting")
            assert running <= MAX_NUM_SEQS
            seen_full_batch |= running == MAX_NUM_SEQS
            seen_queue |= waiting > 0
            max_kv = max(max_kv, e.get("tandem:kv_cache_usage_perc"))
            max_in_flight = max(max_in_flight, f.get("tandem:frontend_requests_in_flight"))
            max_replica_in_flight = max(max_replica_in_flight, f.get("tandem:frontend_engine_in_flight"))
            time.sleep(0.05)
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not errors, errors
    assert len(usages) == NUM_REQUESTS and all(u is not None for u in usages)
    assert seen_full_batch and seen_queue
    assert 0 < max_kv <= 1
    assert max_in_flight == NUM_REQUESTS and max_replica_in_flight == NUM_REQUESTS

    # After the load: the request bookkeeping settles (the frontend records a call once its
    # handler returns, just after the client has the last message), and the gauges are idle.
    deadline = time.monotonic() + 15
    while True:
        e1, f1 = Scrape(eport), Scrape(fport)
        idle = (e1.get("tandem:num_requests_running") == 0 and e1.get("tandem:num_requests_waiting") == 0
                and e1.get("tandem:kv_cache_usage_perc") == 0 and f1.get("tandem:frontend_requests_in_flight") == 0
                and _delta(f0, f1, "tandem:frontend_requests_total", method="Stream", code="OK") == NUM_REQUESTS)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert idle, "gauges did not return to idle"
    assert f1.get("tandem:frontend_engine_in_flight") == 0

    prompt = sum(u.prompt_tokens for u in usages)
    completion = sum(u.completion_tokens for u in usages)
    cached = sum(u.cached_prompt_tokens for u in usages)
    assert completion == NUM_REQUESTS * MAX_TOKENS and reasons == [2] * NUM_REQUESTS  # FINISH_REASON_LENGTH

    # Engine counters: exactly the tokens the clients were told about.
    assert _delta(e0, e1, "tandem:generation_tokens_total") == completion
    assert _delta(e0, e1, "tandem:prompt_tokens_total") == prompt
    assert _delta(e0, e1, "tandem:prefix_cache_queries_total") == prompt
    assert _delta(e0, e1, "tandem:prefix_cache_hits_total") == cached > 0  # later requests reuse the prompt
    assert _delta(e0, e1, "tandem:num_preemptions_total") == 0
    assert _delta(e0, e1, "tandem:request_success_total", finished_reason="length") == NUM_REQUESTS
    # Engine histograms: one TTFT, e2e and queue time per request; one inter-token gap per token
    # after the first (each step gives a running request exactly one token); one step time per
    # model step (every step here sampled some request).
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens"):
        assert _delta(e0, e1, f"tandem:{name}_count") == NUM_REQUESTS, name
    assert _delta(e0, e1, "tandem:inter_token_latency_seconds_count") == completion - NUM_REQUESTS
    assert _delta(e0, e1, "tandem:request_generation_tokens_sum") == completion
    assert _delta(e0, e1, "tandem:request_queue_time_seconds_sum") > 0  # three requests waited a round
    steps = _delta(e0, e1, "tandem:engine_steps_total")
    assert steps >= 2 * MAX_TOKENS  # two rounds of the batch cap
    assert _delta(e0, e1, "tandem:engine_step_seconds_count") == steps

    # Frontend: the same tokens, per-request histograms, outcomes per choice.
    assert _delta(f0, f1, "tandem:frontend_generation_tokens_total") == completion
    assert _delta(f0, f1, "tandem:frontend_prompt_tokens_total") == prompt
    assert _delta(f0, f1, "tandem:frontend_request_success_total", finished_reason="length") == NUM_REQUESTS
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert _delta(f0, f1, f"tandem:frontend_{name}_count") == NUM_REQUESTS, name
    # One gap per token-carrying engine message after the first; the engine may coalesce steps.
    assert 0 < _delta(f0, f1, "tandem:frontend_inter_token_latency_seconds_count") <= completion - NUM_REQUESTS


def _log_lines(path) -> list[dict]:
    out = []
    for raw in path.read_text(errors="replace").splitlines():
        try:
            line = json.loads(raw)
        except ValueError:
            continue  # not ours (e.g. a native gRPC message)
        if isinstance(line, dict):
            out.append(line)
    return out


def _wait_for_lines(path, want, timeout: float = 15.0) -> list[dict]:
    """Log lines once `want(lines)` holds (the engine logs its end concurrently with the reply)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = _log_lines(path)
        if want(lines) or time.monotonic() > deadline:
            return lines
        time.sleep(0.1)


def _ends(lines, service: str) -> list[dict]:
    return [x for x in lines if x.get("event") == "request_end" and x.get("service") == service]


def test_request_logs_carry_ids_and_one_trace(observed):
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    traced = [("traceparent", f"00-{trace_id}-{client_span}-01"), ("tracestate", "vendor=abc")]
    with TandemClient(observed["frontend"], metadata=traced) as c:
        c.generate("Hello there", max_tokens=8, temperature=0.0, ignore_eos=True, request_id="log-traced")
    with TandemClient(observed["frontend"]) as c:
        c.generate("Hello there", max_tokens=8, temperature=0.0, ignore_eos=True, request_id="log-untraced")
        with pytest.raises(grpc.RpcError) as err:
            c.generate("Hello there", max_tokens=8, top_p=2.0, request_id="log-invalid")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    def frontend_end(lines, rid):
        return next((x for x in _ends(lines, "frontend") if x.get("request_id") == rid), None)

    def engine_end(lines, internal_id):
        return next((x for x in _ends(lines, "engine") if x.get("request_id") == internal_id), None)

    def complete(lines):
        fe = [frontend_end(lines, r) for r in ("log-traced", "log-untraced", "log-invalid")]
        return all(fe) and all(engine_end(lines, x["internal_request_ids"][0]) for x in fe[:2])

    lines = _wait_for_lines(observed["log"], complete)
    assert complete(lines), "request_end lines missing from the servers' stderr"

    fe = frontend_end(lines, "log-traced")
    assert fe["code"] == "OK" and fe["finish_reasons"] == ["length"] and fe["completion_tokens"] == 8
    # No --otlp-endpoint: no spans of their own (the no-op tracer), the client's trace passed on
    # unchanged, so both services' lines name the client's trace and span (with a collector,
    # tests/integration/test_tracing_otlp.py).
    assert fe["trace_id"] == trace_id and fe["parent_span_id"] == client_span and "span_id" not in fe
    (internal_id,) = fe["internal_request_ids"]
    en = engine_end(lines, internal_id)
    assert en["code"] == "OK" and en["finish_reason"] == "length" and en["completion_tokens"] == 8
    assert en["trace_id"] == trace_id and en["parent_span_id"] == client_span and "span_id" not in en
    # Nothing per token: the request shows up in the engine's log once, at its end.
    assert sum(1 for x in lines if x.get("request_id") == internal_id) == 1

    # Without a client traceparent and without tracing, a request belongs to no trace.
    fu = frontend_end(lines, "log-untraced")
    eu = engine_end(lines, fu["internal_request_ids"][0])
    assert not {"trace_id", "span_id", "parent_span_id"} & (fu.keys() | eu.keys())

    fi = frontend_end(lines, "log-invalid")
    assert fi["code"] == "INVALID_ARGUMENT" and fi["finish_reasons"] == []
    assert Scrape(observed["frontend_metrics"]).get(
        "tandem:frontend_requests_total", method="Generate", code="INVALID_ARGUMENT") >= 1
