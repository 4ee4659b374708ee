"""The engine core in its own process, through real gRPC and the real SmolLM2 model: a killed core
fails every request in flight cleanly and takes the service down non-zero; a consumer that never
reads does not slow the core's steps; kv_transfer_params travel through the core and back."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest

from tandem.client import TandemClient, build_request
from tandem.proto_wire import to_struct
from tandem.v1 import common_pb2, engine_pb2, engine_pb2_grpc, frontend_pb2

ENGINE_SERVICE = "tandem.v1.Engine"


def _stats(stub) -> dict:
    from google.protobuf import json_format

    r = stub.Utility(common_pb2.UtilityRequest(command=common_pb2.UTILITY_COMMAND_STATS), timeout=10)
    return json_format.MessageToDict(r.result)


def _request(rid: str, max_tokens: int, **sampling) -> engine_pb2.EngineRequest:
    return engine_pb2.EngineRequest(
        request_id=rid, prompt_token_ids=[1, 504, 3458, 314, 260, 1789, 28, 253],
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **sampling))


def test_kill_core_fails_every_request_and_exits_nonzero(launch_serve, server_tools):
    server, frontend, engine_addr = launch_serve([])
    engine_pid = server_tools.child_pid(server.proc.pid, " engine ")
    core_pid = server_tools.child_pid(engine_pid, "tandem.engine_service.core.core_process")
    # The model lives in the core: the engine's gRPC process never loaded torch.
    assert "libtorch" not in Path(f"/proc/{engine_pid}/maps").read_text()
    assert "libtorch" in Path(f"/proc/{core_pid}/maps").read_text()
    channel = grpc.insecure_channel(engine_addr)
    stub = engine_pb2_grpc.EngineStub(channel)
    outcomes: dict[str, object] = {}
    started = threading.Barrier(5)

    def direct(i: int) -> None:
        call = stub.Stream(_request(f"direct-{i}", 2000))
        try:
            for n, _ in enumerate(call):
                if n == 0:
                    started.wait(120)
            outcomes[f"direct-{i}"] = "finished"
        except grpc.RpcError as exc:
            outcomes[f"direct-{i}"] = (exc.code(), exc.details())

    def through_frontend(i: int) -> None:
        with TandemClient(frontend) as c:
            try:
                for n, _ in enumerate(c.stream(f"Tell a long story {i}:", max_tokens=2000, temperature=0.0,
                                               ignore_eos=True)):
                    if n == 0:
                        started.wait(120)
                outcomes[f"frontend-{i}"] = "finished"
            except grpc.RpcError as exc:
                outcomes[f"frontend-{i}"] = (exc.code(), exc.details())

    threads = [threading.Thread(target=direct, args=(i,)) for i in range(2)]
    threads += [threading.Thread(target=through_frontend, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    started.wait(120)  # every stream has its first tokens: all four are in flight
    os.kill(core_pid, signal.SIGKILL)
    assert server_tools.wait_not_serving(engine_addr, ENGINE_SERVICE)
    for t in threads:
        t.join(60)
    channel.close()
    assert len(outcomes) == 4, outcomes
    for name, outcome in outcomes.items():
        assert outcome != "finished", name
        code, details = outcome
        assert code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE), (name, outcome)
        if name.startswith("direct"):
            assert "engine core" in details and "died" in details, outcome
    # The engine service exits non-zero, and `tandem serve` follows.
    assert server.proc.wait(60) != 0


def test_slow_consumer_does_not_slow_the_core(launch_serve):
    _, _, engine_addr = launch_serve(["--max-num-seqs", "8"])
    channel = grpc.insecure_channel(engine_addr, options=[("grpc.http2.bdp_probe", 0)])
    stub = engine_pb2_grpc.EngineStub(channel)
    n, max_tokens = 4, 48
    # Logprobs make every message large, so a consumer that never reads fills gRPC's flow-control
    # window after a few dozen steps; from then on the server cannot send to it at all.
    sampling = dict(logprobs=20)

    def run(prefix: str, read: bool) -> tuple[float, int, list]:
        before = _stats(stub)
        t0 = time.monotonic()
        calls = [stub.Stream(_request(f"{prefix}-{i}", max_tokens, **sampling)) for i in range(n)]
        if read:
            for call in calls:
                for _ in call:
                    pass
        want = before["generation_tokens_total"] + n * max_tokens
        while True:  # the core's own counters say when it has generated every token
            now = _stats(stub)
            if now["generation_tokens_total"] >= want and now["num_running"] == 0:
                break
            assert time.monotonic() - t0 < 300, now
            time.sleep(0.05)
        elapsed = time.monotonic() - t0
        return elapsed, int(now["steps_total"] - before["steps_total"]), calls

    run("warm", read=True)
    base_s, base_steps, _ = run("fast", read=True)
    slow_s, slow_steps, calls = run("slow", read=False)  # nobody has read a single message yet
    # The same work took as many steps (give or take admission landing a step apart) and not much
    # longer: the core never waited on the consumers (a core that did would stall once their
    # flow-control windows filled, and never finish).
    assert abs(slow_steps - base_steps) <= n, (slow_steps, base_steps)
    assert slow_s < 2.0 * base_s + 2.0, (slow_s, base_s)
    # Everything is still delivered, coalesced, once the consumers read.
    for call in calls:
        msgs = list(call)
        assert sum(len(m.token_ids) for m in msgs) == max_tokens
        assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    channel.close()


@pytest.fixture(scope="module")
def trusted_frontend(launch_serve) -> str:
    """A `tandem serve` whose frontend passes clients' KV transfer parameters through (a router on
    a private network); the default frontend refuses them."""
    _, frontend, _ = launch_serve(["--trust-kv-callers"])
    return frontend


def test_kv_transfer_params_round_trip_through_the_core(serve, trusted_frontend):
    """Typed parameters an engine without a KV role does not act on travel through its core and
    come back unchanged; the `x-tandem-kv-transfer` header replaces the body's, whole."""
    channel = grpc.insecure_channel(serve["engine"])
    stub = engine_pb2_grpc.EngineStub(channel)
    params = common_pb2.KVTransferParams(remote_engine_id="prefill-0", remote_block_ids=[4, 5, 6],
                                         remote_host="10.1.2.3", remote_port=5600, lease_id="l-1",
                                         lease_expiry_unix=1.75e9)
    params.remote_group_block_ids.add(block_ids=[4, 5, 6])
    params.extra.update({"transfer_id": "t-1", "nested": {"a": [1, "b"]}})
    req = _request("kv-stream", 3)
    req.kv_transfer_params.CopyFrom(params)
    msgs = list(stub.Stream(req))
    assert all(not m.HasField("kv_transfer_params") for m in msgs[:-1])
    assert msgs[-1].kv_transfer_params == params  # typed in the core, back as the same message
    req.request_id = "kv-generate"
    assert stub.Generate(req).kv_transfer_params == params
    req.request_id = "kv-header"
    header = (("x-tandem-kv-transfer", json.dumps({"remote_engine_id": "from-header", "k": "v"})),)
    got = stub.Generate(req, metadata=header).kv_transfer_params
    assert got.remote_engine_id == "from-header" and not got.remote_block_ids and dict(got.extra) == {"k": "v"}
    plain = stub.Generate(_request("kv-none", 2))
    assert not plain.HasField("kv_transfer_params")
    bad = _request("kv-bad", 2)
    bad.kv_transfer_params.remote_port = 0
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "kv_transfer_params.remote_port" in err.value.details()
    for value in ("not json", "[1]", json.dumps({"remote_port": "x"})):
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(_request("kv-bad-header", 2), metadata=(("x-tandem-kv-transfer", value),))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("x-tandem-kv-transfer"), err.value.details()
    # A default frontend refuses them: only a trusted router may name KV transfers.
    with TandemClient(serve["frontend"]) as c, pytest.raises(grpc.RpcError) as err:
        c.generate("Hello", max_tokens=2, kv_transfer_params={"remote_engine_id": "e", "x": "y"})
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # Through a trusting frontend: it passes them on and returns the engine's copy.
    with TandemClient(trusted_frontend) as c:
        reply = c.generate("Hello", max_tokens=2, kv_transfer_params={"remote_engine_id": "e", "x": "y"})
        assert reply.kv_transfer_params.remote_engine_id == "e" and dict(reply.kv_transfer_params.extra) == {"x": "y"}
        # The frontend reads the header too, and it wins over the body.
        req = build_request(prompt="Hello", max_tokens=2, kv_transfer_params={"remote_engine_id": "body"})
        got = c.stub.Generate(req, metadata=header, timeout=30).kv_transfer_params
        assert got.remote_engine_id == "from-header" and dict(got.extra) == {"k": "v"}
        with pytest.raises(grpc.RpcError) as err:
            c.stub.Generate(req, metadata=(("x-tandem-kv-transfer", '{"block_size": 0}'),), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == "x-tandem-kv-transfer.block_size: must be >= 1"
    channel.close()


def _old_client_request(params: dict) -> frontend_pb2.GenerateRequest:
    """The bytes a client built against the removed Struct form sends: the parameters as a
    Struct in field 9 (wire type 2), decoded by today's schema (an unknown field)."""
    body = build_request(prompt="Hello", max_tokens=2).SerializeToString()
    struct = to_struct(params).SerializeToString()
    assert len(struct) < 128  # one-byte length varint below
    return frontend_pb2.GenerateRequest.FromString(body + bytes([9 << 3 | 2, len(struct)]) + struct)


def test_kv_transfer_params_in_the_removed_struct_form_are_refused(trusted_frontend):
    """A router still sending the Struct form is told (INVALID_ARGUMENT naming the field), not
    served without its transfer; the typed form works as ever."""
    params = {"remote_engine_id": "old-router", "remote_block_ids": [7, 8], "remote_port": 5601}
    with TandemClient(trusted_frontend) as c:
        for call in (c.stub.Generate, lambda r, timeout: list(c.stub.Stream(r, timeout=timeout))):
            with pytest.raises(grpc.RpcError) as err:
                call(_old_client_request(params), timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith("legacy_kv_transfer_params: removed"), err.value.details()
        typed = build_request(prompt="Hello", max_tokens=2)
        typed.kv_transfer_params.extra.update({"tag": "t"})
        assert dict(c.stub.Generate(typed, timeout=30).kv_transfer_params.extra) == {"tag": "t"}


def test_a_24_kib_request_id_gets_a_bounded_error_not_resource_exhausted(serve):
    """Issue 19 item 16: an error that echoed a 24 KiB id into the trailers came back
    RESOURCE_EXHAUSTED (trailing metadata over gRPC's limit). The error now names the field with a
    bounded echo, on the engine port (Generate, Utility ABORT) and on the frontend (Utility ABORT)."""
    long_id = "x" * (24 * 1024)
    calls = []
    with grpc.insecure_channel(serve["engine"]) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        calls.append(lambda: stub.Generate(_request(long_id, 2), timeout=30))
        calls.append(lambda: stub.Utility(common_pb2.UtilityRequest(command=common_pb2.UTILITY_COMMAND_ABORT,
                                                                     request_id=long_id), timeout=30))
        with TandemClient(serve["frontend"]) as c:
            calls.append(lambda: c.stub.Utility(common_pb2.UtilityRequest(command=common_pb2.UTILITY_COMMAND_ABORT,
                                                                          request_id=long_id), timeout=30))
            for call in calls:
                try:
                    call()
                    code, details = grpc.StatusCode.OK, ""
                except grpc.RpcError as err:
                    code, details = err.code(), err.details() or ""
                assert code != grpc.StatusCode.RESOURCE_EXHAUSTED, details[:200]
                assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), code
                assert len(details) <= 4096, len(details)
            # The engine still serves an ordinary request afterwards.
            assert len(stub.Generate(_request("after-long-id", 2), timeout=30).token_ids) == 2
