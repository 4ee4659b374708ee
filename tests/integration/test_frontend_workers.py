"""Several frontend processes on one port (`--frontend-workers`): connections spread over them,
each serves, and SIGTERM drains and ends them all."""

from __future__ import annotations

import os
import signal
import time

import grpc

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
    for ch in channels:
        ch.close()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(60) == 0
    assert not any(_pid_alive(p) for p in pids)
