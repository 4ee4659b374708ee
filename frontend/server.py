"""gRPC face of the frontend: `tandem.v1.Frontend` plus grpc.health.v1.

For each request: validate, register IDs, tokenize once, fan n choices out to one engine
replica as n engine streams (sharing the prompt's KV blocks there), detokenize and match stop
strings per choice, and end every engine stream when the client's call ends for any reason.
"""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import structlog

from tandem.frontend.choice_state import ChoiceState
from tandem.frontend.engine_pool import EnginePool, EngineReplica, NoEngineAvailable
from tandem.frontend.metrics import FrontendMetrics
from tandem.frontend.observe import RequestObservation
from tandem.frontend.request_builder import PreparedRequest, RequestBuilder
from tandem.frontend.request_ids import DuplicateRequestId, RequestIdMap
from tandem.grpc_service import reject_malformed
from tandem.protocol import InvalidRequest, to_struct
from tandem.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc

log = structlog.get_logger(__name__)

SERVICE_NAME = "tandem.v1.Frontend"


@dataclass
class ActiveRequest:
    """A client request in flight: where its choices run, so Utility ABORT can reach them."""

    external_id: str
    internal_ids: list[str]
    replica: EngineReplica | None = None
    observation: RequestObservation | None = None


class FrontendServicer(frontend_pb2_grpc.FrontendServicer):
    """Implements Generate / Stream / Utility on top of an `EnginePool`."""

    def __init__(self, pool: EnginePool, ids: RequestIdMap, metrics: FrontendMetrics | None = None) -> None:
        self.pool = pool
        self.metrics = metrics if metrics is not None else FrontendMetrics(pool)
        # Set by `attach` once the engines are ready and the tokenizer is loaded; until then
        # every request gets UNAVAILABLE (the handlers must be registered before the server starts).
        self.builder: RequestBuilder | None = None
        self.ids = ids
        self.active: dict[str, ActiveRequest] = {}
        self.accepting = True
        # Tokenizers are not safe for concurrent use: one worker thread serialises them while
        # keeping the event loop free.
        self._tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-tokenize")

    def attach(self, builder: RequestBuilder) -> None:
        self.builder = builder

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
        # A request that failed to parse has no ID; `_run` rejects it.
        return RequestObservation(context, method, self.metrics, getattr(request, "request_id", ""))

    async def Utility(self, request, context):
        await reject_malformed(request, context)
        C = common_pb2
        cmd = request.command
        if self.builder is None and cmd != C.UTILITY_COMMAND_HEALTH:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "frontend is starting")
        if cmd == C.UTILITY_COMMAND_HEALTH:
            ready = self.builder is not None and self.accepting and self.pool.any_healthy
            result = {
                "status": "SERVING" if ready else "NOT_SERVING",
                "pid": os.getpid(),  # which frontend worker answered
                "in_flight": len(self.ids),
                "engines": {r.address: r.healthy for r in self.pool.replicas},
            }
        elif cmd == C.UTILITY_COMMAND_MODEL_INFO:
            result = dict(self.pool.limits_info())
            result["tokenizer"] = self.builder.tokenizer_info()
            # What a request that sets no sampling field gets (the engine applies these).
            defaults = self.pool.replicas[0].model_info.get("sampling_defaults") if self.pool.replicas else None
            if defaults is not None:
                result["sampling_defaults"] = defaults
        elif cmd == C.UTILITY_COMMAND_ABORT:
            active = self.active.get(request.request_id)
            if not request.request_id:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: required for ABORT")
            if active is None or active.replica is None:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"request_id {request.request_id!r} is not in flight")
            aborted = []
            for internal_id in active.internal_ids:
                try:
                    await active.replica.utility(C.UTILITY_COMMAND_ABORT, internal_id)
                    aborted.append(internal_id)
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.NOT_FOUND:  # NOT_FOUND: that choice already ended
                        raise
            result = {"aborted": request.request_id, "choices": len(aborted)}
        elif cmd in (C.UTILITY_COMMAND_STATS, C.UTILITY_COMMAND_FLUSH_PREFIX_CACHE, C.UTILITY_COMMAND_SPEC_DECODE_STATS):
            per_engine = {}
            for r in self.pool.replicas:
                try:
                    per_engine[r.address] = await r.utility(cmd)
                except grpc.aio.AioRpcError as exc:
                    per_engine[r.address] = {"error": exc.code().name}
            result = {"engines": per_engine}
            if cmd == C.UTILITY_COMMAND_STATS:
                result["frontend"] = {"in_flight": len(self.ids), "in_flight_choices": self.ids.num_internal}
        elif cmd in (C.UTILITY_COMMAND_START_PROFILE, C.UTILITY_COMMAND_STOP_PROFILE):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "profiling is not enabled")
        else:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"command: unknown utility command {cmd}")
        return common_pb2.UtilityResponse(command=cmd, result=to_struct(result))

    # -- the request path ------------------------------------------------------------------------------
    async def _run(self, request, context, stream: bool, obs: RequestObservation):
        arrival = time.monotonic()
        await reject_malformed(request, context)
        if self.builder is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "frontend is starting")
        if not self.accepting:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "frontend is draining")
        try:
            self.builder.check_request(request)
            reg = self.ids.register(request.request_id or None, self.builder.num_choices(request))
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except DuplicateRequestId:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id {request.request_id!r} is in flight")
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request_id: {exc}")
        obs.registered(reg.external_id, reg.internal_ids)
        active = ActiveRequest(reg.external_id, reg.internal_ids, observation=obs)
        self.active[reg.external_id] = active
        try:
            loop = asyncio.get_running_loop()
            try:
                prepared: PreparedRequest = await loop.run_in_executor(
                    self._tokenize_pool, self.builder.prepare, request, reg.external_id, reg.internal_ids
                )
            except InvalidRequest as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            try:
                active.replica = self.pool.pick()
            except NoEngineAvailable as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            obs.note(engine=active.replica.address)
            async for msg in self._fan_out(prepared, active, context, stream, arrival):
                yield msg
        finally:
            self.active.pop(reg.external_id, None)
            self.ids.release(reg.external_id)

    async def _fan_out(self, prepared: PreparedRequest, active: ActiveRequest, context, stream: bool, arrival: float):
        replica = active.replica
        choices = [self.builder.choice_state(prepared, i) for i in range(len(prepared.engine_requests))]
        queue: asyncio.Queue = asyncio.Queue()
        deadline = context.time_remaining()
        obs = active.observation
        metadata = obs.engine_metadata()  # the client's trace continues on the engine hop
        calls = [replica.open_call(er, deadline, metadata, self.pool.multiplexed) for er in prepared.engine_requests]
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
        open_choices = set(range(len(calls)))
        first_token_time: float | None = None
        try:
            while open_choices:
                i, resp, error = await queue.get()
                if i not in open_choices:  # ended by a stop string; its cancelled call says goodbye
                    continue
                deltas = []
                if error is not None:
                    if error.code() == grpc.StatusCode.UNAVAILABLE:
                        self.pool.mark_failed(replica)
                    retry = [(k, v) for k, v in (error.trailing_metadata() or ()) if k == "retry-after"]
                    if retry:
                        context.set_trailing_metadata(tuple(retry))
                    await context.abort(error.code(), f"engine: {error.details()}")
                if resp is None:  # engine stream closed
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
                    if not open_choices:
                        self._fill_final(msg, prepared, choices, arrival, first_token_time)
                    if msg.choices or not open_choices:
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
                yield msg
        finally:
            replica.in_flight -= 1
            for call in calls:
                call.cancel()
            for p in pumps:
                p.cancel()

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
        if returned is not None:
            msg.kv_transfer_params.CopyFrom(returned)
        if prepared.return_prompt_token_ids:
            msg.prompt_token_ids.extend(prepared.prompt_token_ids)
