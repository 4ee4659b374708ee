"""Fault tests for the reliability promises R3, R4, R5, R7, R8 and R10 (R1, R2 and R6 live in
test_cancel.py and test_preemption.py). Each ends by checking that nothing leaked."""

from __future__ import annotations

import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.client import TandemClient, build_request
from tandem.v1 import common_pb2

LONG = dict(max_tokens=300, temperature=0.0, ignore_eos=True)


def engine_stats(client: TandemClient) -> list[dict]:
    return list(client.utility("stats")["engines"].values())


def wait_idle(client: TandemClient, timeout: float = 15.0) -> None:
    """Every engine has nothing running or waiting, no KV block in use and no open stream,
    and the frontend holds no request-ID mapping."""
    deadline = time.monotonic() + timeout
    while True:
        stats = client.utility("stats")
        engines = [e for e in stats["engines"].values() if "error" not in e]
        front = stats["frontend"]
        if all(e["num_running"] == 0 and e["num_waiting"] == 0 and e["kv_blocks_used"] == 0 and e["in_flight"] == 0
               for e in engines) and front["in_flight"] == 0 and front["in_flight_choices"] == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"resources leaked: {stats}")
        time.sleep(0.05)


# -- R3: deadlines ---------------------------------------------------------------------------------
def test_deadline_exceeded_stops_work(client):
    wait_idle(client)
    with pytest.raises(grpc.RpcError) as err:
        client.generate("Count to a thousand:", timeout=1.0, **LONG)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_idle(client)
    generated = engine_stats(client)[0]["generation_tokens_total"]
    time.sleep(0.5)  # nothing keeps decoding for the expired request
    assert engine_stats(client)[0]["generation_tokens_total"] == generated


def test_stream_deadline_exceeded(client):
    call = client.stream("Count to a thousand:", timeout=1.0, **LONG)
    with pytest.raises(grpc.RpcError) as err:
        for _ in call:
            pass
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_idle(client)


# -- R5: bad input, one row per field ----------------------------------------------------------------
OK = dict(prompt="Hello", max_tokens=2)
BAD_INPUTS = [
    ("prompt", dict(prompt="")),
    ("prompt", dict(prompt=None)),
    ("messages", dict(prompt="x", messages=[{"role": "user", "content": "hi"}])),
    ("messages[0].role", dict(prompt=None, messages=[{"role": "wizard", "content": "hi"}])),
    ("max_tokens", dict(max_tokens=0)),
    ("max_tokens", dict(max_tokens=10_000_000)),  # prompt + max_tokens over the context
    ("temperature", dict(temperature=-0.5)),
    ("temperature", dict(temperature=float("nan"))),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=1.5)),
    ("top_k", dict(top_k=-3)),
    ("min_p", dict(min_p=2.0)),
    ("seed", dict(seed=-1)),
    ("repetition_penalty", dict(repetition_penalty=0.0)),
    ("presence_penalty", dict(presence_penalty=5.0)),
    ("frequency_penalty", dict(frequency_penalty=float("inf"))),
    ("logprobs", dict(logprobs=1000)),
    ("min_tokens", dict(min_tokens=5)),
    ("stop_token_ids", dict(stop_token_ids=[10_000_000])),
    ("stop_token_ids", dict(stop_token_ids=[-1])),
    ("prompt_token_ids", dict(prompt=None, prompt_token_ids=[1, 2, 99_999_999])),
    ("n", dict(n=0)),
    ("n", dict(n=1000)),
    ("stop", dict(stop=[""])),
    ("stop", dict(stop=["x" * 1000])),
    ("request_id", dict(request_id="bad\nid")),
    ("prompt", dict(prompt="a" * (5 * 1024 * 1024))),  # oversize, under the transport limit
]


@pytest.mark.parametrize("field,overrides", BAD_INPUTS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_INPUTS)])
def test_bad_input_is_invalid_argument(client, field, overrides):
    kwargs = {**OK, **overrides}
    with pytest.raises(grpc.RpcError) as err:
        client.generate(**kwargs)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert field.split("[")[0] in err.value.details(), err.value.details()


def test_an_unknown_model_is_not_found(client):
    """Not a malformed request: a model this server does not serve (NOT_FOUND, HTTP 404 over HTTP)."""
    with pytest.raises(grpc.RpcError) as err:
        client.generate(**OK, model="gpt-17-ultra")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND, err.value.details()
    assert err.value.details().startswith("model: unknown model 'gpt-17-ultra'"), err.value.details()


