"""Issue #10, failures 2, 4, 7, 8 and 9, against the real frontend over real gRPC in this process.

The engine is a scripted fake (`FakeEngine`): it streams one token per `token_delay` up to
max_tokens, can delay admission, records which requests it saw, cancelled or aborted, and
answers Utility like the real engine. The tokenizer is the real SmolLM2 one. Each test names the
numbered failure of issue #10 it covers.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from google.protobuf import json_format
from grpc_health.v1 import health_pb2

from tandem.frontend.engine_pool import EnginePool
from tandem.frontend.metrics import FrontendMetrics
from tandem.frontend.request_builder import RequestBuilder
from tandem.frontend.request_ids import RequestIdMap
from tandem.frontend.server import FrontendServicer
from tandem.frontend.tokenize_pool import TokenizePool
from tandem.frontend.tokenizer import TextTokenizer
from tandem.grpc_service import add_service
from tandem.health import add_health
from tandem.proto_wire import Limits, to_struct
from tandem.security import SecurityOptions
from tandem.v1 import common_pb2, engine_pb2, engine_pb2_grpc, frontend_pb2, frontend_pb2_grpc
from tests.conftest import free_port

C = common_pb2
VOCAB = 49152
MAX_LEN = 8192


class FakeEngine(engine_pb2_grpc.EngineServicer):
    """A scripted engine: admission after `admit_delay`, one token per `token_delay`."""

    def __init__(self, model_path: str, admit_delay: float = 0.0, token_delay: float = 0.01) -> None:
        self.model_path = model_path
        self.admit_delay = admit_delay
        self.token_delay = token_delay
        self.running: dict[str, asyncio.Event] = {}  # request id -> set when aborted
        self.seen: list[str] = []
        self.cancelled: list[str] = []
        self.flushes = 0

    async def Stream(self, request, context):
        await asyncio.sleep(self.admit_delay)
        rid = request.request_id
        self.seen.append(rid)
        aborted = self.running[rid] = asyncio.Event()
        try:
            n = request.sampling.max_tokens if request.sampling.HasField("max_tokens") else 16
            for i in range(n):
                try:
                    await asyncio.wait_for(aborted.wait(), self.token_delay)
                except asyncio.TimeoutError:
                    pass
                if aborted.is_set():
                    yield engine_pb2.EngineResponse(request_id=rid, finish_reason=C.FINISH_REASON_ABORT)
                    return
                msg = engine_pb2.EngineResponse(request_id=rid, token_ids=[100 + i % 50])
                if i == n - 1:
                    msg.finish_reason = C.FINISH_REASON_LENGTH
                    msg.usage.prompt_tokens = len(request.prompt_token_ids)
                    msg.usage.completion_tokens = n
                yield msg
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise
        finally:
            self.running.pop(rid, None)

    async def GetModelInfo(self, request, context):
        return engine_pb2.EngineModelInfo(model="smol", model_path=self.model_path, vocab_size=VOCAB,
                                          max_model_len=MAX_LEN, kv_blocks=1024, block_size=16,
                                          kv_capacity_tokens=1024 * 16)

    async def Utility(self, request, context):
        cmd = request.command
        if cmd == C.UTILITY_COMMAND_ABORT:
            event = self.running.get(request.request_id)
            if event is None:
                await context.abort(grpc.StatusCode.NOT_FOUND, "not in flight")
            event.set()
            result = {"aborted": request.request_id}
        elif cmd == C.UTILITY_COMMAND_FLUSH_PREFIX_CACHE:
            self.flushes += 1
            result = {"flushed": True}
        else:
            result = {"status": "SERVING", "in_flight": len(self.running)}
        return C.UtilityResponse(command=cmd, result=to_struct(result))


async def start_engine(fake: FakeEngine, port: int = 0) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    add_service(server, fake, engine_pb2.DESCRIPTOR.services_by_name["Engine"])
    health = await add_health(server, "tandem.v1.Engine")
    await health.set("tandem.v1.Engine", health_pb2.HealthCheckResponse.SERVING)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, f"127.0.0.1:{bound}"


class SlowTokenizer(TextTokenizer):
    """The real tokenizer, except that prompts starting with "SLOW" take `slow_s` to encode while
    holding the tokenizer's lock, as a multi-megabyte prompt does in the Rust tokenizer."""

    slow_s = 3.0

    def encode(self, text, add_special_tokens=True):
        if text.startswith("SLOW"):
            with self._lock:
                time.sleep(self.slow_s)
        return super().encode(text, add_special_tokens)

    def clone(self):
        twin = super().clone()
        twin.__class__ = SlowTokenizer
        return twin


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir) -> SlowTokenizer:
    base = TextTokenizer.from_pretrained(smollm2_dir)
    tok = SlowTokenizer(base.hf_tokenizer, kind=base.kind, probe_passed=base.probe_passed,
                        extra_eos_token_ids=base.eos_token_ids)
    tok.max_token_bytes  # computed once for the module
    return tok


