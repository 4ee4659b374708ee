"""`TwoLegCall` against scripted engine legs: what each leg is sent, what the choice sees, and
that a lease the frontend holds is released on every path it owns (and only those)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from tandem.frontend.disaggregation import DECODE_LEG_SUFFIX, LegFailed, TwoLegCall
from tandem.frontend.engine_pool import NoEngineAvailable
from tandem.v1 import common_pb2, engine_pb2

PROMPT = [5, 6, 7, 8]
LENGTH, STOP, UNSET = common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_UNSPECIFIED


def resp(tokens, finish=UNSET, prompt_tokens=0, completion=0, cached=0, lease=None, ttft=0.0):
    r = engine_pb2.EngineResponse(request_id="leg", token_ids=tokens, finish_reason=finish)
    if finish != UNSET:
        r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.cached_prompt_tokens = prompt_tokens, completion, cached
        r.timings.ttft = ttft
    if lease:
        r.kv_transfer_params.lease_id = lease
        r.kv_transfer_params.remote_block_ids.extend([3, 4])
        r.kv_transfer_params.do_remote_decode = True
        r.kv_transfer_params.first_token_id = tokens[0]
    return r


class FakeCall:
    """A scripted engine call: yields responses, or raises an RpcError after them."""

    def __init__(self, script, error: grpc.StatusCode | None = None, details: str = "scripted") -> None:
        self.script, self.error, self.cancelled, self.details = script, error, False, details

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for r in self.script:
            await asyncio.sleep(0)
            yield r
        if self.error is not None:
            raise grpc.aio.AioRpcError(self.error, grpc.aio.Metadata(), grpc.aio.Metadata(), self.details)

    def cancel(self):
        self.cancelled = True


class FakeReplica:
    def __init__(self, address: str, calls: list[FakeCall]) -> None:
        self.address, self.calls, self.in_flight = address, calls, 0
        self.sent: list[engine_pb2.EngineRequest] = []
        self.aborts: list[str] = []
        self.stub = SimpleNamespace(Utility=self._utility)

    def open_call(self, request, timeout, metadata, multiplexed):
        self.sent.append(request)
        return self.calls.pop(0)

    async def _utility(self, request, timeout=None, metadata=None):
        self.aborts.append(request.request_id)


def request(max_tokens=None, min_tokens=None) -> engine_pb2.EngineRequest:
    er = engine_pb2.EngineRequest(request_id="r-1-0", prompt_token_ids=PROMPT)
    er.sampling.temperature = 0.0
    if max_tokens is not None:
        er.sampling.max_tokens = max_tokens
    if min_tokens is not None:
        er.sampling.min_tokens = min_tokens
    return er


class FakePool:
    def __init__(self, replicas) -> None:
        self.replicas = replicas

    def pick(self):
        if not self.replicas:
            raise NoEngineAvailable("no engine replica is ready")
        return self.replicas[0]


def make(prefill_calls, decode_calls, total: int, er=None, timeout=None, decode_ready=True):
    p, d = FakeReplica("p:1", prefill_calls), FakeReplica("d:1", decode_calls)
    pools = SimpleNamespace(prefill=FakePool([p]), decode=FakePool([d] if decode_ready else []))
    # The decode replica is picked from its pool when the decode leg starts (as the server does).
    call = TwoLegCall(er or request(total), pools, p, None, total, timeout, (), False)
    return call, p, d, pools


async def drain(call) -> list[engine_pb2.EngineResponse]:
    out = [r for r in [x async for x in call]]
    await asyncio.sleep(0.01)  # fire-and-forget lease releases run
    return out


def test_two_legs_one_stream_with_merged_usage():
    async def main():
        call, p, d, _ = make([FakeCall([resp([11], LENGTH, 4, 1, cached=2, lease="L", ttft=0.5)])],
                             [FakeCall([resp([12, 13]), resp([14], LENGTH, 5, 3)])], total=4,
                             er=request(4, min_tokens=3))
        got = await drain(call)
        return got, p, d

    got, p, d = asyncio.run(main())
    assert [list(r.token_ids) for r in got] == [[11], [12, 13], [14]]
    assert [r.finish_reason for r in got] == [UNSET, UNSET, LENGTH]
    assert all(r.request_id == "r-1-0" for r in got)
    final = got[-1]
    assert (final.usage.prompt_tokens, final.usage.completion_tokens, final.usage.cached_prompt_tokens,
            final.usage.total_tokens) == (4, 4, 2, 8)
    assert final.timings.ttft == 0.5  # the prefill leg's
    prefill_leg, decode_leg = p.sent[0], d.sent[0]
    assert prefill_leg.sampling.max_tokens == 1 and prefill_leg.sampling.min_tokens == 1
    assert prefill_leg.kv_transfer_params.do_remote_decode and prefill_leg.request_id == "r-1-0"
    assert list(decode_leg.prompt_token_ids) == PROMPT + [11]
    assert decode_leg.sampling.max_tokens == 3 and decode_leg.sampling.min_tokens == 2
    assert decode_leg.num_constrained_prompt_tokens == 0  # unconstrained
    assert decode_leg.request_id == "r-1-0" + DECODE_LEG_SUFFIX
    kv = decode_leg.kv_transfer_params
    assert kv.do_remote_prefill and not kv.do_remote_decode and kv.lease_id == "L" and list(kv.remote_block_ids) == [3, 4]
    assert p.aborts == []  # the consumer took the lease over
    assert d.in_flight == 0


def test_a_constrained_choice_tells_the_decode_leg_its_first_token_is_output():
    er = request(4)
    er.sampling.regex = "[0-9]+"

    async def main():
        call, p, d, _ = make([FakeCall([resp([11], LENGTH, 4, 1, lease="L")])],
                             [FakeCall([resp([12], LENGTH, 5, 3)])], total=4, er=er)
        await drain(call)
        return p.sent[0], d.sent[0]

    prefill_leg, decode_leg = asyncio.run(main())
    assert prefill_leg.sampling.regex == decode_leg.sampling.regex == "[0-9]+"
    assert prefill_leg.num_constrained_prompt_tokens == 0
    assert decode_leg.num_constrained_prompt_tokens == 1 and list(decode_leg.prompt_token_ids) == PROMPT + [11]


def test_first_token_ends_the_choice_and_the_lease_is_released():
    async def main():
        call, p, d, _ = make([FakeCall([resp([2], STOP, 4, 1, lease="L")])], [], total=10)
        return await drain(call), p, d

    got, p, d = asyncio.run(main())
    assert len(got) == 1 and got[0].finish_reason == STOP and list(got[0].token_ids) == [2]
    assert not got[0].HasField("kv_transfer_params")  # the lease is not the client's business
    assert d.sent == [] and p.aborts == ["r-1-0"]


def test_one_token_needs_no_decode_leg_and_keeps_no_kv():
    async def main():
        call, p, d, _ = make([FakeCall([resp([2], LENGTH, 4, 1)])], [], total=1)
        return await drain(call), p, d

    got, p, d = asyncio.run(main())
    assert [r.finish_reason for r in got] == [LENGTH]
    assert not p.sent[0].HasField("kv_transfer_params") and d.sent == [] and p.aborts == []


@pytest.mark.parametrize("code,released", [
    (grpc.StatusCode.UNAVAILABLE, True),  # the consumer is gone: nothing pulls, release now
    (grpc.StatusCode.RESOURCE_EXHAUSTED, True),  # refused at admission
    (grpc.StatusCode.INTERNAL, False),  # a failed pull: the consumer released it itself
    (grpc.StatusCode.CANCELLED, False),
])
def test_decode_leg_failure_names_the_decode_replica(code, released):
    async def main():
        call, p, d, pools = make([FakeCall([resp([11], LENGTH, 4, 1, lease="L")])], [FakeCall([], code)], total=5)
        got = []
        with pytest.raises(LegFailed) as err:
            async for r in call:
                got.append(r)
        await asyncio.sleep(0.01)
        return got, err.value, p, pools

    got, err, p, pools = asyncio.run(main())
    assert [list(r.token_ids) for r in got] == [[11]]  # the first token was already the client's
    assert err.code() == code and err.pool is pools.decode and err.replica.address == "d:1"
    assert err.details().startswith("decode leg on d:1: ")
    assert p.aborts == (["r-1-0"] if released else [])


def test_a_dead_producer_behind_the_decode_leg_names_the_prefill_replica():
    """Item 8: the decode engine answers UNAVAILABLE kv_producer_unavailable (the producer died):
    the failed replica is the prefill one, so the decode engine stays in rotation."""
    async def main():
        dead = FakeCall([], grpc.StatusCode.UNAVAILABLE, "kv_producer_unavailable: cannot reach the KV producer")
        call, p, d, pools = make([FakeCall([resp([11], LENGTH, 4, 1, lease="L")])], [dead], total=5)
        with pytest.raises(LegFailed) as err:
            async for _ in call:
                pass
        return err.value, pools

    err, pools = asyncio.run(main())
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert err.pool is pools.prefill and err.replica.address == "p:1"


def test_prefill_leg_failure_names_the_prefill_replica_and_releases():
    async def main():
        call, p, d, pools = make([FakeCall([], grpc.StatusCode.UNAVAILABLE)], [], total=5)
        with pytest.raises(LegFailed) as err:
            await drain(call)
        await asyncio.sleep(0.01)
        return err.value, p, d, pools

    err, p, d, pools = asyncio.run(main())
    assert err.pool is pools.prefill and err.replica is p and d.sent == []
    assert p.aborts == ["r-1-0"]  # a lease may exist though its response was lost


def test_cancel_between_the_legs_releases_once_and_never_opens_the_decode_leg():
    async def main():
        call, p, d, _ = make([FakeCall([resp([11], LENGTH, 4, 1, lease="L")])], [FakeCall([resp([1], LENGTH)])], 5)
        it = call.__aiter__()
        first = await it.__anext__()
        call.cancel()
        await it.aclose()
        await asyncio.sleep(0.01)
        return first, p, d

    first, p, d = asyncio.run(main())
    assert list(first.token_ids) == [11]
    assert d.sent == [] and p.aborts == ["r-1-0"]


def test_cancel_during_the_decode_leg_cancels_it_and_leaves_the_lease_to_the_consumer():
    async def main():
        decode = FakeCall([resp([12]), resp([13]), resp([14], LENGTH, 5, 3)])
        call, p, d, _ = make([FakeCall([resp([11], LENGTH, 4, 1, lease="L")])], [decode], 4)
        it = call.__aiter__()
        await it.__anext__()
        await it.__anext__()  # the decode leg's first message
        call.cancel()
        await it.aclose()
        await asyncio.sleep(0.01)
        return decode, p

    decode, p = asyncio.run(main())
    assert decode.cancelled and p.aborts == []


def test_a_deadline_that_passes_before_the_decode_leg_fails_it_and_releases():
    async def main():
        call, p, d, _ = make([FakeCall([resp([11], LENGTH, 4, 1, lease="L")])], [FakeCall([])], 5, timeout=0.05)
        it = call.__aiter__()
        await it.__anext__()
        await asyncio.sleep(0.1)
        with pytest.raises(LegFailed) as err:
            await it.__anext__()
        await asyncio.sleep(0.01)
        return err.value, p, d

    err, p, d = asyncio.run(main())
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and d.sent == [] and p.aborts == ["r-1-0"]


def test_no_decode_replica_ready_when_the_decode_leg_starts():
    async def main():
        call, p, d, pools = make([FakeCall([resp([11], LENGTH, 4, 1, lease="L")])], [], 5, decode_ready=False)
        got = []
        with pytest.raises(LegFailed) as err:
            async for r in call:
                got.append(r)
        await asyncio.sleep(0.01)
        return got, err.value, p, pools

    got, err, p, pools = asyncio.run(main())
    assert [list(r.token_ids) for r in got] == [[11]]
    assert err.code() == grpc.StatusCode.UNAVAILABLE and err.replica is None and err.pool is pools.decode
    assert err.details() == "decode leg: no engine replica is ready"
    assert p.aborts == ["r-1-0"]


def test_a_first_token_sent_before_the_final_message_is_not_lost():
    async def main():
        call, p, d, _ = make([FakeCall([resp([2]), resp([], STOP, 4, 1)])], [], total=10)
        return await drain(call)

    got = asyncio.run(main())
    assert len(got) == 1 and list(got[0].token_ids) == [2] and got[0].finish_reason == STOP


def test_cli_flags_of_the_two_pools_and_the_serve_children():
    from tandem import options
    from tandem.cli import _disaggregated_engines, _kv_producer_address, _kv_role_argv, build_parser
    from tandem.startup_checks import StartupError

    parser = build_parser()
    args = options.parse_args(parser, ["frontend", "--prefill-engine", "a:1", "--prefill-engine", "a:2",
                                       "--decode-engine", "b:1"])
    assert _disaggregated_engines(args) == (["a:1", "a:2"], ["b:1"])
    for argv, flag in ((["--prefill-engine", "a:1"], "--decode-engine"), (["--decode-engine", "b:1"], "--prefill-engine"),
                       (["--engine", "e:1", "--prefill-engine", "a:1", "--decode-engine", "b:1"], "--engine")):
        with pytest.raises(StartupError) as err:
            _disaggregated_engines(options.parse_args(parser, ["frontend", *argv]))
        assert err.value.flag == flag
    serve = options.parse_args(parser, ["serve", "--disaggregated", "--engine-host", "127.0.0.1"])
    picked = _kv_producer_address(serve)  # a free port, known before the engines start
    host, port = picked.rsplit(":", 1)
    assert host == "127.0.0.1" and 0 < int(port) < 65536
    assert _kv_role_argv(serve, "producer", picked) == ["--kv-role", "producer", "--kv-transfer-address", picked]
    # The decode engine trusts exactly the prefill engine's pull address.
    assert _kv_role_argv(serve, "consumer", picked) == ["--kv-role", "consumer", "--kv-producer", picked]
    named = options.parse_args(parser, ["serve", "--disaggregated", "--kv-engine-id", "x",
                                        "--kv-transfer-address", "10.0.0.1:7000"])
    assert _kv_producer_address(named) == "10.0.0.1:7000"
    assert _kv_role_argv(named, "producer", "10.0.0.1:7000") == [
        "--kv-role", "producer", "--kv-transfer-address", "10.0.0.1:7000", "--kv-engine-id", "x-prefill"]
    assert _kv_role_argv(named, "consumer", "10.0.0.1:7000") == [
        "--kv-role", "consumer", "--kv-producer", "10.0.0.1:7000", "--kv-engine-id", "x-decode"]


def test_no_release_when_the_producer_kept_no_lease():
    async def main():
        stop, p1, _, _ = make([FakeCall([resp([2], STOP, 4, 1)])], [], total=10)  # a producer keeps nothing
        await drain(stop)
        plain, p2, d2, _ = make([FakeCall([resp([11], LENGTH, 4, 1)])], [FakeCall([resp([12], LENGTH, 5, 1)])], 3)
        got = await drain(plain)  # a prefill engine without a KV role: no lease, the decode leg recomputes
        return p1, p2, d2, got

    p1, p2, d2, got = asyncio.run(main())
    assert p1.aborts == [] and p2.aborts == []
    assert not d2.sent[0].HasField("kv_transfer_params")
    assert [list(r.token_ids) for r in got] == [[11], [12]]


def test_the_decode_replica_is_reported_when_picked():
    seen = []

    async def main():
        call, p, d, _ = make([FakeCall([resp([11], LENGTH, 4, 1, lease="L")])], [FakeCall([resp([12], LENGTH, 5, 1)])], 3)
        call.on_decode_replica = seen.append
        await drain(call)
        return d

    d = asyncio.run(main())
    assert seen == [d]
