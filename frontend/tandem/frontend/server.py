"""gRPC face of the frontend: `tandem.v1.Frontend` plus grpc.health.v1.

For each request: validate, register IDs, tokenize once, fan n choices out to one engine
replica as n engine streams (sharing the prompt's KV blocks there), detokenize and match stop
strings per choice, and end every engine stream when the client's call ends for any reason.

Aborts (Utility ABORT) are recorded on the request from its registration: an abort that lands
while the prompt waits for the tokenizer, while its choices are being submitted or while they
run ends every choice with finish reason ABORT, and the answer counts the choices it ended.
A call whose client cancelled or whose deadline passed ends as CANCELLED or DEADLINE_EXCEEDED
even when an engine error races it.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import structlog
from opentelemetry import trace

from tandem.frontend import control_plane
from tandem.frontend.abort_relay import AbortRelay, relayed_caller
from tandem.frontend.choice_state import ChoiceState
from tandem.frontend.disaggregation import DisaggregatedPools, LegFailed, TwoLegCall, release_lease
from tandem.frontend.engine_pool import EnginePool, EngineReplica, NoEngineAvailable
from tandem.frontend.metrics import FrontendMetrics
from tandem.frontend.observe import RequestObservation
from tandem.frontend.request_builder import PreparedRequest, RequestBuilder
from tandem.frontend.request_ids import DuplicateRequestId, RequestIdMap
from tandem.frontend.tokenize_pool import TokenizePool, TokenizerBusy
from tandem.error_text import bounded, echo
from tandem.grpc_service import reject_malformed
from tandem.proto_wire import (
    InvalidRequest,
    check_prompt_token_ids,
    kv_params_steer,
    kv_transfer_from_metadata,
    kv_transfer_to_proto,
    public_kv_params,
    refuse_removed_legacy_kv_params,
    set_reply_kv_params,
    to_struct,
)
from tandem.security import AccessPolicy
from tandem.tracing import NO_TRACER
from tandem.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc

log = structlog.get_logger(__name__)

SERVICE_NAME = "tandem.v1.Frontend"
# Utility commands that change server state: they need an admin credential (see AccessPolicy).
ADMIN_COMMANDS = frozenset({
    common_pb2.UTILITY_COMMAND_FLUSH_PREFIX_CACHE,
    common_pb2.UTILITY_COMMAND_START_PROFILE,
    common_pb2.UTILITY_COMMAND_STOP_PROFILE,
})


@dataclass
class ActiveRequest:
    """A client request in flight, from registration to its end, so Utility ABORT can reach it.

    Invariant: once `aborted` is set it stays set, and the request path ends every choice not
    already ended with ABORT: before fan-out by never opening them, during fan-out through
    `end_choices` (installed by the fan-out, it returns how many choices it ends).
    """

    external_id: str
    internal_ids: list[str]
    replica: EngineReplica | None = None
    observation: RequestObservation | None = None
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    end_choices: Callable[[], int] | None = None

    def abort(self) -> int:
        """Marks the request aborted; returns the number of choices this abort ends."""
        if self.aborted.is_set():
            return 0
        self.aborted.set()
        if self.end_choices is not None:
            return self.end_choices()
        return len(self.internal_ids)  # none has started: all of them end here


def needs_no_tokenizer(request) -> bool:
    """True when preparing `request` calls no tokenizer: its prompt is token ids and it has no
    stop strings (whose token encodings would be computed). Such a request skips the pool."""
    return bool(request.prompt_token_ids) and not request.stop


# A choice's engine calls end this much before the client's deadline (at most a tenth of the time
# left): a final message an engine sends just before its own deadline still reaches the client
# with the OK trailers before the client's timer fires, instead of the client reading the finish
# reason and then DEADLINE_EXCEEDED. An engine call that runs out ends the client's call with
# DEADLINE_EXCEEDED and no final message, as before.
TRAILER_MARGIN_S = 0.05


def engine_timeout(remaining: float | None) -> float | None:
    """The timeout of a choice's engine calls when the client's call has `remaining` seconds."""
    if remaining is None:
        return None
    return max(remaining - min(TRAILER_MARGIN_S, remaining / 10), 0.0)


def _decode(tokenizer, token_ids: list[int], skip_special_tokens: bool) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


class _Aborted(Exception):
    """Internal: the fan-out queue's marker that Utility ABORT ended the request."""