class Stack:
    """A fake engine and a real frontend, both served on loopback in this event loop."""

    def __init__(self, tokenizer, smollm2_dir, security: SecurityOptions | None = None,
                 pool: tuple[int, int] = (2, 256), engine_cls: type = None, trust_kv_callers: bool = False,
                 **engine_kw) -> None:
        self.trust_kv_callers = trust_kv_callers
        self.pool_size = pool
        self.tokenizer = tokenizer
        self.model_path = str(smollm2_dir)
        self.security = security or SecurityOptions()
        self.engine = (engine_cls or FakeEngine)(self.model_path, **engine_kw)
        self.metrics = FrontendMetrics()

    async def __aenter__(self) -> "Stack":
        self.engine_server, engine_addr = await start_engine(self.engine)
        self.pool = EnginePool([engine_addr])
        await self.pool.wait_ready(timeout=10)
        self.ids = RequestIdMap("t")
        self.servicer = FrontendServicer(self.pool, self.ids, self.metrics, access=self.security.access_policy(),
                                         trust_kv_callers=self.trust_kv_callers)
        builder = RequestBuilder(self.tokenizer, Limits(VOCAB, MAX_LEN, 16), "smol")
        self.servicer.attach(builder, TokenizePool(self.tokenizer, *self.pool_size))
        self.server = grpc.aio.server(interceptors=self.security.server_interceptors())
        add_service(self.server, self.servicer, frontend_pb2.DESCRIPTOR.services_by_name["Frontend"])
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.stub = frontend_pb2_grpc.FrontendStub(self.channel)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.channel.close()
        await self.server.stop(0)
        await self.pool.close()
        self.servicer.close()
        await self.engine_server.stop(0)

    def generate(self, prompt: str, token: str | None = None, timeout: float = 30, **kw):
        sampling = kw.pop("sampling", {"max_tokens": 4})
        req = frontend_pb2.GenerateRequest(prompt=prompt, **kw)
        for k, v in sampling.items():
            setattr(req.sampling, k, v)
        return self.stub.Generate(req, timeout=timeout, metadata=_auth(token))

    async def utility(self, command: int, request_id: str = "", token: str | None = None) -> dict:
        resp = await self.stub.Utility(C.UtilityRequest(command=command, request_id=request_id),
                                       timeout=10, metadata=_auth(token))
        return json_format.MessageToDict(resp.result)

    async def wait_registered(self, request_id: str, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while request_id not in self.ids:
            assert time.monotonic() < deadline, f"{request_id} never arrived"
            await asyncio.sleep(0.01)


def _auth(token: str | None):
    return (("authorization", f"Bearer {token}"),) if token else None


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


# -- failure 2: one client's prompt stalls the others -------------------------------------------------
def test_slow_tokenization_does_not_stall_other_requests(tokenizer, smollm2_dir):
    """Failure 2: while one prompt takes 3 s in the tokenizer, a short request still completes
    quickly (before: one tokenizer thread and one shared tokenizer serialised everyone)."""

    async def scenario():
        async with Stack(tokenizer, smollm2_dir) as s:
            slow = asyncio.ensure_future(s.generate("SLOW prompt"))
            await asyncio.sleep(0.2)
            started = time.monotonic()
            reply = await s.generate("Hello there")
            quick = time.monotonic() - started
            assert len(reply.choices[0].token_ids) == 4
            assert quick < 1.5, f"a short request took {quick:.2f}s behind a slow tokenization"
            assert (await slow).choices[0].finish_reason == C.FINISH_REASON_LENGTH

    run(scenario())


def test_tokenizer_queue_is_bounded(tokenizer, smollm2_dir):
    """Failure 2: past the tokenizer pool's bound a prompt gets RESOURCE_EXHAUSTED with a retry
    hint at once, instead of queueing unbounded work behind a slow one."""

    async def scenario():
        async with Stack(tokenizer, smollm2_dir, pool=(1, 1)) as s:
            slow = asyncio.ensure_future(s.generate("SLOW prompt"))
            await asyncio.sleep(0.2)
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await s.generate("Hello there")
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert ("retry-after", "1") in tuple(err.value.trailing_metadata() or ())
            assert time.monotonic() - started < 1.5
            await slow
            assert len((await s.generate("Hello again")).choices[0].token_ids) == 4  # the slot is free again

    run(scenario())


def test_token_id_prompts_skip_the_tokenizer_pool(tokenizer, smollm2_dir):
    """A prompt given as token ids with no stop strings needs no tokenizer: it is prepared on the
    event loop (no thread hand-off on its TTFT path), so a full pool neither delays nor refuses it,
    and its ids are still checked. With a stop string it needs the tokenizer and takes the pool."""

    async def scenario():
        async with Stack(tokenizer, smollm2_dir, pool=(1, 1)) as s:
            slow = asyncio.ensure_future(s.generate("SLOW prompt"))
            await asyncio.sleep(0.2)
            started = time.monotonic()
            reply = await s.generate("", prompt_token_ids=[1, 2, 3])
            assert len(reply.choices[0].token_ids) == 4
            assert time.monotonic() - started < 1.5, "a token-id prompt waited for the tokenizer pool"
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await s.generate("", prompt_token_ids=[1, VOCAB])
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.aio.AioRpcError) as busy:
                await s.generate("", prompt_token_ids=[1, 2, 3], stop=["Hello"])
            assert busy.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            await slow

    run(scenario())


