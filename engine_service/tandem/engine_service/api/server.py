"""gRPC face of one engine replica: `tandem.v1.Engine` plus grpc.health.v1.

Translates wire messages into engine calls and back; owns no engine state itself. Every
accepted request ends exactly once: a final message (Stream), a response (Generate) or an
error status; a client that goes away aborts its request so its KV blocks return to the pool.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import structlog

from tandem.core_protocol import (
    EngineStats,
    FinishReason,
    FlushResult,
    RequestOutput,
    SchedulerReason,
    SchedulerStop,
    StopSequence,
    StopToken,
    TokenLogprobs,
    UtilityCommand,
)
from tandem.engine_service.api.core_client import (
    CoreClient,
    DuplicateRequestError,
    EngineUnavailableError,
    QueueFullError,
    UnknownChannelError,
)
from tandem.engine_service.api.request_spans import RequestSpans
from tandem.error_text import bounded, echo
from tandem.security import AccessPolicy
from tandem.request_scope import RequestScope, log_request_end
from tandem.tracing import caller_log_fields, parent_context
from tandem.grpc_service import reject_malformed
from tandem.proto_wire import (
    FINISH_TO_PROTO,
    InvalidRequest,
    Limits,
    check_prompt_token_ids,
    kv_transfer_params_of,
    kv_transfer_to_proto,
    sampling_from_proto,
    with_constrained_prompt_tokens,
    to_struct,
)
from tandem.v1 import common_pb2, engine_pb2, engine_pb2_grpc

log = structlog.get_logger(__name__)

SERVICE_NAME = "tandem.v1.Engine"


class EngineServicer(engine_pb2_grpc.EngineServicer):
    """Implements Generate / Stream / Utility over a `CoreClient`: translates protobuf into typed
    core messages and the core's per-step outputs back into protobuf."""

    def __init__(self, access: AccessPolicy | None = None, spans: RequestSpans | None = None) -> None:
        # Who calls (token digest / certificate name): a producer caps leases per caller.
        self.access = access if access is not None else AccessPolicy()
        # Tracing on: each admitted request's spans, under the trace context its call carried.
        self.spans = spans
        # Registered before the server starts (gRPC needs its handlers then); attached to the
        # engine once the model is loaded. Until then every call gets UNAVAILABLE.
        self.engine: CoreClient | None = None
        self.limits: Limits | None = None
        self.model_info: engine_pb2.EngineModelInfo | None = None
        # Multiplexed requests in flight: request_id -> (its EngineRequest, first message pending).
        self._mux_requests: dict[str, tuple[engine_pb2.EngineRequest, bool]] = {}
        # Their `request_end` lines, begun at admission: request_id -> (Submit's time, the line's
        # fields so far). A mux request has no call of its own to log its end (see _log_mux_end).
        self._mux_ends: dict[str, tuple[float, dict]] = {}

    def attach(self, engine: CoreClient, limits: Limits, model_info: engine_pb2.EngineModelInfo) -> None:
        self.engine = engine
        self.limits = limits
        self.model_info = model_info

    async def _require_engine(self, context) -> CoreClient:
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is loading its model")
        return self.engine

    # -- request admission -------------------------------------------------------------------------
    def _admit(self, request: engine_pb2.EngineRequest, channel: str | None = None, metadata=(),
               time_remaining: float | None = None, caller: str | None = None):
        if not request.request_id:
            raise InvalidRequest("request_id", "must not be empty")
        if len(request.request_id) > 512:
            raise InvalidRequest("request_id", "at most 512 characters")
        prompt = check_prompt_token_ids("prompt_token_ids", request.prompt_token_ids, self.limits.vocab_size)
        params = sampling_from_proto(
            request.sampling,
            self.limits,
            len(prompt),
            [list(s.token_ids) for s in request.stop_token_sequences],
        )
        if request.num_constrained_prompt_tokens:
            params = with_constrained_prompt_tokens(params, request.num_constrained_prompt_tokens, len(prompt))
        kv_params = kv_transfer_params_of(request, metadata)
        if params.prompt_logprobs is not None and kv_params is not None and kv_params.do_remote_prefill:
            raise InvalidRequest("sampling.prompt_logprobs", "a decode leg (do_remote_prefill) pulls the prompt's KV "
                                                             "and computes no prompt position: ask the prefill leg")
        # The call's deadline travels into the core, which enforces it whatever the transport
        # (a multiplexed request's Submit call ends long before the request does).
        deadline = None if time_remaining is None else time.monotonic() + time_remaining
        return self.engine.submit(request.request_id, prompt, params, channel=channel, kv_transfer_params=kv_params,
                                  deadline=deadline, caller=caller)

    async def _start(self, request, context, method: str, channel: str | None = None):
        await reject_malformed(request, context)
        await self._require_engine(context)
        try:
            stream = self._admit(request, channel, context.invocation_metadata(), context.time_remaining(),
                                 self.access.caller_identity(context))
            if self.spans is not None:
                self.spans.begin(request.request_id, parent_context(context.invocation_metadata()), method)
            return stream
        except UnknownChannelError:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"channel_id {echo(channel)} is not subscribed")
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except DuplicateRequestError:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id {echo(request.request_id)} is in flight")
        except EngineUnavailableError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except QueueFullError as exc:
            # A retry hint for clients and load balancers (seconds, like HTTP Retry-After).
            context.set_trailing_metadata((("retry-after", "1"),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{exc}; retry later")

    # -- RPCs ----------------------------------------------------------------------------------------
    async def Stream(self, request, context):
        with _request_scope(request, context, "Stream") as scope:
            async for msg in self._stream(request, context):
                if msg.finish_reason:
                    _note_end(scope, msg)
                    scope.final_response_sent()
                yield msg

    async def Generate(self, request, context):
        with _request_scope(request, context, "Generate") as scope:
            msg = await self._generate(request, context)
            _note_end(scope, msg)
            return msg

    async def _stream(self, request, context):
        stream = await self._start(request, context, "Stream")
        first = True
        try:
            while True:
                batch = await stream.next_batch()
                msg = self._response(request, batch, first)
                first = False
                last = batch[-1]
                if last.finished and last.finish_reason == FinishReason.ERROR:
                    await context.abort(error_status(last), bounded(last.error or "engine error"))
                yield msg
                if last.finished:
                    return
        finally:
            self.engine.release(request.request_id)

    async def _generate(self, request, context):
        stream = await self._start(request, context, "Generate")
        collected: list[RequestOutput] = []
        try:
            while not (collected and collected[-1].finished):
                collected.extend(await stream.next_batch())
        finally:
            self.engine.release(request.request_id)
        last = collected[-1]
        if last.finish_reason == FinishReason.ERROR:
            await context.abort(error_status(last), bounded(last.error or "engine error"))
        return self._response(request, collected, True)

    # -- multiplexed transport ----------------------------------------------------------------------------
    async def Subscribe(self, request, context):
        """One stream per frontend connection: every step's deltas for all its requests."""
        await reject_malformed(request, context)
        engine = await self._require_engine(context)
        if not request.channel_id or len(request.channel_id) > 256:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "channel_id: 1..256 characters required")
        try:
            channel = engine.open_channel(request.channel_id)
        except DuplicateRequestError:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"channel_id {echo(request.channel_id)} is in use")
        try:
            yield engine_pb2.EngineBatch()  # acknowledgement: Submit may name this channel now
            while True:
                outputs = await channel.next_batch()
                batch = engine_pb2.EngineBatch()
                by_request: dict[str, list[RequestOutput]] = {}
                for o in outputs:
                    by_request.setdefault(o.request_id, []).append(o)
                for request_id, items in by_request.items():
                    submitted, first = self._mux_requests.get(request_id, (None, False))
                    if submitted is None:
                        continue
                    msg = self._response(submitted, items, first)
                    if items[-1].finished:
                        code = "OK"
                        if items[-1].finish_reason == FinishReason.ERROR:
                            status = error_status(items[-1])
                            msg.error = bounded(items[-1].error or "engine error")
                            msg.error_code = status.value[0]
                            code = status.name
                        elif items[-1].finish_reason == FinishReason.ABORT:
                            code = "CANCELLED"
                        del self._mux_requests[request_id]
                        self._log_mux_end(request_id, code, _end_fields(msg))
                    else:
                        self._mux_requests[request_id] = (submitted, False)
                    batch.responses.append(msg)
                if batch.responses:
                    yield batch
        finally:
            # Every request submitted on this channel, including those that finished in the engine
            # but whose last output was not delivered here: their IDs must be free again.
            for request_id in [rid for rid, (sub, _) in self._mux_requests.items()
                               if sub.channel_id == request.channel_id]:
                del self._mux_requests[request_id]
                self._log_mux_end(request_id, "CANCELLED", {})
            engine.close_channel(request.channel_id)

    async def Submit(self, request, context):
        """Admits a request whose deltas go to the Subscribe stream named by channel_id."""
        await reject_malformed(request, context)
        if not request.channel_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "channel_id: required for Submit")
        if request.request_id in self._mux_requests:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id {echo(request.request_id)} is in flight")
        # Registered before admission so the first step's output always finds its request.
        self._mux_requests[request.request_id] = (request, True)
        try:
            await self._start(request, context, "Submit", channel=request.channel_id)
        except BaseException:
            if self._mux_requests.get(request.request_id, (None,))[0] is request:
                del self._mux_requests[request.request_id]
            raise
        self._mux_ends[request.request_id] = (time.monotonic(), {
            "service": "engine", **caller_log_fields(parent_context(context.invocation_metadata())),
            "request_id": request.request_id})
        return engine_pb2.SubmitResponse(request_id=request.request_id)

    def _log_mux_end(self, request_id: str, code: str, fields: dict) -> None:
        """The one `request_end` line of a multiplexed request, as a Stream call's would be
        (method Submit): when its last output is delivered, or when its subscription closed
        first (CANCELLED: the engine aborts it)."""
        begun = self._mux_ends.pop(request_id, None)
        if begun is not None:
            start, line = begun
            log_request_end({**line, "method": "Submit", "code": code,
                             "latency_s": round(time.monotonic() - start, 6), **fields})

    async def Utility(self, request, context):
        await reject_malformed(request, context)
        cmd = request.command
        C = common_pb2
        if cmd == C.UTILITY_COMMAND_HEALTH and self.engine is None:
            return common_pb2.UtilityResponse(command=cmd, result=to_struct({"status": "NOT_SERVING", "loading": True}))
        await self._require_engine(context)
        if cmd == C.UTILITY_COMMAND_HEALTH:
            ok = self.engine.alive and self.engine.accepting
            result = {"status": "SERVING" if ok else "NOT_SERVING", "in_flight": self.engine.num_in_flight}
        elif cmd == C.UTILITY_COMMAND_ABORT:
            if not request.request_id:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: required for ABORT")
            if self.engine.abort(request.request_id):
                result = {"aborted": request.request_id}
            elif self.model_info.kv_transfer.role in ("producer", "both"):
                # A finished prefill leg may still hold its blocks under a lease: the abort
                # releases it (the frontend's way to free a lease no decode leg will take).
                self.engine.release_lease(request.request_id)
                result = {"aborted": request.request_id, "lease_release_requested": True}
            else:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"request_id {echo(request.request_id)} is not in flight")
        elif cmd == C.UTILITY_COMMAND_STATS:
            stats: EngineStats = await self._core_utility(UtilityCommand.STATS, context)
            result = stats.to_dict()
            result["in_flight"] = self.engine.num_in_flight
        elif cmd == C.UTILITY_COMMAND_FLUSH_PREFIX_CACHE:
            flush: FlushResult = await self._core_utility(UtilityCommand.FLUSH_PREFIX_CACHE, context)
            result = {"flushed": flush.flushed}
        elif cmd in (C.UTILITY_COMMAND_START_PROFILE, C.UTILITY_COMMAND_STOP_PROFILE):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "profiling is not enabled on this engine")
        else:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"command: unknown utility command {cmd}")
        return common_pb2.UtilityResponse(command=cmd, result=to_struct(result))

    async def _core_utility(self, command: UtilityCommand, context):
        try:
            return await self.engine.utility(command)
        except EngineUnavailableError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    async def GetModelInfo(self, request, context):
        await reject_malformed(request, context)
        await self._require_engine(context)
        return self.model_info

    # -- responses -----------------------------------------------------------------------------------
    def _response(self, request, outputs: list[RequestOutput], first: bool) -> engine_pb2.EngineResponse:
        """Merges step outputs into one message. The first message of a stream carries partial
        usage (prompt and cached prompt tokens) so a consumer that stops early still knows it."""
        msg = engine_pb2.EngineResponse(request_id=request.request_id)
        for o in outputs:
            msg.token_ids.extend(o.new_token_ids)
            for lp in o.new_logprobs:
                if lp is not None:
                    _add_logprobs(msg.logprobs, lp)
            for lp in o.new_prompt_logprobs:
                _add_logprobs(msg.prompt_logprobs, lp)
        last = outputs[-1]
        if first and not last.finished:
            msg.usage.prompt_tokens = last.num_prompt_tokens
            msg.usage.cached_prompt_tokens = last.num_cached_prompt_tokens
            msg.usage.total_tokens = last.num_prompt_tokens
        if last.finished:
            msg.finish_reason = FINISH_TO_PROTO[last.finish_reason]
            if isinstance(last.stop_reason, StopToken) and last.finish_reason == FinishReason.STOP:
                msg.stop_token_id = last.stop_reason.token_id
            elif isinstance(last.stop_reason, StopSequence):
                msg.stop_sequence_index = last.stop_reason.index
            msg.usage.CopyFrom(
                common_pb2.Usage(
                    prompt_tokens=last.num_prompt_tokens,
                    completion_tokens=last.num_output_tokens,
                    cached_prompt_tokens=last.num_cached_prompt_tokens,
                    total_tokens=last.num_prompt_tokens + last.num_output_tokens,
                )
            )
            msg.timings.CopyFrom(_timings(last))
            if last.kv_transfer_params is not None:  # the core's copy, not the request's
                msg.kv_transfer_params.CopyFrom(kv_transfer_to_proto(last.kv_transfer_params))
        return msg


