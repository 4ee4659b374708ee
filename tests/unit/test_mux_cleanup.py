"""Issue #10, failure 11: the multiplexed engine transport. The client's deadline covers the
request on the engine (not only its Submit), and closing a subscription frees the IDs of every
request submitted on it, including those that finished but were never delivered."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tandem.engine_service.core.engine import StepOutput
from tandem.engine_service.sequence import FinishReason
from tandem.engine_service.api.server import EngineServicer
from tandem.frontend.engine_mux import MuxChannel
from tandem.proto_wire import Limits
from tandem.v1 import common_pb2, engine_pb2


# -- frontend side: MuxCall deadlines ------------------------------------------------------------------
class _Subscription:
    """A Subscribe call that acknowledges and then delivers nothing (a stalled engine)."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.queue.put_nowait(engine_pb2.EngineBatch())

    async def read(self):
        return await self.queue.get()

    def cancel(self) -> None:
        self.queue.put_nowait(grpc.aio.EOF)


class _EngineStub:
    def __init__(self) -> None:
        self.submits: list[tuple[str, float | None]] = []
        self.aborts: list[str] = []

    def Subscribe(self, request):
        return _Subscription()

    async def Submit(self, request, timeout=None, metadata=None):
        self.submits.append((request.request_id, timeout))
        return engine_pb2.SubmitResponse(request_id=request.request_id)

    async def Utility(self, request, timeout=None, metadata=None):
        assert request.command == common_pb2.UTILITY_COMMAND_ABORT
        self.aborts.append(request.request_id)
        return common_pb2.UtilityResponse(command=request.command)


def test_mux_deadline_covers_the_request_on_the_engine():
    """Failure 11: a multiplexed request whose engine never answers ends with DEADLINE_EXCEEDED at
    the client's deadline and is aborted on the engine (before: the deadline covered only Submit,
    and the call waited for ever)."""

    async def scenario():
        stub = _EngineStub()
        channel = MuxChannel(stub, "engine:1")
        call = channel.call(engine_pb2.EngineRequest(request_id="r1", prompt_token_ids=[1]), 0.3, ())

        async def consume():
            async for _ in call:
                pass

        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(consume(), 3.0)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert 0.25 <= loop.time() - started < 2.0
        await asyncio.sleep(0.05)
        assert stub.aborts == ["r1"]  # nothing runs on unobserved
        assert stub.submits[0][1] <= 0.3  # Submit got what was left of the deadline
        assert channel.queues == {}
        await channel.close()

    asyncio.run(scenario())


# -- engine side: Subscribe cleanup ----------------------------------------------------------------------
class _Channel:
    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()

    async def next_batch(self):
        return [await self.queue.get()]


class _Engine:
    """The AsyncEngine surface that Subscribe/Submit use, with a hand-driven `finish`."""

    def __init__(self) -> None:
        self.channels: dict[str, _Channel] = {}
        self.members: dict[str, set[str]] = {}

    def open_channel(self, channel):
        self.channels[channel] = _Channel()
        self.members[channel] = set()
        return self.channels[channel]

    def channel_members(self, channel):
        return list(self.members.get(channel, ()))

    def close_channel(self, channel):
        self.channels.pop(channel, None)
        self.members.pop(channel, None)

    def submit(self, request_id, prompt, params, channel=None, **_):
        self.members[channel].add(request_id)

    def finish(self, request_id: str, channel: str) -> None:
        """The request ends in the engine: it leaves the channel's members and its last output
        waits in the channel's queue for the subscriber."""
        self.members[channel].discard(request_id)
        self.channels[channel].queue.put_nowait(
            StepOutput(request_id, new_token_ids=[5], finished=True, finish_reason=FinishReason.LENGTH))


class _Aborted(Exception):
    def __init__(self, code) -> None:
        super().__init__(code)
        self.code = code


