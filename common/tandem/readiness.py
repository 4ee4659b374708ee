"""Client side of start-up: wait until a frontend is ready, or say in one line why not.

A user who runs `tandem serve` and then `tandem chat` at once should get an answer, not
`UNAVAILABLE "frontend is starting"`; a user with no server should get one line naming the
address tried and what to run. Readiness is the frontend's grpc.health.v1 status (answered
without a bearer token), polled over the client's own channel so TLS settings apply.
"""

from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

FRONTEND_SERVICE = "tandem.v1.Frontend"
# How long a server that does not answer at all is waited for: long enough for a `tandem serve`
# started at the same moment to bind its port on a busy machine.
CONNECT_GRACE_S = 30.0


class ServerNotReady(Exception):
    """No ready server at the address within the wait; the message is the one line to print."""


def wait_until_ready(channel: grpc.Channel, address: str, wait: float,
                     connect_grace: float = CONNECT_GRACE_S, poll: float = 0.25) -> None:
    """Returns once the frontend at `address` is SERVING; raises ServerNotReady otherwise."""
    stub = health_pb2_grpc.HealthStub(channel)
    start = time.monotonic()
    deadline = start + max(wait, 0.0)
    answered = False
    last_error = ""
    while True:
        try:
            status = stub.Check(health_pb2.HealthCheckRequest(service=FRONTEND_SERVICE), timeout=2.0).status
            answered = True
            if status == health_pb2.HealthCheckResponse.SERVING:
                return
            last_error = "still starting"
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.UNIMPLEMENTED or code == grpc.StatusCode.NOT_FOUND:
                return  # a server without per-service health: let the call itself decide
            if code != grpc.StatusCode.UNAVAILABLE and code != grpc.StatusCode.DEADLINE_EXCEEDED:
                answered = True
            last_error = (exc.details() or code.name).splitlines()[0]
        now = time.monotonic()
        if not answered and now - start >= min(connect_grace, wait):
            raise ServerNotReady(
                f"no Tandem server at {address} ({_short(last_error)}); start one with `tandem serve`, "
                f"or pass --address HOST:PORT")
        if now >= deadline:
            raise ServerNotReady(
                f"the Tandem server at {address} was not ready after {wait:g}s ({_short(last_error)}); "
                f"wait longer with --wait SECONDS")
        time.sleep(poll)


def _short(text: str) -> str:
    text = text.strip()
    if "Connection refused" in text or "connection refused" in text.lower():
        return "connection refused"
    return text if len(text) <= 120 else text[:117] + "..."