def _add_logprobs(field, lp: TokenLogprobs) -> None:
    """Appends `lp` to the repeated Logprobs `field` (token ids only: the frontend adds text)."""
    entry = field.add(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank)
    for tid, val in lp.top:
        entry.top.add(token_id=tid, logprob=val)


# The status of a request the scheduler ended with ERROR, by its reason: what the client should do
# (fix what it sent, retry); a reason not listed is an engine fault (INTERNAL).
ERROR_STATUS = {
    SchedulerReason.KV_TRANSFER_REFUSED: grpc.StatusCode.INVALID_ARGUMENT,
    SchedulerReason.KV_PRODUCER_UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    SchedulerReason.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    SchedulerReason.KV_LEASES_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    SchedulerReason.INVALID_STRUCTURED_OUTPUT: grpc.StatusCode.INVALID_ARGUMENT,
}


def error_status(output: RequestOutput) -> grpc.StatusCode:
    """The gRPC status of a request that finished with ERROR (see ERROR_STATUS)."""
    stop = output.stop_reason
    if isinstance(stop, SchedulerStop):
        return ERROR_STATUS.get(stop.reason, grpc.StatusCode.INTERNAL)
    return grpc.StatusCode.INTERNAL


def _request_scope(request, context, method: str) -> RequestScope:
    # A request that failed to parse (MalformedRequest) has no ID; the call is rejected later.
    return RequestScope.for_call(context, "engine", method, request_id=getattr(request, "request_id", ""))