# -- failure 4: lost aborts ---------------------------------------------------------------------------
def test_abort_while_waiting_for_the_tokenizer_ends_every_choice(tokenizer, smollm2_dir):
    """Failure 4: an ABORT for a request still waiting for the tokenizer ends all its n choices at
    once and says so (before: NOT_FOUND, and the request then ran to completion)."""

    async def scenario():
        async with Stack(tokenizer, smollm2_dir) as s:
            call = asyncio.ensure_future(s.generate("SLOW and aborted", request_id="early", n=3,
                                                    sampling={"max_tokens": 50}))
            await s.wait_registered("early")
            answer = await s.utility(C.UTILITY_COMMAND_ABORT, "early")
            assert answer == {"aborted": "early", "choices": 3}
            started = time.monotonic()
            reply = await call
            assert time.monotonic() - started < 2.0  # not after the tokenizer (3 s) and a generation
            assert [c.finish_reason for c in reply.choices] == [C.FINISH_REASON_ABORT] * 3
            assert all(not c.token_ids for c in reply.choices)
            await asyncio.sleep(SlowTokenizer.slow_s + 0.3)  # the tokenizer finishes; nothing may reach the engine
            assert s.engine.seen == [] and len(s.ids) == 0

    run(scenario())


def test_abort_before_the_engine_admits_the_choices_ends_them(tokenizer, smollm2_dir):
    """Failure 4: an ABORT after the replica was picked but before the engine knows the choices
    ends every one (before: the engine said NOT_FOUND, the answer said 0 choices, they ran on)."""

    async def scenario():
        async with Stack(tokenizer, smollm2_dir, admit_delay=0.5, token_delay=0.02) as s:
            call = asyncio.ensure_future(s.generate("Hello", request_id="mid", n=2, sampling={"max_tokens": 40}))
            await s.wait_registered("mid")
            await asyncio.sleep(0.2)  # tokenized, choices submitted, engine not admitted yet
            assert s.engine.seen == []
            answer = await s.utility(C.UTILITY_COMMAND_ABORT, "mid")
            assert answer == {"aborted": "mid", "choices": 2}
            reply = await call
            assert [c.finish_reason for c in reply.choices] == [C.FINISH_REASON_ABORT] * 2
            await asyncio.sleep(0.8)
            assert not s.engine.running  # nothing keeps generating on the engine
            with pytest.raises(grpc.aio.AioRpcError) as err:  # the ID is free and nothing is in flight
                await s.utility(C.UTILITY_COMMAND_ABORT, "mid")
            assert err.value.code() == grpc.StatusCode.NOT_FOUND

    run(scenario())


