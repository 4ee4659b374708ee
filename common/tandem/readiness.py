"""Client side of start-up: wait until a frontend is ready, or say in one line why not.

A user who runs `tandem serve` and then `tandem chat` at once should get an answer, not
`UNAVAILABLE "frontend is starting"`; a user with no server should get one line naming the
address tried and what to run. Readiness is the frontend's grpc.health.v1 status (answered
without a bearer token), polled over the client's own channel so TLS settings apply.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

FRONTEND_SERVICE = "tandem.v1.Frontend"
# How long a server that does not answer at all is waited for: long enough for a `tandem serve`
# started at the same moment to bind its port on a busy machine.
CONNECT_GRACE_S = 30.0
# How long an address that answered and then refuses connections is given to come back: a
# server that exited while starting is reported within this, not at the end of --wait.
GONE_AFTER_S = 3.0
# Seconds between the progress lines of a long wait.
PROGRESS_EVERY_S = 10.0


class ServerNotReady(Exception):
    """No ready server at the address within the wait; the message is the one line to print."""


def stderr_progress(line: str) -> None:
    """The default progress sink: one line on stderr."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def wait_until_ready(channel: grpc.Channel, address: str, wait: float,
                     connect_grace: float = CONNECT_GRACE_S, poll: float = 0.25,
                     progress: Callable[[str], None] | None = stderr_progress,
                     gone_after: float = GONE_AFTER_S) -> None:
    """Returns once the frontend at `address` is SERVING; raises ServerNotReady otherwise.

    Watches the server it waits for: an address that answered and then refuses connections
    for `gone_after` seconds has lost its server (it exited while starting), which ends the
    wait at once. `progress` (None: silent) gets a line when the wait starts to take long and
    then every PROGRESS_EVERY_S seconds, saying what the wait is for."""
    stub = health_pb2_grpc.HealthStub(channel)
    start = time.monotonic()
    deadline = start + max(wait, 0.0)
    answered = False
    refused_since: float | None = None
    next_progress = start + 2.0
    last_error = ""
    while True:
        refused = False
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
            refused = code == grpc.StatusCode.UNAVAILABLE
        now = time.monotonic()
        refused_since = (refused_since or now) if refused else None
        if answered and refused_since is not None and now - refused_since >= gone_after:
            raise ServerNotReady(
                f"the Tandem server at {address} stopped while starting ({_short(last_error)} after it had "
                f"answered); see its log for why, then start it again")
        if not answered and now - start >= min(connect_grace, wait):
            raise ServerNotReady(
                f"no Tandem server at {address} ({_short(last_error)}); start one with `tandem serve`, "
                f"or pass --address HOST:PORT")
        if now >= deadline:
            raise ServerNotReady(
                f"the Tandem server at {address} was not ready after {wait:g}s ({_short(last_error)}); "
                f"wait longer with --wait SECONDS")
        if progress is not None and now >= next_progress:
            next_progress = now + PROGRESS_EVERY_S
            if answered:
                progress(f"waiting for the Tandem server at {address} to finish starting "
                         f"({now - start:.0f}s of --wait {wait:g}s)")
            else:
                progress(f"waiting for a Tandem server at {address} ({_short(last_error)}; giving up after "
                         f"{min(connect_grace, wait):g}s)")
        time.sleep(poll)


def _short(text: str) -> str:
    text = text.strip()
    if "Connection refused" in text or "connection refused" in text.lower():
        return "connection refused"
    return text if len(text) <= 120 else text[:117] + "..."