def _note_end(scope: RequestScope, msg: engine_pb2.EngineResponse) -> None:
    """Puts a finished request's outcome on its ending log line."""
    scope.note(**_end_fields(msg))


def _end_fields(msg: engine_pb2.EngineResponse) -> dict:
    """A finished request's outcome, as its ending log line names it."""
    return dict(
        finish_reason=common_pb2.FinishReason.Name(msg.finish_reason).removeprefix("FINISH_REASON_").lower(),
        prompt_tokens=msg.usage.prompt_tokens,
        completion_tokens=msg.usage.completion_tokens,
        cached_prompt_tokens=msg.usage.cached_prompt_tokens,
        ttft_s=round(msg.timings.ttft, 6),
        queue_s=round(msg.timings.queue, 6),
    )


def _timings(o: RequestOutput) -> common_pb2.Timings:
    now = time.monotonic()
    t = common_pb2.Timings()
    if not o.arrival_time:
        return t
    t.latency = now - o.arrival_time
    if o.first_scheduled_time is not None:
        t.queue = o.first_scheduled_time - o.arrival_time
    if o.first_token_time is not None:
        t.ttft = o.first_token_time - o.arrival_time
        if o.num_output_tokens > 1:
            t.tpot = (now - o.first_token_time) / (o.num_output_tokens - 1)
    return t