def test_abort_while_running_counts_the_choices_it_ended(tokenizer, smollm2_dir):
    """Failure 4: an ABORT mid-generation ends every running choice, and the engine stops them."""

    async def scenario():
        async with Stack(tokenizer, smollm2_dir, token_delay=0.05) as s:
            req = frontend_pb2.GenerateRequest(prompt="Hello", request_id="late", n=2)
            req.sampling.max_tokens = 200
            stream = s.stub.Stream(req, timeout=30)
            first = await stream.read()
            assert first.choices
            answer = await s.utility(C.UTILITY_COMMAND_ABORT, "late")
            assert answer == {"aborted": "late", "choices": 2}
            endings = {}
            while (msg := await stream.read()) is not grpc.aio.EOF:
                for c in msg.choices:
                    if c.finish_reason:
                        endings[c.index] = c.finish_reason
            assert endings == {0: C.FINISH_REASON_ABORT, 1: C.FINISH_REASON_ABORT}
            await asyncio.sleep(0.3)
            assert not s.engine.running

    run(scenario())


# -- failure 7: cancels and deadlines counted as errors -------------------------------------------------
def _requests_by_code(metrics: FrontendMetrics) -> dict[str, float]:
    out = {}
    for metric in metrics.registry.collect():
        for sample in metric.samples:
            if sample.name.endswith("frontend_requests_total"):
                out[sample.labels["code"]] = out.get(sample.labels["code"], 0) + sample.value
    return out


class _LateEngineError(frontend_pb2_grpc.FrontendServicer):
    """The frontend's request scope and engine-error ending, with the engine's error landing
    after the client's deadline (the handler is blocked past it, as a busy event loop is)."""

    def __init__(self, frontend: FrontendServicer) -> None:
        self.frontend = frontend

    async def Generate(self, request, context):
        with self.frontend._observe(request, context, "Generate"):
            time.sleep(0.4)  # past the client's 0.2 s deadline; the engine's error arrives now
            error = grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(), "boom")
            await self.frontend._end_with_engine_error(context, error, self.frontend.pool.replicas[0])


def test_engine_error_racing_the_deadline_is_deadline_exceeded(tokenizer, smollm2_dir):
    """Failure 7: an engine error handled after the client's deadline is metered and logged as
    DEADLINE_EXCEEDED (before: aborting the expired call raised and counted UNKNOWN)."""

    async def scenario():
        metrics = FrontendMetrics()
        pool = EnginePool(["127.0.0.1:1"])
        frontend = FrontendServicer(pool, RequestIdMap("t"), metrics)
        server = grpc.aio.server()
        add_service(server, _LateEngineError(frontend), frontend_pb2.DESCRIPTOR.services_by_name["Frontend"])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = frontend_pb2_grpc.FrontendStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(frontend_pb2.GenerateRequest(prompt="x"), timeout=0.2)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await asyncio.sleep(0.5)
        await server.stop(0)
        await pool.close()
        codes = _requests_by_code(metrics)
        assert codes.get("DEADLINE_EXCEEDED") == 1 and not codes.get("UNKNOWN"), codes

    run(scenario())