class _Context:
    """The parts of a grpc.aio servicer context the engine servicer reads (no deadline set)."""

    def invocation_metadata(self):
        return ()

    def time_remaining(self):
        return None

    def peer(self):
        return "ipv4:127.0.0.1:1"

    def auth_context(self):
        return {}

    def set_trailing_metadata(self, md):
        pass

    async def abort(self, code, details=""):
        raise _Aborted(code)


def test_closed_subscription_frees_finished_but_undelivered_requests():
    """Failure 11: after a subscriber goes away, a request that had finished in the engine but
    whose last output was never delivered can be submitted again (before: ALREADY_EXISTS for ever)."""

    async def scenario():
        servicer = EngineServicer()
        engine = _Engine()
        servicer.attach(engine, Limits(vocab_size=100, max_model_len=64), {})
        ctx = _Context()
        subscription = servicer.Subscribe(engine_pb2.SubscribeRequest(channel_id="c1"), ctx)
        await subscription.__anext__()  # acknowledgement
        request = engine_pb2.EngineRequest(request_id="r1", channel_id="c1", prompt_token_ids=[1, 2])
        request.sampling.max_tokens = 4
        await servicer.Submit(request, ctx)
        engine.finish("r1", "c1")
        await subscription.aclose()  # the frontend went away before reading that output
        assert servicer._mux_requests == {}

        subscription = servicer.Subscribe(engine_pb2.SubscribeRequest(channel_id="c2"), ctx)
        await subscription.__anext__()
        again = engine_pb2.EngineRequest(request_id="r1", channel_id="c2", prompt_token_ids=[1, 2])
        again.sampling.max_tokens = 4
        assert (await servicer.Submit(again, ctx)).request_id == "r1"
        engine.finish("r1", "c2")
        batch = await subscription.__anext__()  # delivered normally on the new channel
        assert [r.request_id for r in batch.responses] == ["r1"]
        assert batch.responses[0].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert servicer._mux_requests == {}
        await subscription.aclose()

    asyncio.run(scenario())


def test_abort_after_the_grpc_channel_closed_ends_quietly():
    """A request cancelled while the frontend stops: its fire-and-forget abort runs after the
    gRPC channel to the engine was closed. It must end without an exception (before: grpc's
    UsageError 'Channel is closed.' escaped the task, a traceback in a clean Ctrl-C)."""
    from tandem.v1 import engine_pb2_grpc

    async def scenario():
        grpc_channel = grpc.aio.insecure_channel("127.0.0.1:1")
        channel = MuxChannel(engine_pb2_grpc.EngineStub(grpc_channel), "127.0.0.1:1")
        call = channel.call(engine_pb2.EngineRequest(request_id="r1", prompt_token_ids=[1]), None, ())
        call.submitted = True
        await grpc_channel.close()
        await call._abort()

    asyncio.run(scenario())


@pytest.mark.parametrize("stopping", [False, True])
def test_a_subscription_ending_while_the_frontend_stops_is_no_loss(stopping: bool):
    """Under `tandem serve` a Ctrl-C reaches the engines with the frontend, and an engine may end
    the subscription while the frontend still drains: once `stopping()` was called that is
    expected (an info line), not an `engine_subscription_lost` warning. Requests still on the
    channel end with UNAVAILABLE either way."""
    from structlog.testing import capture_logs

    async def scenario():
        stub = _EngineStub()
        channel = MuxChannel(stub, "engine:1")
        await channel.ensure_open()
        queue: asyncio.Queue = asyncio.Queue()
        channel.queues["r1"] = queue
        if stopping:
            channel.stopping()
        with capture_logs() as logs:
            channel._call.cancel()  # the engine ends the subscription
            failure = await asyncio.wait_for(queue.get(), 3.0)
        assert failure.code() == grpc.StatusCode.UNAVAILABLE
        await channel.close()
        return [entry["event"] for entry in logs]

    events = asyncio.run(scenario())
    if stopping:
        assert "engine_subscription_ended_while_stopping" in events and "engine_subscription_lost" not in events
    else:
        assert "engine_subscription_lost" in events