def test_malformed_utf8_is_invalid_argument(serve):
    channel = grpc.insecure_channel(serve["frontend"])
    call = channel.unary_unary("/tandem.v1.Frontend/Generate", request_serializer=None, response_deserializer=None)
    bad = bytes([0x12, 3, 0xFF, 0xFE, 0x41])  # field 2 (prompt), three bytes that are not UTF-8
    with pytest.raises(grpc.RpcError) as err:
        call(bad, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    channel.close()


def test_after_bad_inputs_server_still_works_and_nothing_leaked(client):
    reply = client.generate("The capital of France is", max_tokens=4, temperature=0.0)
    assert reply.choices[0].token_ids
    wait_idle(client)


# -- R4 and R7: overload and graceful drain (one dedicated server) ---------------------------------------
@pytest.fixture(scope="module")
def small_queue_server(launch_serve):
    server, frontend, _ = launch_serve(["--max-num-seqs", "1", "--max-waiting-requests", "2", "--enable-reflection"])
    return server, frontend


def test_reflection_when_enabled(small_queue_server):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    _, frontend = small_queue_server
    with grpc.insecure_channel(frontend) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        [resp] = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                timeout=10))
    names = {s.name for s in resp.list_services_response.service}
    assert {"tandem.v1.Frontend", "grpc.health.v1.Health"} <= names


def test_flood_past_queue_bound_gets_resource_exhausted(small_queue_server):
    _, frontend = small_queue_server
    with TandemClient(frontend) as c:
        wait_idle(c)

        def one(i):
            try:
                r = c.generate(f"Tell me about the number {i}.", max_tokens=12, temperature=0.0, ignore_eos=True)
                return ("ok", r)
            except grpc.RpcError as exc:
                return (exc.code(), exc)

        with ThreadPoolExecutor(10) as pool:
            results = list(pool.map(one, range(10)))
        ok = [r for kind, r in results if kind == "ok"]
        refused = [r for kind, r in results if kind == grpc.StatusCode.RESOURCE_EXHAUSTED]
        assert len(ok) + len(refused) == 10, [k for k, _ in results]
        assert refused and ok
        for r in ok:
            assert len(r.choices[0].token_ids) == 12
        assert dict(refused[0].trailing_metadata()).get("retry-after") == "1"
        wait_idle(c)


def test_sigterm_drains_streams_in_flight(small_queue_server):
    server, frontend = small_queue_server
    results: dict[int, object] = {}

    def stream(i):
        with TandemClient(frontend) as c:
            try:
                texts, finals = [], []
                for msg in c.stream(f"Story number {i}:", max_tokens=20, temperature=0.0, ignore_eos=True):
                    texts += [ch.text for ch in msg.choices]
                    finals += [ch.finish_reason for ch in msg.choices if ch.finish_reason]
                results[i] = finals
            except grpc.RpcError as exc:
                results[i] = exc.code()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    with TandemClient(frontend) as c:  # wait until both streams are really in flight
        deadline = time.monotonic() + 30
        while c.utility("stats")["frontend"]["in_flight"] < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    server.proc.send_signal(signal.SIGTERM)
    # Health flips to NOT_SERVING and new work is refused while the two streams finish.
    channel = grpc.insecure_channel(frontend)
    health = health_pb2_grpc.HealthStub(channel)
    saw_not_serving = saw_unavailable = False
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not (saw_not_serving and saw_unavailable):
        try:
            status = health.Check(health_pb2.HealthCheckRequest(service="tandem.v1.Frontend"), timeout=1).status
            saw_not_serving |= status == health_pb2.HealthCheckResponse.NOT_SERVING
            if saw_not_serving and not saw_unavailable:
                with TandemClient(frontend) as c:
                    try:
                        c.generate("late", max_tokens=2, timeout=5)
                    except grpc.RpcError as exc:
                        saw_unavailable = exc.code() == grpc.StatusCode.UNAVAILABLE
        except grpc.RpcError:
            break  # server already gone
        time.sleep(0.02)
    channel.close()
    for t in threads:
        t.join(60)
    assert saw_not_serving and saw_unavailable
    assert results == {0: [common_pb2.FINISH_REASON_LENGTH], 1: [common_pb2.FINISH_REASON_LENGTH]}
    assert server.proc.wait(60) == 0


# -- R8: engine crash with two replicas ----------------------------------------------------------
@pytest.fixture(scope="module")
def two_replicas(smollm2_dir, server_tools):
    t = server_tools
    e1, e2, fport = t.free_port(), t.free_port(), t.free_port()
    engines = [t.ServerProcess(["engine", "--port", str(p)]) for p in (e1, e2)]
    front = t.ServerProcess(["frontend", "--host", "127.0.0.1", "--port", str(fport),
                             "--engine", f"127.0.0.1:{e1}", "--engine", f"127.0.0.1:{e2}"])
    try:
        t.wait_serving(f"127.0.0.1:{fport}", "tandem.v1.Frontend", 300, front.proc)
        # The frontend is ready with one replica (a quorum of one); these tests need both in rotation.
        addresses = {f"127.0.0.1:{e1}", f"127.0.0.1:{e2}"}
        with TandemClient(f"127.0.0.1:{fport}") as c:
            deadline = time.monotonic() + 300
            while set(c.utility("stats")["frontend"]["ready_engines"]) != addresses:
                assert time.monotonic() < deadline, "both replicas never joined the frontend's rotation"
                assert all(e.proc.poll() is None for e in engines), "an engine replica exited during start-up"
                time.sleep(0.2)
        yield {"engines": engines, "frontend": f"127.0.0.1:{fport}", "ports": (e1, e2)}
    finally:
        for p in [front, *engines]:
            p.stop()