class _FinalAtDeadlineEngine(FakeEngine):
    """Streams one token, then holds its final message until its own deadline is 20 ms away."""

    def __init__(self, model_path: str) -> None:
        super().__init__(model_path)
        self.given: list[float] = []  # each call's time remaining when it arrived

    async def Stream(self, request, context):
        rid = request.request_id
        self.given.append(context.time_remaining())  # the time its call was given
        yield engine_pb2.EngineResponse(request_id=rid, token_ids=[100])
        while context.time_remaining() > 0.02:
            await asyncio.sleep(min(0.005, max(context.time_remaining() - 0.02, 0)))
        msg = engine_pb2.EngineResponse(request_id=rid, token_ids=[101], finish_reason=C.FINISH_REASON_LENGTH)
        msg.usage.prompt_tokens = len(request.prompt_token_ids)
        msg.usage.completion_tokens = 2
        yield msg


def test_a_stream_whose_final_message_came_before_the_deadline_ends_ok(tokenizer, smollm2_dir):
    """Issue 19: the engine sends the final message just before its deadline; the client gets it
    and the OK trailers before its own deadline, never the finish reason followed by
    DEADLINE_EXCEEDED, because the engine's deadline comes a margin before the client's."""

    async def scenario():
        async with Stack(tokenizer, smollm2_dir, engine_cls=_FinalAtDeadlineEngine) as s:
            for _ in range(5):
                req = frontend_pb2.GenerateRequest(prompt="Hello")
                req.sampling.max_tokens = 2
                finish = []
                sent = time.monotonic()
                async for msg in s.stub.Stream(req, timeout=0.5):
                    finish += [c.finish_reason for c in msg.choices if c.finish_reason]
                    assert time.monotonic() - sent < 0.5
                assert finish == [C.FINISH_REASON_LENGTH]
            # The engine's deadline came a margin before the client's, every time.
            assert len(s.engine.given) == 5 and all(r < 0.5 - 0.045 for r in s.engine.given), s.engine.given

    run(scenario())


class _LeasingEngine(FakeEngine):
    """A producer stand-in: a request with do_remote_decode ends with a lease of its own after
    one token; with max_tokens 2 only the choice with seed 0 ends at once, the others after 30 s.
    Records the leases it made and every ABORT."""

    def __init__(self, model_path: str) -> None:
        super().__init__(model_path)
        self.aborts: list[str] = []
        self.leased: list[str] = []

    async def Stream(self, request, context):
        rid = request.request_id
        if request.sampling.max_tokens == 2 and request.sampling.seed != 0:
            await asyncio.sleep(30)
        msg = engine_pb2.EngineResponse(request_id=rid, token_ids=[100], finish_reason=C.FINISH_REASON_LENGTH)
        msg.usage.prompt_tokens = len(request.prompt_token_ids)
        msg.usage.completion_tokens = 1
        if request.kv_transfer_params.do_remote_decode:
            msg.kv_transfer_params.CopyFrom(C.KVTransferParams(do_remote_prefill=True, lease_id=f"lease-{rid}",
                                                               remote_host="127.0.0.1", remote_port=9))
            self.leased.append(rid)
        yield msg

    async def Utility(self, request, context):
        if request.command == C.UTILITY_COMMAND_ABORT:
            self.aborts.append(request.request_id)
            return C.UtilityResponse(command=request.command, result=to_struct({"aborted": request.request_id}))
        return await super().Utility(request, context)


