"""Issue #12, acceptance 2: faults of disaggregated prefill/decode across real processes — a
producer engine, a consumer engine and a frontend with both pools. Each case ends with every
block on both engines free (no lease, no load, no request) and one clear terminal status.

Two cases drive the legs as a router would (Engine API, parameters in hand), because they need
the router's seat: a decode leg that never comes (lease expiry), and a decode leg whose pull goes
through a byte-flipping or throttling TCP proxy (corrupt transfer, cancel during the transfer).
The others go through the frontend's two-leg path, on the `stream` transport (`tandem frontend`'s
default; test_disaggregated.py runs `tandem serve`, whose default is `mux`; these pass with
TANDEM_ENGINE_TRANSPORT=mux too).
"""

from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest

from tandem.client import TandemClient
from tandem.v1 import common_pb2, engine_pb2, engine_pb2_grpc

LEASE_SECONDS = 2.0
LONG_PROMPT = "Here is a long story about a lighthouse keeper and the sea. " * 60  # ~800 tokens


@pytest.fixture(scope="module")
def topo(server_tools, smollm2_dir):
    t = server_tools
    pport, dport, fport = t.free_port(), t.free_port(), t.free_port()
    prefill, decode, frontend = (f"127.0.0.1:{p}" for p in (pport, dport, fport))
    # Fixed pools: two engines on one GPU cannot each size theirs by free memory.
    producer = t.ServerProcess(["engine", "--port", str(pport), "--kv-role", "producer",
                                "--kv-lease-seconds", str(LEASE_SECONDS), "--num-kv-blocks", "1024"])
    # The proxies below listen on loopback ports of their own: the consumer trusts them all.
    consumer = t.ServerProcess(["engine", "--port", str(dport), "--kv-role", "consumer", "--num-kv-blocks", "1024",
                                "--kv-producer", "127.0.0.1:*"])
    front = t.ServerProcess(["frontend", "--host", "127.0.0.1", "--port", str(fport), "--prefill-engine", prefill,
                             "--decode-engine", decode, "--allow-admin-commands", "--engine-connect-timeout", "120"])
    procs = [producer, consumer, front]
    try:
        for address, service, proc in ((prefill, "tandem.v1.Engine", producer), (decode, "tandem.v1.Engine", consumer),
                                       (frontend, "tandem.v1.Frontend", front)):
            t.wait_serving(address, service, 300, proc.proc)
        with TandemClient(frontend) as client:
            yield {"client": client, "prefill": prefill, "decode": decode, "consumer": consumer}
    finally:
        for p in procs:
            p.stop()


def utility(address: str, command: int, request_id: str = "") -> dict:
    from google.protobuf import json_format

    with grpc.insecure_channel(address) as ch:
        resp = engine_pb2_grpc.EngineStub(ch).Utility(
            common_pb2.UtilityRequest(command=command, request_id=request_id), timeout=10)
    return json_format.MessageToDict(resp.result)


def wait_all_free(addresses, timeout: float = 15.0) -> None:
    """Every engine: no running, waiting or loading request, no lease, no block in use."""
    deadline = time.monotonic() + timeout
    while True:
        stats = {a: utility(a, common_pb2.UTILITY_COMMAND_STATS) for a in addresses}
        if all(s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_blocks_used"] == 0
               and s.get("kv_leases_active", 0) == 0 and s.get("kv_loading_requests", 0) == 0
               and s["in_flight"] == 0 for s in stats.values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"resources leaked: {stats}")
        time.sleep(0.05)


def prefill_leg(address: str, rid: str, prompt_ids: list[int]) -> engine_pb2.EngineResponse:
    req = engine_pb2.EngineRequest(request_id=rid, prompt_token_ids=prompt_ids)
    req.sampling.max_tokens = 1
    req.sampling.temperature = 0.0
    req.kv_transfer_params.do_remote_decode = True
    with grpc.insecure_channel(address) as ch:
        return engine_pb2_grpc.EngineStub(ch).Generate(req, timeout=60)