def test_kill_engine_fails_fast_and_routes_to_survivor(two_replicas):
    frontend = two_replicas["frontend"]
    victim, survivor = two_replicas["engines"]
    victim_addr = f"127.0.0.1:{two_replicas['ports'][0]}"
    outcomes: dict[int, object] = {}

    def stream(i):
        with TandemClient(frontend) as c:
            try:
                for _ in c.stream(f"Long story {i}:", **LONG):
                    pass
                outcomes[i] = "finished"
            except grpc.RpcError as exc:
                outcomes[i] = exc.code()

    with TandemClient(frontend) as c:
        wait_idle(c)
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        for th in threads:
            th.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # least-in-flight routing puts one stream on each engine
            per_engine = c.utility("stats")["engines"]
            if all(e.get("num_running", 0) >= 1 for e in per_engine.values()):
                break
            time.sleep(0.05)
        t_kill = time.monotonic()
        victim.proc.kill()
        threads[0].join(30)
        threads[1].join(1)
        failed = [code for code in outcomes.values() if code == grpc.StatusCode.UNAVAILABLE]
        assert len(failed) == 1, outcomes  # the victim's stream failed fast ...
        assert time.monotonic() - t_kill < 30
        # ... new work goes to the survivor, and readiness still holds with one replica up.
        for i in range(3):
            reply = c.generate(f"After the crash {i}", max_tokens=4, temperature=0.0)
            assert len(reply.choices[0].token_ids) == 4
        health = c.utility("health")
        assert health == {"status": "SERVING"}  # no internals for an unauthenticated caller
        assert "error" in c.utility("stats")["engines"][victim_addr]
        for th in threads:
            th.join(60)
        wait_idle(c)
    assert victim.proc.returncode != 0


# -- R10: soak with random cancels, aborts and deadlines -------------------------------------------
def test_soak_exactly_one_terminal_status(client):
    rng = random.Random(1234)
    endings: list[tuple[int, str]] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        action = rng.choice(["finish", "cancel", "abort", "deadline"])
        rid = f"soak-{i}"
        max_tokens = rng.randint(4, 24)
        if action == "deadline":
            # Long enough that the 0.8 s deadline cuts the stream: a generation that ends just
            # as the deadline passes races the client's deadline against the OK trailers.
            max_tokens = 512
        kwargs = dict(max_tokens=max_tokens, temperature=0.8, seed=i, ignore_eos=True, request_id=rid)
        terminal = []
        try:
            call = client.stream(f"Soak prompt {i}", timeout=0.8 if action == "deadline" else 60, **kwargs)
            for n, msg in enumerate(call):
                terminal += [c.finish_reason for c in msg.choices if c.finish_reason]
                if n == 1 and action == "cancel":
                    call.cancel()
                if n == 1 and action == "abort":
                    try:
                        client.utility("abort", request_id=rid)
                    except grpc.RpcError as exc:
                        assert exc.code() == grpc.StatusCode.NOT_FOUND  # it had already finished
            outcome = "final"
        except grpc.RpcError as exc:
            outcome = exc.code().name
        # Exactly one terminal status: one finish reason on a stream that ended normally, or an
        # error status and no finish reason.
        ok = (outcome == "final" and len(terminal) == 1) or (outcome != "final" and not terminal)
        with lock:
            endings.append((i, outcome if ok else f"BROKEN:{outcome}:{terminal}"))

    wait_idle(client)
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(one, range(30)))
    assert len(endings) == 30
    broken = [e for e in endings if e[1].startswith("BROKEN")]
    assert not broken, broken
    assert {o for _, o in endings} >= {"final"}
    wait_idle(client)


# -- Fatal engine error: requests fail with a status, the engine exits non-zero, serve follows ---------
def test_fatal_engine_error_fails_requests_and_exits_nonzero(launch_serve):
    # The engine loop raises after 40 steps (fault injection read once at start).
    server, frontend, _ = launch_serve([], env={"TANDEM_FAULT_AFTER_STEPS": "40"})
    with TandemClient(frontend) as c:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            c.generate("Count to a thousand:", timeout=60, **LONG)
        assert err.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE), err.value
        assert time.monotonic() - started < 60  # failed fast, did not hang to the deadline
    # The engine exits 1; `tandem serve` notices, drains its frontend and exits non-zero too.
    assert server.proc.wait(60) != 0