def test_every_lease_of_an_n_choice_call_is_returned_or_released(tokenizer, smollm2_dir):
    """Issue 19 item 6: n > 1 with do_remote_decode makes one lease per choice. A trusted caller
    gets every choice's parameters on the final message (before: only the first); a call that
    ends before its final message releases the leases its finished choices made."""

    def request(n: int, max_tokens: int = 1) -> frontend_pb2.GenerateRequest:
        req = frontend_pb2.GenerateRequest(prompt="Hello", n=n)
        req.sampling.max_tokens = max_tokens
        req.sampling.seed = 0
        req.kv_transfer_params.do_remote_decode = True
        return req

    async def scenario():
        async with Stack(tokenizer, smollm2_dir, engine_cls=_LeasingEngine, trust_kv_callers=True) as s:
            for stream in (False, True):
                if stream:
                    final = [m async for m in s.stub.Stream(request(4), timeout=10)][-1]
                else:
                    final = await s.stub.Generate(request(4), timeout=10)
                leases = {c.index: c.kv_transfer_params.lease_id for c in final.choices if c.kv_transfer_params.lease_id}
                assert sorted(leases) == [0, 1, 2, 3] and len(set(leases.values())) == 4
                assert set(leases.values()) == {f"lease-{rid}" for rid in s.engine.leased[-4:]}
                assert final.kv_transfer_params.lease_id in leases.values()
            assert s.engine.aborts == []  # returned, so not released
            # Three choices, seeds 0, 1, 2: only the first ends; cancel the call meanwhile.
            s.engine.leased.clear()
            call = s.stub.Stream(request(3, max_tokens=2), timeout=10)
            first = await call.read()
            assert [c.finish_reason for c in first.choices] == [C.FINISH_REASON_LENGTH]
            call.cancel()
            deadline = time.monotonic() + 5
            while not s.engine.aborts:
                assert time.monotonic() < deadline, "the finished choice's lease was never released"
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)
            assert s.engine.aborts == s.engine.leased and len(s.engine.leased) == 1

    run(scenario())


# -- failure 8: exposed operations ------------------------------------------------------------------------
def test_state_changing_utility_commands_need_an_admin(tokenizer, smollm2_dir):
    """Failure 8: FLUSH_PREFIX_CACHE and profiling are PERMISSION_DENIED by default; an admin token
    or --allow-admin-commands opens them."""

    async def scenario():
        async with Stack(tokenizer, smollm2_dir) as s:
            for cmd in (C.UTILITY_COMMAND_FLUSH_PREFIX_CACHE, C.UTILITY_COMMAND_START_PROFILE,
                        C.UTILITY_COMMAND_STOP_PROFILE):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await s.utility(cmd)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, cmd
            assert s.engine.flushes == 0
            await s.utility(C.UTILITY_COMMAND_STATS)  # read-only commands stay open
        async with Stack(tokenizer, smollm2_dir, SecurityOptions(admin_tokens=("root-token",))) as s:
            with pytest.raises(grpc.aio.AioRpcError):
                await s.utility(C.UTILITY_COMMAND_FLUSH_PREFIX_CACHE, token="guess")
            await s.utility(C.UTILITY_COMMAND_FLUSH_PREFIX_CACHE, token="root-token")
            assert s.engine.flushes == 1
        async with Stack(tokenizer, smollm2_dir, SecurityOptions(allow_admin_commands=True)) as s:
            await s.utility(C.UTILITY_COMMAND_FLUSH_PREFIX_CACHE)
            assert s.engine.flushes == 1

    run(scenario())


def test_unauthenticated_health_reveals_nothing_but_status(tokenizer, smollm2_dir):
    """Failure 8: Utility HEALTH says SERVING/NOT_SERVING only (before: pid and engine addresses)."""

    async def scenario():
        async with Stack(tokenizer, smollm2_dir, SecurityOptions(admin_tokens=("root-token",))) as s:
            assert await s.utility(C.UTILITY_COMMAND_HEALTH) == {"status": "SERVING"}
            detailed = await s.utility(C.UTILITY_COMMAND_HEALTH, token="root-token")
            assert detailed["status"] == "SERVING" and "engines" in detailed

    run(scenario())


def test_with_auth_only_the_sender_may_abort(tokenizer, smollm2_dir):
    """Failure 8: with tokens on, another identity's ABORT is NOT_FOUND and changes nothing."""

    async def scenario():
        security = SecurityOptions(tokens=("alice-token", "bob-token"), admin_tokens=("root-token",))
        async with Stack(tokenizer, smollm2_dir, security, token_delay=0.05) as s:
            call = asyncio.ensure_future(s.generate("Hello", token="alice-token", request_id="alice-1",
                                                    sampling={"max_tokens": 40}))
            await s.wait_registered("alice-1")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await s.utility(C.UTILITY_COMMAND_ABORT, "alice-1", token="bob-token")
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            assert (await s.utility(C.UTILITY_COMMAND_ABORT, "alice-1", token="alice-token"))["choices"] == 1
            assert (await call).choices[0].finish_reason == C.FINISH_REASON_ABORT
            # An admin may abort anyone's request.
            call = asyncio.ensure_future(s.generate("Hello", token="alice-token", request_id="alice-2",
                                                    sampling={"max_tokens": 40}))
            await s.wait_registered("alice-2")
            assert (await s.utility(C.UTILITY_COMMAND_ABORT, "alice-2", token="root-token"))["choices"] == 1
            assert (await call).choices[0].finish_reason == C.FINISH_REASON_ABORT

    run(scenario())


