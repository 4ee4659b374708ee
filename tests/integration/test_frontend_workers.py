"""Several frontend processes on one port (`--frontend-workers`): connections spread over them,
each serves, and SIGTERM drains and ends them all."""

from __future__ import annotations

import os
import signal
import time

import grpc
from google.protobuf.json_format import MessageToDict

from tandem.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def test_two_frontend_workers_share_the_port_and_drain(launch_serve):
    server, frontend, _ = launch_serve(["--frontend-workers", "2"])
    pids: dict[int, grpc.Channel] = {}
    channels = []
    deadline = time.monotonic() + 120
    i = 0
    # The extra worker listens once it is ready; until then every connection reaches the first.
    while len(pids) < 2 and time.monotonic() < deadline:
        i += 1  # a separate connection each time: the kernel spreads them over the listeners
        ch = grpc.insecure_channel(frontend, options=[("grpc.use_local_subchannel_pool", 1), ("tandem.test.conn", i)])
        channels.append(ch)
        stub = frontend_pb2_grpc.FrontendStub(ch)
        # STATS names the worker; health tells unauthenticated callers only SERVING/NOT_SERVING.
        health = stub.Utility(common_pb2.UtilityRequest(command=common_pb2.UTILITY_COMMAND_HEALTH), timeout=30)
        assert dict(health.result) == {"status": "SERVING"}
        resp = stub.Utility(common_pb2.UtilityRequest(command=common_pb2.UTILITY_COMMAND_STATS), timeout=30)
        pid = int(resp.result["frontend"]["pid"])
        pids.setdefault(pid, ch)
        time.sleep(0.02)
    assert len(pids) == 2, pids.keys()
    assert server.proc.pid in pids  # the parent is one of the workers
    for ch in pids.values():  # both really serve generations
        stub = frontend_pb2_grpc.FrontendStub(ch)
        req = frontend_pb2.GenerateRequest(prompt="The capital of France is")
        req.sampling.max_tokens = 4
        req.sampling.temperature = 0.0
        assert len(stub.Generate(req, timeout=60).choices[0].token_ids) == 4
    _abort_through_the_other_worker(*pids.values())
    for ch in channels:
        ch.close()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(60) == 0
    assert not any(_pid_alive(p) for p in pids)


def _abort_through_the_other_worker(holder: grpc.Channel, other: grpc.Channel) -> None:
    """A Utility ABORT that reaches another worker than its request is relayed: it ends the
    stream (FINISH_REASON_ABORT) and answers how many choices it ended; an unknown id is still
    NOT_FOUND after asking the sibling."""
    req = frontend_pb2.GenerateRequest(prompt="Count from one to one thousand:", request_id="xw-abort-1")
    req.sampling.max_tokens = 400
    req.sampling.temperature = 0.0
    req.sampling.ignore_eos = True
    req.n = 2
    stream = iter(frontend_pb2_grpc.FrontendStub(holder).Stream(req, timeout=120))
    next(stream)
    other_stub = frontend_pb2_grpc.FrontendStub(other)
    reply = other_stub.Utility(common_pb2.UtilityRequest(command=common_pb2.UTILITY_COMMAND_ABORT,
                                                         request_id="xw-abort-1"), timeout=30)
    assert dict(reply.result) == {"aborted": "xw-abort-1", "choices": 2.0}
    finals, tokens_after = [], 0
    for msg in stream:
        for c in msg.choices:
            tokens_after += len(c.token_ids)
            if c.finish_reason:
                finals.append(c.finish_reason)
    assert finals == [common_pb2.FINISH_REASON_ABORT] * 2 and tokens_after < 2 * 400
    # Everything the request held is freed: the holder's IDs, the engine's sequences and blocks.
    holder_stub = frontend_pb2_grpc.FrontendStub(holder)
    deadline = time.monotonic() + 10
    while True:
        stats = MessageToDict(holder_stub.Utility(common_pb2.UtilityRequest(
            command=common_pb2.UTILITY_COMMAND_STATS), timeout=30).result)
        (engine,) = stats["engines"].values()
        idle = (stats["frontend"]["in_flight"] == 0 and stats["frontend"]["in_flight_choices"] == 0
                and engine["num_running"] == 0 and engine["kv_blocks_used"] == 0 and engine["in_flight"] == 0)
        if idle:
            break
        assert time.monotonic() < deadline, f"resources not released after the relayed abort: {stats}"
        time.sleep(0.05)
    try:
        other_stub.Utility(common_pb2.UtilityRequest(command=common_pb2.UTILITY_COMMAND_ABORT,
                                                     request_id="xw-abort-1"), timeout=30)
        raise AssertionError("an ended request was aborted again")
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.NOT_FOUND