class FrontendServicer(frontend_pb2_grpc.FrontendServicer):
    """Implements Generate / Stream / Utility on top of an `EnginePool`; with `disaggregated`
    pools, every choice runs as a prefill leg on `pool` (the prefill pool) and a decode leg on
    the decode pool (`tandem/frontend/disaggregation.py`)."""

    def __init__(self, pool: EnginePool, ids: RequestIdMap, metrics: FrontendMetrics | None = None,
                 access: AccessPolicy | None = None, disaggregated: DisaggregatedPools | None = None,
                 relay: AbortRelay | None = None, trust_kv_callers: bool = False,
                 worker_index: int = 0, num_workers: int = 1, tracer: trace.Tracer = NO_TRACER) -> None:
        self.pool = pool
        self.tracer = tracer  # records a span per Generate / Stream call (tandem.tracing)
        self.worker_index, self.num_workers = worker_index, num_workers  # GetServerInfo reports them
        # Callers may send and see KV transfer parameters beyond `extra` (a router on a private
        # network); off: such parameters are refused and replies carry `extra` only.
        self.trust_kv_callers = trust_kv_callers
        self.relay = relay  # the sibling workers on this port, for an ABORT of a request not here
        self.disaggregated = disaggregated
        self.metrics = metrics if metrics is not None else FrontendMetrics(pool)
        self.access = access if access is not None else AccessPolicy()
        # Set by `attach` once the engines are ready and the tokenizer is loaded; until then
        # every request gets UNAVAILABLE (the handlers must be registered before the server starts).
        self.builder: RequestBuilder | None = None
        self.tokenize_pool: TokenizePool | None = None
        self.ids = ids
        self.active: dict[str, ActiveRequest] = {}
        self.accepting = True

    def attach(self, builder: RequestBuilder, tokenize_pool: TokenizePool) -> None:
        """Starts serving with `builder`; prompts are tokenized on `tokenize_pool` (threads with
        clones of the builder's tokenizer, which itself stays with the event loop for detokenizing)."""
        self.tokenize_pool = tokenize_pool
        self.builder = builder

    def close(self) -> None:
        if self.tokenize_pool is not None:
            self.tokenize_pool.close()

    # -- RPCs ----------------------------------------------------------------------------------------
    async def Stream(self, request, context):
        with self._observe(request, context, "Stream") as obs:
            async for msg in self._run(request, context, stream=True, obs=obs):
                obs.tracker.on_response(msg)
                if msg.HasField("usage"):  # only the last message carries usage
                    obs.final_response_sent()
                yield msg

    async def Generate(self, request, context):
        final = None
        with self._observe(request, context, "Generate") as obs:
            async for msg in self._run(request, context, stream=False, obs=obs):
                obs.tracker.on_response(msg)
                final = msg
        return final

    def _observe(self, request, context, method: str) -> RequestObservation:
        # A request that failed to parse has no ID; `_run` rejects it. An HTTP request's context
        # names its own span (`POST /v1/chat/completions`); a gRPC call's span is the RPC's.
        span_name = getattr(context, "span_name", None)
        if span_name is None:
            span_name = f"{SERVICE_NAME}/{method}"
            attributes = {"rpc.system": "grpc", "rpc.service": SERVICE_NAME, "rpc.method": method}
        else:
            attributes = context.span_attributes
        return RequestObservation(context, method, self.metrics, getattr(request, "request_id", ""),
                                  tracer=self.tracer, span_name=span_name, span_attributes=attributes)

    async def Utility(self, request, context):
        await reject_malformed(request, context)
        C = common_pb2
        cmd = request.command
        if self.builder is None and cmd != C.UTILITY_COMMAND_HEALTH:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "frontend is starting")
        if cmd in ADMIN_COMMANDS and not self.access.is_admin(context):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"command: {C.UtilityCommand.Name(cmd)} changes server state and needs an admin "
                                "token (--admin-token-file) or a server started with --allow-admin-commands")
        if cmd == C.UTILITY_COMMAND_HEALTH:
            result = {"status": "SERVING" if self.ready() else "NOT_SERVING"}
            if self.access.is_admin(context):  # internals only for an administrator
                result.update(pid=os.getpid(), in_flight=len(self.ids),
                              engines={r.address: r.healthy for r in self._all_replicas()})
        elif cmd == C.UTILITY_COMMAND_ABORT:
            if not request.request_id:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: required for ABORT")
            relayed = relayed_caller(context)
            if relayed is not None:
                caller, admin = relayed.identity, relayed.admin
            else:
                caller, admin = self.access.caller_identity(context), self.access.is_admin(context)
            result = self._abort(request.request_id, caller, admin)
            if result is None and relayed is None and self.relay is not None:
                # Another frontend worker on this port may hold it (connections are spread over them).
                result = await self.relay.abort_elsewhere(request.request_id, caller, admin,
                                                          tuple(context.invocation_metadata()))
            if result is None:
                # Also the answer for another caller's request: its existence is not revealed.
                await context.abort(grpc.StatusCode.NOT_FOUND, f"request_id {echo(request.request_id)} is not in flight")
        elif cmd in (C.UTILITY_COMMAND_STATS, C.UTILITY_COMMAND_FLUSH_PREFIX_CACHE):
            per_engine = {}
            for r in self._all_replicas():
                try:
                    per_engine[r.address] = await r.utility(cmd)
                except grpc.aio.AioRpcError as exc:
                    per_engine[r.address] = {"error": exc.code().name}
            result = {"engines": per_engine}
            if cmd == C.UTILITY_COMMAND_STATS:
                result["frontend"] = {"in_flight": len(self.ids), "in_flight_choices": self.ids.num_internal,
                                      "pid": os.getpid(),
                                      "ready_engines": [r.address for r in self._all_replicas() if r.routable]}
        elif cmd in (C.UTILITY_COMMAND_START_PROFILE, C.UTILITY_COMMAND_STOP_PROFILE):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "profiling is not enabled")
        else:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"command: unknown utility command {cmd}")
        return common_pb2.UtilityResponse(command=cmd, result=to_struct(result))

    # -- the typed control plane -----------------------------------------------------------------------
    async def _require_builder(self, context) -> None:
        if self.builder is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "frontend is starting")

    def _replica_roles(self) -> list[tuple[EngineReplica, str]]:
        if self.disaggregated is None:
            return [(r, "unified") for r in self.pool.replicas]
        return ([(r, "prefill") for r in self.disaggregated.prefill.replicas]
                + [(r, "decode") for r in self.disaggregated.decode.replicas])

    async def GetModelInfo(self, request, context):
        await reject_malformed(request, context)
        await self._require_builder(context)
        pools = self.disaggregated if self.disaggregated is not None else self.pool
        try:
            limits, reporting = pools.limits_info(), self.pool.reporting_model_info()
        except NoEngineAvailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return control_plane.model_info(self.builder, limits, reporting)

    async def GetServerInfo(self, request, context):
        await reject_malformed(request, context)
        return frontend_pb2.GetServerInfoResponse(
            version=control_plane.version(), disaggregated=self.disaggregated is not None,
            engine_transport="mux" if self.pool.multiplexed else "stream",
            frontend_worker_index=self.worker_index, frontend_workers=self.num_workers,
            engines=[control_plane.replica_info(r, role) for r, role in self._replica_roles()],
            ready=self.ready())

    async def GetLoads(self, request, context):
        await reject_malformed(request, context)
        roles = self._replica_roles()

        async def load(replica: EngineReplica, role: str):
            try:
                return control_plane.replica_load(replica, role, await replica.utility(common_pb2.UTILITY_COMMAND_STATS))
            except grpc.aio.AioRpcError as exc:
                return control_plane.replica_load(replica, role, None, exc.code().name)

        loads = await asyncio.gather(*(load(r, role) for r, role in roles))
        return frontend_pb2.GetLoadsResponse(replicas=loads)

    async def Tokenize(self, request, context):
        await reject_malformed(request, context)
        await self._require_builder(context)
        prompt = frontend_pb2.GenerateRequest(model=request.model, prompt=request.prompt, messages=request.messages)
        if request.HasField("add_generation_prompt"):
            prompt.add_generation_prompt = request.add_generation_prompt
        try:
            ids = await self.tokenize_prompt(prompt)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode[exc.status], str(exc))
        except TokenizerBusy as exc:
            context.set_trailing_metadata((("retry-after", "1"),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{exc}; retry later")
        return frontend_pb2.TokenizeResponse(token_ids=ids, count=len(ids),
                                             max_context_length=self.builder.limits.max_model_len)

    async def Detokenize(self, request, context):
        await reject_malformed(request, context)
        await self._require_builder(context)
        try:
            ids = check_prompt_token_ids("token_ids", request.token_ids, self.builder.limits.vocab_size)
            text = await self.detokenize(ids, request.skip_special_tokens)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode[exc.status], str(exc))
        except TokenizerBusy as exc:
            context.set_trailing_metadata((("retry-after", "1"),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{exc}; retry later")
        return frontend_pb2.DetokenizeResponse(text=text)

    def ready(self) -> bool:
        """Serving: the tokenizer is loaded, the frontend is not draining and an engine is ready."""
        pools = self.disaggregated if self.disaggregated is not None else self.pool
        return self.builder is not None and self.accepting and pools.any_healthy

    async def tokenize_prompt(self, request: frontend_pb2.GenerateRequest) -> list[int]:
        """The token ids `request`'s prompt (text, messages or ids) becomes, checked as a
        generation's prompt is (`RequestBuilder.check_request`), with no generation. Raises
        `InvalidRequest` or `TokenizerBusy`; the caller has checked that `builder` is attached."""
        self.builder.check_request(request)
        if request.prompt_token_ids:
            return self.builder.prompt_token_ids(request)
        return await self.tokenize_pool.run(self._prompt_ids_with, request)

    def _prompt_ids_with(self, tokenizer, request) -> list[int]:
        return self.builder.prompt_token_ids(request, tokenizer)

    async def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        """The text of `token_ids` (range-checked by the caller), decoded on the tokenizer pool."""
        return await self.tokenize_pool.run(_decode, token_ids, skip_special_tokens)

    def _all_replicas(self) -> list[EngineReplica]:
        return self.disaggregated.all_replicas if self.disaggregated is not None else self.pool.replicas

    def _abort(self, request_id: str, caller: str | None, admin: bool) -> dict | None:
        """Utility ABORT in this worker: ends every choice of `caller`'s request at whatever stage
        it is (an admin's: anyone's); None when it is not in flight here or belongs to another caller."""
        active = self.active.get(request_id)
        if active is None:
            return None
        if self.ids.abort(active.external_id, caller, override=admin) is None:
            return None
        return {"aborted": active.external_id, "choices": active.abort()}

    # -- the request path ------------------------------------------------------------------------------
    async def _run(self, request, context, stream: bool, obs: RequestObservation):
        arrival = time.monotonic()
        await reject_malformed(request, context)
        if self.builder is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "frontend is starting")
        if not self.accepting:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "frontend is draining")
        try:
            refuse_removed_legacy_kv_params(request)
            header_kv = kv_transfer_from_metadata(context.invocation_metadata())
            if header_kv is not None:  # the header wins over the body's kv_transfer_params, whole
                request.kv_transfer_params.CopyFrom(kv_transfer_to_proto(header_kv))
            if (not self.trust_kv_callers and request.HasField("kv_transfer_params")
                    and kv_params_steer(request.kv_transfer_params)):
                await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                    "kv_transfer_params: only trusted callers may request or name KV transfers "
                                    "(start the frontend with --trust-kv-callers, for a router on a private network)")
            self.builder.check_request(request)
            reg = self.ids.register(request.request_id or None, self.builder.num_choices(request),
                                    owner=self.access.caller_identity(context))
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode[exc.status], str(exc))
        except DuplicateRequestId:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id {echo(request.request_id)} is in flight")
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request_id: {exc}")
        obs.registered(reg.external_id, reg.internal_ids)
        active = ActiveRequest(reg.external_id, reg.internal_ids, observation=obs)
        self.active[reg.external_id] = active
        try:
            prepared = await self._prepare_unless_aborted(request, reg, active, context)
            if prepared is None:  # aborted while waiting for the tokenizer
                yield self._aborted_reply(reg.external_id, len(reg.internal_ids), stream, arrival)
                return
            try:
                active.replica = self.pool.pick()
                if self.disaggregated is not None and not self.disaggregated.decode.any_healthy:
                    # Each decode leg picks its replica when it starts; none ready now: no prefill.
                    raise NoEngineAvailable("no decode engine replica is ready")
            except NoEngineAvailable as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            obs.note(engine=active.replica.address)
            async for msg in self._fan_out(prepared, active, context, stream, arrival):
                yield msg
        finally:
            self.active.pop(reg.external_id, None)
            self.ids.release(reg.external_id)

    async def _prepare_unless_aborted(self, request, reg, active: ActiveRequest, context) -> PreparedRequest | None:
        """Tokenizes on the pool; None as soon as an abort arrives (the tokenizer's result is dropped).
        A request that needs no tokenizer (`needs_no_tokenizer`) is prepared right here on the loop:
        the pool's two thread hand-offs cost more than its checks (bench/NOTES.md, TTFT per hop)."""
        if needs_no_tokenizer(request):
            try:
                # No await since registration: an abort cannot have landed yet.
                return self.builder.prepare(request, reg.external_id, reg.internal_ids)
            except InvalidRequest as exc:
                await context.abort(grpc.StatusCode[exc.status], str(exc))
        job = asyncio.ensure_future(self.tokenize_pool.run(self._prepare_with, request, reg.external_id,
                                                           reg.internal_ids))
        aborted = asyncio.ensure_future(active.aborted.wait())
        try:
            await asyncio.wait((job, aborted), return_when=asyncio.FIRST_COMPLETED)
        finally:
            aborted.cancel()
            if not job.done():
                job.cancel()
        if active.aborted.is_set():
            if job.done() and not job.cancelled():
                job.exception()  # retrieved: an invalid request that was aborted anyway is not an error
            return None
        try:
            return job.result()
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode[exc.status], str(exc))
        except TokenizerBusy as exc:
            context.set_trailing_metadata((("retry-after", "1"),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{exc}; retry later")

    def _prepare_with(self, tokenizer, request, external_id: str, internal_ids: list[str]) -> PreparedRequest:
        return self.builder.prepare(request, external_id, internal_ids, tokenizer=tokenizer)

    def _aborted_reply(self, external_id: str, n: int, stream: bool, arrival: float):
        """The reply of a request aborted before any choice reached an engine: n ABORT endings."""
        cls = frontend_pb2.GenerateStreamResponse if stream else frontend_pb2.GenerateResponse
        msg = cls(request_id=external_id)
        for i in range(n):
            msg.choices.add(index=i, finish_reason=common_pb2.FINISH_REASON_ABORT)
        msg.usage.SetInParent()
        msg.timings.latency = time.monotonic() - arrival
        msg.model = self.builder.served_model_name
        return msg

    async def _fan_out(self, prepared: PreparedRequest, active: ActiveRequest, context, stream: bool, arrival: float):
        replica = active.replica
        choices = [self.builder.choice_state(prepared, i) for i in range(len(prepared.engine_requests))]
        queue: asyncio.Queue = asyncio.Queue()
        deadline = engine_timeout(context.time_remaining())
        obs = active.observation
        metadata = obs.engine_metadata()  # the client's trace continues on the engine hop
        open_choices = set(range(len(prepared.engine_requests)))

        def end_choices() -> int:
            # Utility ABORT during fan-out: the loop below ends every open choice when it reads this.
            queue.put_nowait((None, None, _Aborted()))
            return len(open_choices)

        active.end_choices = end_choices
        if active.aborted.is_set():  # aborted between tokenizing and here: nothing reaches the engine
            end_choices()
            calls = []
        else:
            calls = [self._open_call(active, prepared, er, deadline, metadata) for er in prepared.engine_requests]
        replica.in_flight += 1

        async def pump(i: int) -> None:
            try:
                async for resp in calls[i]:
                    obs.tracker.on_engine_message(i, len(resp.token_ids))
                    await queue.put((i, resp, None))
                    if choices[i].finished:
                        break
            except grpc.aio.AioRpcError as exc:
                await queue.put((i, None, exc))
                return
            except asyncio.CancelledError:
                return
            await queue.put((i, None, None))

        pumps = [asyncio.ensure_future(pump(i)) for i in range(len(calls))]
        first_token_time: float | None = None
        leases_returned = False  # the final message carried every choice's lease to a trusted caller
        try:
            while open_choices:
                i, resp, error = await queue.get()
                deltas = []
                if isinstance(error, _Aborted):
                    for j in sorted(open_choices):
                        deltas.append(choices[j].abort_delta(common_pb2.FINISH_REASON_ABORT))
                        if j < len(calls):
                            calls[j].cancel()  # the engine frees the choice (stream cancel / mux abort)
                    open_choices.clear()
                elif i not in open_choices:  # ended by a stop string; its cancelled call says goodbye
                    continue
                elif error is not None:
                    await self._end_with_engine_error(context, error, replica)
                elif resp is None:  # engine stream closed
                    if not choices[i].finished:
                        deltas.append(choices[i].abort_delta(common_pb2.FINISH_REASON_ABORT))
                    open_choices.discard(i)
                else:
                    delta = choices[i].on_engine(resp)
                    if delta.token_ids and first_token_time is None:
                        first_token_time = time.monotonic()
                    deltas.append(delta)
                    if choices[i].finished:
                        open_choices.discard(i)
                        calls[i].cancel()  # a stop string may end a choice before the engine does
                # Coalesce whatever else is already queued into the same message.
                while not queue.empty() and open_choices:
                    j, r2, e2 = queue.get_nowait()
                    if isinstance(e2, _Aborted):
                        queue.put_nowait((j, r2, e2))
                        break
                    if j not in open_choices:
                        continue
                    if e2 is not None or r2 is None:
                        queue.put_nowait((j, r2, e2))
                        break
                    d2 = choices[j].on_engine(r2)
                    deltas.append(d2)
                    if choices[j].finished:
                        open_choices.discard(j)
                        calls[j].cancel()
                if stream:
                    msg = frontend_pb2.GenerateStreamResponse(request_id=prepared.external_id)
                    msg.choices.extend(d for d in deltas if d.text or d.token_ids or d.finish_reason or d.logprobs)
                    msg.prompt_logprobs.extend(choices[0].take_new_prompt_logprobs())
                    if not open_choices:
                        self._fill_final(msg, prepared, choices, arrival, first_token_time)
                        leases_returned = self.trust_kv_callers
                    if msg.choices or msg.prompt_logprobs or not open_choices:
                        yield msg
            if not stream:
                msg = frontend_pb2.GenerateResponse(request_id=prepared.external_id)
                for c in choices:
                    choice = msg.choices.add(index=c.index, text=c.text, finish_reason=c.finish_reason)
                    choice.token_ids.extend(c.token_ids)
                    if c.stop_str is not None:
                        choice.stop_str = c.stop_str
                    elif c.stop_token_id is not None:
                        choice.stop_token_id = c.stop_token_id
                self._fill_final(msg, prepared, choices, arrival, first_token_time)
                if prepared.want_logprobs:
                    self._attach_logprobs(msg, choices)
                msg.prompt_logprobs.extend(choices[0].prompt_logprobs)
                leases_returned = self.trust_kv_callers
                yield msg
        finally:
            active.end_choices = lambda: 0  # every choice has ended: a late ABORT ends none
            replica.in_flight -= 1
            for call in calls:
                call.cancel()
            for p in pumps:
                p.cancel()
            if not leases_returned and self.disaggregated is None:
                # Leases the caller will never see (the call ended early, or the caller may not
                # see them): released now, not left to expire holding blocks and slots. (With
                # disaggregated pools each TwoLegCall owns its choice's lease.)
                for c, er in zip(choices, prepared.engine_requests):
                    if c.kv_transfer_params is not None and c.kv_transfer_params.lease_id:
                        release_lease(replica, er.request_id, metadata)

    def _open_call(self, active: ActiveRequest, prepared: PreparedRequest, er, deadline, metadata):
        """One choice's engine call: a Stream / mux call on the request's replica, or (with
        disaggregated pools) a `TwoLegCall` over its prefill and decode replicas."""
        if self.disaggregated is None:
            return active.replica.open_call(er, deadline, metadata, self.pool.multiplexed)
        obs = active.observation
        # The choice's total max_tokens as the frontend resolved it while validating the request.
        return TwoLegCall(er, self.disaggregated, active.replica, None, prepared.sampling.max_tokens,
                          deadline, metadata, self.pool.multiplexed,
                          on_decode_replica=(lambda r: obs.note(decode_engine=r.address)) if obs is not None else None)

    async def _end_with_engine_error(self, context, error: grpc.aio.AioRpcError, replica: EngineReplica) -> None:
        """Ends the client's call with the engine's error, unless the client's own ending raced it:
        a passed deadline is DEADLINE_EXCEEDED and a call the client already left is CANCELLED,
        whatever the engine said (aborting a finished call would be metered as UNKNOWN). A
        disaggregated leg's error names the replica that answered (`LegFailed`)."""
        if error.code() == grpc.StatusCode.UNAVAILABLE:
            if isinstance(error, LegFailed):
                if error.replica is not None:
                    error.pool.mark_failed(error.replica)
            else:
                self.pool.mark_failed(replica)
        remaining = context.time_remaining()
        if (remaining is not None and remaining <= 0) or context.done():
            # The call is over for the client; `grpc_outcome` reads this as DEADLINE_EXCEEDED
            # (deadline passed) or CANCELLED. Aborting it instead would fail and count as UNKNOWN.
            raise asyncio.CancelledError()
        retry = [(k, v) for k, v in (error.trailing_metadata() or ()) if k == "retry-after"]
        if retry:
            context.set_trailing_metadata(tuple(retry))
        await context.abort(error.code(), bounded(f"engine: {error.details()}"))

    @staticmethod
    def _attach_logprobs(msg: frontend_pb2.GenerateResponse, choices: list[ChoiceState]) -> None:
        for choice, state in zip(msg.choices, choices):
            choice.logprobs.extend(state.logprobs)

    def _fill_final(self, msg, prepared: PreparedRequest, choices: list[ChoiceState], arrival: float, first_token_time):
        now = time.monotonic()
        completion = sum(len(c.token_ids) for c in choices)
        msg.usage.prompt_tokens = len(prepared.prompt_token_ids)
        msg.usage.completion_tokens = completion
        msg.usage.cached_prompt_tokens = sum(c.usage.cached_prompt_tokens for c in choices)
        msg.usage.total_tokens = msg.usage.prompt_tokens + completion
        msg.timings.latency = now - arrival
        if first_token_time is not None:
            msg.timings.ttft = first_token_time - arrival
            per_choice = max(len(c.token_ids) for c in choices)
            if per_choice > 1:
                msg.timings.tpot = (now - first_token_time) / (per_choice - 1)
        msg.model = self.builder.served_model_name
        returned = next((c.kv_transfer_params for c in choices if c.kv_transfer_params is not None), None)
        if returned is None:
            returned = prepared.kv_transfer_params
        if self.trust_kv_callers:
            # Each choice's own parameters (n > 1: one lease per choice), all on the final message.
            for c in choices:
                if c.kv_transfer_params is not None:
                    entry = next((d for d in msg.choices if d.index == c.index), None)
                    if entry is None:
                        entry = msg.choices.add(index=c.index)
                    entry.kv_transfer_params.CopyFrom(c.kv_transfer_params)
        if returned is not None and not self.trust_kv_callers:
            returned = public_kv_params(returned)  # no pull address, lease, secret or block ids
        if returned is not None:
            set_reply_kv_params(msg, returned)
        if prepared.return_prompt_token_ids:
            msg.prompt_token_ids.extend(prepared.prompt_token_ids)
