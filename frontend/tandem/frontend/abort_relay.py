"""Utility ABORT across the frontend workers that share one port.

With `--frontend-workers N` the kernel spreads client connections over N processes, and each
knows only the requests that reached it. An ABORT that lands on another worker than its request
is relayed: the receiving worker asks its siblings over Unix sockets in a private folder that
the parent created (mode 0700, so only processes of the same user can connect), and answers with
what they ended.

Invariants:
- A relayed call carries the original caller's identity and admin standing in metadata, and the
  sibling honours them only from a Unix-socket peer (a client over TCP that sends the same
  headers is judged as itself). It also carries the caller's `authorization` header, so the
  sibling's token check passes exactly when the original one did.
- A relayed call is never relayed again (one hop), so N workers cost at most N - 1 calls.
- A sibling that is not up (starting, draining, gone) counts as not having the request.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from urllib.parse import quote, unquote

import grpc

from tandem.v1 import common_pb2, frontend_pb2_grpc

RELAYED_CALLER = "x-tandem-relayed-caller"
RELAYED_ADMIN = "x-tandem-relayed-admin"
_NO_IDENTITY = "-"  # callers are not told apart (no auth): the sibling does not compare owners


def socket_address(relay_dir: str, index: int) -> str:
    """The gRPC address of worker `index`'s relay socket."""
    return "unix:" + os.path.join(relay_dir, f"frontend-{index}.sock")


@dataclass(frozen=True)
class RelayedCaller:
    """Who sent an ABORT that a sibling worker relayed."""

    identity: str | None
    admin: bool


def relayed_caller(context) -> RelayedCaller | None:
    """The relayed caller when this call came from a sibling worker, else None (also for a TCP
    peer that sets the headers itself)."""
    if not str(context.peer()).startswith("unix:"):
        return None
    md = {k: v for k, v in context.invocation_metadata()}
    if RELAYED_CALLER not in md:
        return None
    raw = md[RELAYED_CALLER]
    return RelayedCaller(identity=None if raw == _NO_IDENTITY else unquote(raw), admin=md.get(RELAYED_ADMIN) == "1")


class AbortRelay:
    """Worker `index` of `count`: relays an ABORT it cannot serve to the other workers."""

    def __init__(self, relay_dir: str, index: int, count: int, timeout: float = 5.0) -> None:
        self.addresses = [socket_address(relay_dir, i) for i in range(count) if i != index]
        self.timeout = timeout
        self._stubs: dict[str, frontend_pb2_grpc.FrontendStub] = {}
        self._channels: list[grpc.aio.Channel] = []

    def _stub(self, address: str) -> frontend_pb2_grpc.FrontendStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = grpc.aio.insecure_channel(address)
            self._channels.append(channel)
            stub = self._stubs[address] = frontend_pb2_grpc.FrontendStub(channel)
        return stub

    async def abort_elsewhere(self, request_id: str, caller: str | None, admin: bool,
                              metadata: tuple[tuple[str, str], ...]) -> dict | None:
        """Asks every sibling to abort `request_id` for `caller`; the choices they ended, summed
        (None when no sibling had it). `metadata`: the original call's, of which only
        `authorization` is passed on."""
        md = [(k, v) for k, v in metadata if k == "authorization"]
        md += [(RELAYED_CALLER, _NO_IDENTITY if caller is None else quote(caller, safe="")),
               (RELAYED_ADMIN, "1" if admin else "0")]
        request = common_pb2.UtilityRequest(command=common_pb2.UTILITY_COMMAND_ABORT, request_id=request_id)

        async def ask(address: str) -> int | None:
            """The choices the sibling at `address` ended; None when it does not hold the request."""
            try:
                reply = await self._stub(address).Utility(request, metadata=md, timeout=self.timeout)
            except grpc.aio.AioRpcError:  # NOT_FOUND, or the sibling is not up
                return None
            return int(reply.result["choices"])

        ended = [n for n in await asyncio.gather(*(ask(a) for a in self.addresses)) if n is not None]
        return {"aborted": request_id, "choices": sum(ended)} if ended else None

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._channels), return_exceptions=True)
