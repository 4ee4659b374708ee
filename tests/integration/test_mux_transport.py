"""The multiplexed frontend-engine transport (`--engine-transport mux`): same answers as the
per-request transport, and the same guarantees on cancel, abort, deadline and bad input."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tandem.client import TandemClient
from tandem.v1 import common_pb2, engine_pb2, engine_pb2_grpc

PROMPTS = [f"Give me fact number {i} about the ocean." for i in range(6)]


@pytest.fixture(scope="module")
def mux(launch_serve):
    _, frontend, engine = launch_serve(["--engine-transport", "mux"])
    with TandemClient(frontend) as c:
        yield {"client": c, "engine": engine}


def _idle(c: TandemClient, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = c.utility("stats")
        e = next(iter(stats["engines"].values()))
        f = stats["frontend"]
        if e["num_running"] == e["num_waiting"] == e["kv_blocks_used"] == e["in_flight"] == 0 and f["in_flight"] == 0:
            return e
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle: {stats}")
        time.sleep(0.05)


def test_same_outputs_as_per_request_transport_concurrently(mux, client):
    kwargs = dict(max_tokens=20, temperature=0.0)
    expected = [list(client.generate(p, **kwargs).choices[0].token_ids) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: mux["client"].generate(p, **kwargs), PROMPTS))
    assert [list(r.choices[0].token_ids) for r in got] == expected
    _idle(mux["client"])


def test_stream_seeded_n_and_stop_string(mux, client):
    kwargs = dict(max_tokens=24, temperature=0.9, seed=11, n=2, stop=[" the"])
    ref = client.generate("Once upon a time", **kwargs)
    texts = {0: "", 1: ""}
    for msg in mux["client"].stream("Once upon a time", **kwargs):
        for ch in msg.choices:
            texts[ch.index] += ch.text
    assert [texts[0], texts[1]] == [c.text for c in ref.choices]
    _idle(mux["client"])


def test_cancel_abort_and_deadline_release_everything(mux):
    c = mux["client"]
    call = c.stream("Count to a thousand:", max_tokens=300, temperature=0.0, ignore_eos=True)
    next(iter(call))
    call.cancel()
    _idle(c)

    call = c.stream("Count to a thousand:", max_tokens=300, temperature=0.0, ignore_eos=True, request_id="mux-abort")
    it = iter(call)
    next(it)
    c.utility("abort", request_id="mux-abort")
    finals = [ch.finish_reason for msg in it for ch in msg.choices if ch.finish_reason]
    assert finals == [common_pb2.FINISH_REASON_ABORT]
    _idle(c)

    with pytest.raises(grpc.RpcError) as err:
        c.generate("Count to a thousand:", max_tokens=300, temperature=0.0, ignore_eos=True, timeout=1.0)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _idle(c)


def test_bad_input_keeps_its_status(mux):
    with pytest.raises(grpc.RpcError) as err:
        mux["client"].generate("Hello", max_tokens=2, top_p=7.0)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "top_p" in err.value.details()


def test_closing_a_subscription_aborts_its_requests(mux):
    """Talking to the engine directly: requests submitted on a channel die with it."""
    with grpc.insecure_channel(mux["engine"]) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        sub = stub.Subscribe(engine_pb2.SubscribeRequest(channel_id="test-channel-1"))
        next(sub)  # the acknowledgement
        with pytest.raises(grpc.RpcError) as dup:
            next(stub.Subscribe(engine_pb2.SubscribeRequest(channel_id="test-channel-1")))
        assert dup.value.code() == grpc.StatusCode.ALREADY_EXISTS
        for i in range(3):
            req = engine_pb2.EngineRequest(request_id=f"direct-{i}", channel_id="test-channel-1",
                                           prompt_token_ids=[1, 2, 3, 4 + i])
            req.sampling.max_tokens = 500
            req.sampling.ignore_eos = True
            stub.Submit(req, timeout=10)
        with pytest.raises(grpc.RpcError) as unknown:
            req = engine_pb2.EngineRequest(request_id="orphan", channel_id="nobody", prompt_token_ids=[1, 2])
            stub.Submit(req, timeout=10)
        assert unknown.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        batch = next(sub)
        assert {r.request_id for r in batch.responses} <= {f"direct-{i}" for i in range(3)}
        sub.cancel()
    _idle(mux["client"])