def decode_leg_request(rid: str, prompt_ids: list[int], final: engine_pb2.EngineResponse, port: int):
    req = engine_pb2.EngineRequest(request_id=rid, prompt_token_ids=prompt_ids + list(final.token_ids))
    req.sampling.max_tokens = 4
    req.sampling.temperature = 0.0
    req.kv_transfer_params.CopyFrom(final.kv_transfer_params)
    req.kv_transfer_params.do_remote_decode = False
    req.kv_transfer_params.do_remote_prefill = True
    req.kv_transfer_params.remote_port = port  # through the proxy
    return req


class Proxy:
    """A TCP proxy in front of the producer's KV address: flips one byte at offset `flip_at` of
    the producer's stream, or sends it slowly (`delay` seconds per 64 KiB)."""

    def __init__(self, target: tuple[str, int], flip_at: int | None = None, delay: float = 0.0) -> None:
        self.target, self.flip_at, self.delay = target, flip_at, delay
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.forwarded = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_producer: bool) -> None:
        try:
            while data := src.recv(65536):
                if from_producer:
                    if self.flip_at is not None and self.forwarded <= self.flip_at < self.forwarded + len(data):
                        i = self.flip_at - self.forwarded
                        data = data[:i] + bytes([data[i] ^ 0x5A]) + data[i + 1:]
                    self.forwarded += len(data)
                    time.sleep(self.delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            # Closed, not only shut down: unread bytes then reset the producer's connection, as
            # the consumer's own close does (a half-closed proxy would hold the pull open).
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def close(self) -> None:
        self.listener.close()


def transfer_target(final: engine_pb2.EngineResponse) -> tuple[str, int]:
    return final.kv_transfer_params.remote_host, final.kv_transfer_params.remote_port


PROMPT_IDS = list(range(1000, 1000 + 150))  # ten blocks of 16 and a partial one


def test_lease_expires_when_the_decode_leg_never_comes(topo):
    before = utility(topo["prefill"], common_pb2.UTILITY_COMMAND_STATS)
    final = prefill_leg(topo["prefill"], "expiring", PROMPT_IDS)
    assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH and len(final.token_ids) == 1
    params = final.kv_transfer_params
    assert params.lease_id and params.first_token_id == final.token_ids[0]
    assert params.num_prompt_tokens == len(PROMPT_IDS) and len(params.remote_block_ids) == -(-len(PROMPT_IDS) // 16)
    assert params.lease_expiry_unix == pytest.approx(time.time() + LEASE_SECONDS, abs=1.5)
    held = utility(topo["prefill"], common_pb2.UTILITY_COMMAND_STATS)
    assert held["kv_leases_active"] == 1 and held["kv_blocks_used"] >= len(params.remote_block_ids)
    wait_all_free([topo["prefill"]], timeout=LEASE_SECONDS + 5)
    after = utility(topo["prefill"], common_pb2.UTILITY_COMMAND_STATS)
    assert after["kv_leases_expired"] == before.get("kv_leases_expired", 0) + 1


def test_corrupted_transfer_fails_the_decode_leg_clearly_and_frees_both(topo):
    final = prefill_leg(topo["prefill"], "corrupt", PROMPT_IDS)
    proxy = Proxy(transfer_target(final), flip_at=200_000)  # inside the first block's bytes
    try:
        with grpc.insecure_channel(topo["decode"]) as ch:
            stub = engine_pb2_grpc.EngineStub(ch)
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Stream(decode_leg_request("corrupt-d", PROMPT_IDS, final, proxy.port), timeout=60))
    finally:
        proxy.close()
    # Corrupt bytes on the wire: retryable, not an engine fault.
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "checksum mismatch" in err.value.details(), err.value.details()
    assert proxy.forwarded > 200_000  # the flip happened on the wire
    wait_all_free([topo["prefill"], topo["decode"]])
    consumer = utility(topo["decode"], common_pb2.UTILITY_COMMAND_STATS)
    assert consumer["kv_remote_load_failures"] >= 1


def test_cancel_during_the_transfer_frees_both(topo):
    final = prefill_leg(topo["prefill"], "cancelled", PROMPT_IDS)
    proxy = Proxy(transfer_target(final), delay=0.05)  # ~1.3 MB/s: the pull takes seconds
    try:
        with grpc.insecure_channel(topo["decode"]) as ch:
            call = engine_pb2_grpc.EngineStub(ch).Stream(
                decode_leg_request("cancelled-d", PROMPT_IDS, final, proxy.port), timeout=60)
            deadline = time.monotonic() + 20
            while proxy.forwarded == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            loading = utility(topo["decode"], common_pb2.UTILITY_COMMAND_STATS)
            assert proxy.forwarded > 0 and loading["kv_loading_requests"] == 1  # mid-transfer
            call.cancel()
            with pytest.raises(grpc.RpcError) as err:
                list(call)
            assert err.value.code() == grpc.StatusCode.CANCELLED
        wait_all_free([topo["prefill"], topo["decode"]])
    finally:
        proxy.close()


def test_client_cancel_right_after_the_first_token_frees_both(topo):
    client = topo["client"]
    call = client.stream(LONG_PROMPT, max_tokens=64, temperature=0.0, ignore_eos=True)
    first = next(iter(call))
    assert len(first.choices[0].token_ids) == 1  # the prefill leg's token; the decode leg is starting
    call.cancel()
    with pytest.raises(grpc.RpcError) as err:
        for _ in call:
            pass
    assert err.value.code() == grpc.StatusCode.CANCELLED
    wait_all_free([topo["prefill"], topo["decode"]])
    assert client.utility("stats")["frontend"]["in_flight"] == 0


def test_frontend_abort_between_and_during_legs_ends_with_abort(topo):
    client = topo["client"]
    call = client.stream(LONG_PROMPT, request_id="to-abort", max_tokens=200, temperature=0.0, ignore_eos=True)
    msgs = iter(call)
    next(msgs)
    assert client.utility("abort", request_id="to-abort")["choices"] == 1
    rest = list(msgs)
    assert rest and rest[-1].choices[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert sum(1 for m in rest if m.HasField("usage")) == 1  # one terminal message
    wait_all_free([topo["prefill"], topo["decode"]])


def test_deadline_covers_both_legs(topo):
    client = topo["client"]
    with pytest.raises(grpc.RpcError) as err:
        client.generate(LONG_PROMPT, max_tokens=400, temperature=0.0, ignore_eos=True, timeout=2.0)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_all_free([topo["prefill"], topo["decode"]])
    assert client.utility("stats")["frontend"]["in_flight"] == 0


def test_decode_engine_killed_between_the_legs(topo):
    """Runs last in this module: it kills the consumer. The prefill leg succeeds, the decode leg
    finds no engine; the client gets UNAVAILABLE naming the decode leg, and the frontend
    releases the producer's lease at once (not at expiry)."""
    client = topo["client"]
    before = utility(topo["prefill"], common_pb2.UTILITY_COMMAND_STATS)
    topo["consumer"].proc.kill()
    topo["consumer"].proc.wait()
    with pytest.raises(grpc.RpcError) as err:
        client.generate("The capital of France is", max_tokens=8, temperature=0.0, timeout=30)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    # "decode leg on ADDR: ..." (the call failed) or "decode leg: no engine replica is ready"
    # (the health monitor saw the death first): either way after the prefill leg.
    assert err.value.details().startswith("engine: decode leg"), err.value.details()
    wait_all_free([topo["prefill"]], timeout=LEASE_SECONDS - 0.5)  # released, not expired
    after = utility(topo["prefill"], common_pb2.UTILITY_COMMAND_STATS)
    assert after["kv_leases_granted"] == before["kv_leases_granted"] + 1  # the prefill leg ran
    assert after["kv_leases_expired"] == before["kv_leases_expired"]
    # The decode replica is out of rotation: the next request is refused at once, clearly,
    # before any prefill work.
    with pytest.raises(grpc.RpcError) as err:
        client.generate("Hello", max_tokens=4, timeout=30)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no decode engine replica is ready" in err.value.details()
    assert utility(topo["prefill"], common_pb2.UTILITY_COMMAND_STATS)["kv_leases_granted"] == after["kv_leases_granted"]
    assert client.utility("stats")["frontend"]["in_flight"] == 0