def test_metrics_bind_like_the_service_by_default():
    """Failure 8: without --metrics-host the Prometheus endpoint binds the service's --host."""
    from tandem.cli import _metrics_options, build_parser
    from tandem.frontend.app import FrontendOptions

    args = build_parser().parse_args(["frontend", "--host", "127.0.0.1", "--metrics-port", "9100"])
    assert _metrics_options(args)["metrics_host"] == "127.0.0.1"
    args = build_parser().parse_args(["serve", "--host", "10.1.2.3", "--engine-metrics-port", "9101"])
    from tandem.cli import _engine_metrics_argv

    assert _engine_metrics_argv(args)[:2] == ["--metrics-host", "127.0.0.1"]  # the engine's own host
    assert FrontendOptions().metrics_host is None


# -- failure 9: one dead replica blocks readiness ----------------------------------------------------
def test_ready_with_one_replica_and_the_other_joins_later(smollm2_dir):
    """Failure 9: with one replica down the pool is ready as soon as the other is, and the late
    one joins the rotation once it answers (before: waited for every replica, then timed out)."""

    async def scenario():
        late_port = free_port()
        live = FakeEngine(str(smollm2_dir))
        live_server, live_addr = await start_engine(live)
        pool = EnginePool([f"127.0.0.1:{late_port}", live_addr])
        started = time.monotonic()
        await pool.wait_ready(timeout=5, poll=0.05)
        assert time.monotonic() - started < 3
        assert pool.any_healthy and pool.pick().address == live_addr
        late_server, late_addr = await start_engine(FakeEngine(str(smollm2_dir)), port=late_port)
        joined = time.monotonic()
        while not all(r.model_info is not None for r in pool.replicas):  # the monitor's rounds, run by hand
            assert time.monotonic() - joined < 10, "the late replica never joined"
            await pool.probe()
            await asyncio.sleep(0.1)
        assert {r.address for r in pool.replicas if r.healthy and r.model_info is not None} == {live_addr, late_addr}
        busy = pool.pick()
        busy.in_flight += 5
        assert pool.pick() is not busy  # the late replica takes traffic
        await pool.close()
        await live_server.stop(0)
        await late_server.stop(0)

    run(scenario())


class _EndedContext:
    """A servicer context after the client left: deadline passed (remaining 0) or cancelled."""

    def __init__(self, remaining, done) -> None:
        self._remaining, self._done = remaining, done

    def code(self):
        return None

    def time_remaining(self):
        return self._remaining

    def done(self):
        return self._done


def test_failing_to_end_an_ended_call_is_the_clients_outcome():
    """Failure 7: when ending a call fails because the client's deadline passed or it cancelled
    (grpc raises from abort), the outcome is DEADLINE_EXCEEDED / CANCELLED, not UNKNOWN; a handler
    failure on a live call is still UNKNOWN."""
    from tandem.request_scope import grpc_outcome

    class ExecuteBatchError(Exception):
        pass

    assert grpc_outcome(ExecuteBatchError, _EndedContext(remaining=0.0, done=True)) == "DEADLINE_EXCEEDED"
    assert grpc_outcome(ExecuteBatchError, _EndedContext(remaining=None, done=True)) == "CANCELLED"
    assert grpc_outcome(grpc.aio.AbortError, _EndedContext(remaining=0.0, done=True)) == "DEADLINE_EXCEEDED"
    assert grpc_outcome(ExecuteBatchError, _EndedContext(remaining=5.0, done=False)) == "UNKNOWN"
