"""The ABORT relay between frontend workers: who a relayed call speaks for, and the fan-out
over sibling sockets (real gRPC servers on Unix sockets, a stand-in Frontend servicer)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tandem.frontend.abort_relay import RELAYED_ADMIN, RELAYED_CALLER, AbortRelay, relayed_caller, socket_address
from tandem.proto_wire import to_struct
from tandem.v1 import common_pb2, frontend_pb2_grpc


class _Context:
    def __init__(self, peer: str, metadata: list[tuple[str, str]]) -> None:
        self._peer, self._md = peer, metadata

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self):
        return self._md


def test_relayed_identity_is_honoured_only_from_a_unix_peer() -> None:
    md = [(RELAYED_CALLER, "token%3Aabc%7Ccert%3Ax"), (RELAYED_ADMIN, "1")]
    got = relayed_caller(_Context("unix:/tmp/x/frontend-1.sock", md))
    assert got is not None and got.identity == "token:abc|cert:x" and got.admin is True
    # A TCP client that sets the same headers speaks for itself.
    assert relayed_caller(_Context("ipv4:127.0.0.1:5555", md)) is None
    assert relayed_caller(_Context("ipv6:[::1]:5555", md)) is None
    # A Unix peer without the header is an ordinary call; "-" means callers are not told apart.
    assert relayed_caller(_Context("unix:/tmp/x/frontend-1.sock", [])) is None
    anon = relayed_caller(_Context("unix:/tmp/x/frontend-1.sock", [(RELAYED_CALLER, "-"), (RELAYED_ADMIN, "0")]))
    assert anon is not None and anon.identity is None and anon.admin is False


class _Sibling(frontend_pb2_grpc.FrontendServicer):
    """Holds `held` (request id -> choices) for `owner`; records what each call carried."""

    def __init__(self, held: dict[str, int], owner: str | None) -> None:
        self.held, self.owner, self.calls = held, owner, []

    async def Utility(self, request, context):
        md = dict(context.invocation_metadata())
        relayed = relayed_caller(context)
        self.calls.append((request.request_id, md.get("authorization"), relayed))
        assert relayed is not None
        n = self.held.get(request.request_id)
        if n is None or (relayed.identity != self.owner and not relayed.admin):
            await context.abort(grpc.StatusCode.NOT_FOUND, "not here")
        del self.held[request.request_id]
        return common_pb2.UtilityResponse(command=request.command,
                                          result=to_struct({"aborted": request.request_id, "choices": n}))


async def _start(tmp_path, index: int, servicer) -> grpc.aio.Server:
    server = grpc.aio.server()
    frontend_pb2_grpc.add_FrontendServicer_to_server(servicer, server)
    assert server.add_insecure_port(socket_address(str(tmp_path), index)) == 1
    await server.start()
    return server


@pytest.mark.parametrize("caller, admin, found", [("token:alice", False, 3), ("token:bob", False, None),
                                                  ("token:bob", True, 3), (None, False, None)])
def test_abort_elsewhere_asks_every_sibling_and_sums_what_they_ended(tmp_path, caller, admin, found) -> None:
    async def main():
        # Worker 0 relays; worker 1 holds the request; worker 2 does not; worker 3 is not up.
        holder, empty = _Sibling({"r-1": 3}, owner="token:alice"), _Sibling({}, owner=None)
        servers = [await _start(tmp_path, 1, holder), await _start(tmp_path, 2, empty)]
        relay = AbortRelay(str(tmp_path), index=0, count=4, timeout=2.0)
        try:
            got = await relay.abort_elsewhere("r-1", caller, admin,
                                              (("authorization", "Bearer t0k"), ("x-other", "dropped")))
            return got, holder.calls, empty.calls
        finally:
            await relay.close()
            for s in servers:
                await s.stop(None)

    got, holder_calls, empty_calls = asyncio.run(main())
    assert got == (None if found is None else {"aborted": "r-1", "choices": found})
    # Each sibling was asked once, with the caller's token and who it speaks for; never worker 0 itself.
    assert len(holder_calls) == len(empty_calls) == 1
    rid, auth, relayed = holder_calls[0]
    assert rid == "r-1" and auth == "Bearer t0k" and relayed.identity == caller and relayed.admin is admin
