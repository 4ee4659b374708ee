"""Disaggregated prefill/decode: one choice run as two engine legs behind one engine-call face.

A frontend with a prefill pool and a decode pool (`--prefill-engine`, `--decode-engine`) sends
every choice as a `TwoLegCall`:

1. the prefill leg to a producer engine: the client's prompt, `do_remote_decode`, max_tokens 1.
   The producer prefills, samples the first token and keeps the prompt's KV blocks under a lease;
   its final response returns the filled `KVTransferParams` (lease, block ids, first token);
2. the first token goes to the client at once (TTFT is the prefill leg's);
3. the decode leg to a consumer engine: prompt + [first token], max_tokens - 1, the returned
   parameters with `do_remote_prefill`. The consumer pulls the blocks it lacks, releases the
   lease, decodes and streams.

`TwoLegCall` iterates `EngineResponse`s and has `cancel()`, like a per-request Stream call or a
`MuxCall`, so the request path (stop strings, n > 1, aborts, deadlines, coalescing) is the same
code as with one engine. Its invariants: the client sees the first token once, then the decode
leg's tokens, and exactly one final message (usage counts the prompt once and every completion
token); a lease the frontend got back and never handed to a decode leg is released (Utility
ABORT of the prefill request id on the producer) on every path: cancel, deadline, a decode leg
that could not start, a first token that ended the choice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

import grpc
import structlog

from tandem.frontend.engine_pool import EnginePool, EngineReplica, NoEngineAvailable, PoolLimits
from tandem.frontend.rpc_error import rpc_error
from tandem.v1 import common_pb2, engine_pb2

log = structlog.get_logger(__name__)

# The decode leg's internal request id: the choice's id with this suffix (a `--kv-role both`
# engine may be in both pools and see both legs of one choice).
DECODE_LEG_SUFFIX = "-decode"


# The reason a consumer names when the producer could not be reached or broke off mid-pull
# (`SchedulerReason.KV_PRODUCER_UNAVAILABLE`): the failed replica is the prefill one.
PRODUCER_UNAVAILABLE = "kv_producer_unavailable"

# Decode-leg statuses that mean the consumer never admitted the request (so never pulled).
REFUSED_BEFORE_START = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED,
})


class LegFailed(grpc.aio.AioRpcError):
    """An engine leg ended with an error status; names the replica (and its pool) that answered,
    so the caller marks the right one out of rotation on UNAVAILABLE (`replica` None: no replica
    of the pool was ready to take the leg)."""

    def __init__(self, error: grpc.aio.AioRpcError, leg: str, pool: EnginePool, replica: EngineReplica | None) -> None:
        where = f"{leg} leg on {replica.address}" if replica is not None else f"{leg} leg"
        super().__init__(error.code(), error.initial_metadata(), error.trailing_metadata(),
                         f"{where}: {error.details()}")
        self.leg = leg
        self.pool = pool
        self.replica = replica


class DisaggregatedPools:
    """The prefill pool and the decode pool of a frontend that runs every request in two legs.

    Invariant: both pools serve the same model (checked when they become ready); the frontend's
    limits are the stricter of the two.
    """

    def __init__(self, prefill: EnginePool, decode: EnginePool) -> None:
        self.prefill = prefill
        self.decode = decode

    @property
    def replicas(self) -> list[EngineReplica]:
        """Every replica of both pools once (an engine in both pools is listed once)."""
        return self.all_replicas

    @property
    def all_replicas(self) -> list[EngineReplica]:
        seen: dict[str, EngineReplica] = {}
        for r in self.prefill.replicas + self.decode.replicas:
            seen.setdefault(r.address, r)
        return list(seen.values())

    async def wait_ready(self, timeout: float) -> None:
        await asyncio.gather(self.prefill.wait_ready(timeout=timeout), self.decode.wait_ready(timeout=timeout))
        for pool, roles, flag in ((self.prefill, ("producer", "both"), "producer"),
                                  (self.decode, ("consumer", "both"), "consumer")):
            for r in pool.replicas:
                if r.model_info is None:
                    continue
                role = r.model_info.kv_transfer.role or "none"
                if role not in roles:
                    # It still serves its leg; the decode engine then computes the prompt itself.
                    log.warning("disaggregated_engine_without_kv_role", address=r.address, role=role,
                                needs=f"--kv-role {flag} (or both)")
        p, d = self.prefill.limits_info(), self.decode.limits_info()
        if p.model != d.model or p.vocab_size != d.vocab_size:
            raise RuntimeError(f"the prefill engines serve {p.model!r} (vocabulary {p.vocab_size}) but the "
                               f"decode engines serve {d.model!r} (vocabulary {d.vocab_size})")

    def limits_info(self) -> PoolLimits:
        p, d = self.prefill.limits_info(), self.decode.limits_info()
        return dataclasses.replace(p, max_model_len=min(p.max_model_len, d.max_model_len),
                                   kv_capacity_tokens=min(p.kv_capacity_tokens, d.kv_capacity_tokens))

    @property
    def any_healthy(self) -> bool:
        return self.prefill.any_healthy and self.decode.any_healthy

    def start_monitor(self) -> None:
        self.prefill.start_monitor()
        self.decode.start_monitor()

    def stopping(self) -> None:
        self.prefill.stopping()
        self.decode.stopping()

    async def close(self) -> None:
        await asyncio.gather(self.prefill.close(), self.decode.close())


def prefill_leg_request(request: engine_pb2.EngineRequest, keep_kv: bool) -> engine_pb2.EngineRequest:
    """The prefill leg of one choice: at most one new token; with `keep_kv` the producer keeps
    the prompt's KV under a lease for a decode leg (`do_remote_decode`)."""
    leg = engine_pb2.EngineRequest()
    leg.CopyFrom(request)
    leg.sampling.max_tokens = 1
    if leg.sampling.HasField("min_tokens"):
        leg.sampling.min_tokens = min(leg.sampling.min_tokens, 1)
    leg.ClearField("kv_transfer_params")
    if keep_kv:
        leg.kv_transfer_params.do_remote_decode = True
    return leg


def decode_leg_request(request: engine_pb2.EngineRequest, first_token: int, max_tokens: int,
                       returned: common_pb2.KVTransferParams | None) -> engine_pb2.EngineRequest:
    """The decode leg: the prompt followed by the first token, the tokens still to generate, and
    the producer's parameters turned into a pull (`do_remote_prefill`). A structured-output
    constraint goes along, told that the prompt's last token is already output under it.
    Without parameters (the prefill engine kept no KV) the decode engine computes the prompt
    itself."""
    leg = engine_pb2.EngineRequest()
    leg.CopyFrom(request)
    leg.request_id = request.request_id + DECODE_LEG_SUFFIX
    leg.prompt_token_ids.append(first_token)
    leg.sampling.max_tokens = max_tokens
    if leg.sampling.HasField("min_tokens"):
        leg.sampling.min_tokens = max(leg.sampling.min_tokens - 1, 0)
    leg.sampling.ClearField("prompt_logprobs")  # the prefill leg computed the prompt and reported them
    if leg.sampling.WhichOneof("structured_output") is not None:
        leg.num_constrained_prompt_tokens = 1  # the first token was generated under the constraint
    leg.ClearField("kv_transfer_params")
    if returned is not None and returned.lease_id:
        leg.kv_transfer_params.CopyFrom(returned)
        leg.kv_transfer_params.do_remote_decode = False
        leg.kv_transfer_params.do_remote_prefill = True
    return leg


def merge_final(prefill_final: engine_pb2.EngineResponse, decode_final: engine_pb2.EngineResponse,
                started: float) -> None:
    """Makes the decode leg's final message the choice's: usage counts the original prompt once
    and the first token plus the decode leg's tokens; TTFT and queue time are the prefill leg's."""
    usage = decode_final.usage
    completion = prefill_final.usage.completion_tokens + usage.completion_tokens
    usage.prompt_tokens = prefill_final.usage.prompt_tokens
    usage.completion_tokens = completion
    usage.cached_prompt_tokens = prefill_final.usage.cached_prompt_tokens
    usage.total_tokens = usage.prompt_tokens + completion
    decode_tpot = decode_final.timings.tpot
    decode_final.timings.CopyFrom(prefill_final.timings)
    decode_final.timings.latency = time.monotonic() - started
    decode_final.timings.tpot = decode_tpot


class TwoLegCall:
    """One choice as a prefill leg then a decode leg, iterated like one engine Stream call.

    `max_tokens` is the choice's resolved total (the client's, or the engine's default capped by
    the context); 1 sends a plain request to the prefill engine and no decode leg. `decode` None:
    the decode replica is picked from the decode pool when the decode leg starts (the least
    loaded ready one then, with the health known then).
    """

    def __init__(self, request: engine_pb2.EngineRequest, pools: DisaggregatedPools, prefill: EngineReplica,
                 decode: EngineReplica | None, max_tokens: int, timeout: float | None, metadata, multiplexed: bool,
                 on_decode_replica: Callable[[EngineReplica], None] | None = None) -> None:
        self.request = request
        self.on_decode_replica = on_decode_replica  # told which decode replica the leg went to (logs)
        self.pools = pools
        self.prefill = prefill
        self.decode = decode
        self.max_tokens = max_tokens
        self.metadata = metadata
        self.multiplexed = multiplexed
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.leg = None  # the engine call in progress
        self.stage = "new"  # new -> prefill -> between -> decode -> done
        self.cancelled = False
        # True while a lease may exist that only this call can release: from the start of a
        # prefill leg that keeps KV (until its final message says whether it kept one) until a
        # decode leg takes the lease over, and again if that leg is refused before it starts.
        self._lease_held = False

    def _remaining(self) -> float | None:
        if self.deadline is None:
            return None
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        return remaining

    def __aiter__(self):
        return self._responses()

    async def _responses(self):
        started = time.monotonic()
        two_legs = self.max_tokens > 1
        try:
            self.stage = "prefill"
            self._lease_held = two_legs
            prefill_final, tokens, logprobs, prompt_logprobs = await self._run_prefill(
                prefill_leg_request(self.request, two_legs))
            # The leg ended normally: its final message says whether the producer kept a lease.
            self._lease_held = two_legs and bool(prefill_final.kv_transfer_params.lease_id)
            ended = (prefill_final.finish_reason != common_pb2.FINISH_REASON_LENGTH or not two_legs
                     or len(tokens) != 1)
            if ended:  # the first token ended the choice (or the leg was aborted): no decode leg
                prefill_final.ClearField("kv_transfer_params")
                # Everything the leg sent, whether in one message or in several.
                del prefill_final.token_ids[:], prefill_final.logprobs[:], prefill_final.prompt_logprobs[:]
                prefill_final.token_ids.extend(tokens)
                prefill_final.logprobs.extend(logprobs)
                prefill_final.prompt_logprobs.extend(prompt_logprobs)
                self.stage = "done"
                yield prefill_final
                return
            self.stage = "between"
            first = engine_pb2.EngineResponse(request_id=self.request.request_id, token_ids=tokens)
            first.logprobs.extend(logprobs)
            first.prompt_logprobs.extend(prompt_logprobs)
            yield first  # the client has its first token before the decode leg starts
            if self.cancelled:
                return
            returned = prefill_final.kv_transfer_params if prefill_final.HasField("kv_transfer_params") else None
            leg = decode_leg_request(self.request, tokens[0], self.max_tokens - 1, returned)
            self.stage = "decode"
            async for resp in self._run_decode(leg):
                if resp.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                    merge_final(prefill_final, resp, started)
                    self.stage = "done"
                resp.request_id = self.request.request_id
                yield resp
        finally:
            if self._lease_held:
                self._release_lease()

    async def _run_prefill(self, leg: engine_pb2.EngineRequest):
        """Runs the prefill leg to its end; returns its final message, every token it made, their
        logprobs and the prompt's logprobs (when asked: the prefill leg computes the prompt)."""
        tokens: list[int] = []
        logprobs: list[common_pb2.Logprobs] = []
        prompt_logprobs: list[common_pb2.Logprobs] = []
        try:
            self.leg = self.prefill.open_call(leg, self._remaining(), self.metadata, self.multiplexed)
            async for resp in self.leg:
                tokens.extend(resp.token_ids)
                logprobs.extend(resp.logprobs)
                prompt_logprobs.extend(resp.prompt_logprobs)
                if resp.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                    return resp, tokens, logprobs, prompt_logprobs
        except grpc.aio.AioRpcError as exc:
            raise LegFailed(exc, "prefill", self.pools.prefill, self.prefill) from None
        # The stream closed without a final message (cancelled underneath us).
        return engine_pb2.EngineResponse(request_id=leg.request_id, finish_reason=common_pb2.FINISH_REASON_ABORT), \
            tokens, logprobs, prompt_logprobs

    async def _run_decode(self, leg: engine_pb2.EngineRequest):
        if self.decode is None:
            try:
                self.decode = self.pools.decode.pick()
            except NoEngineAvailable as exc:  # the lease stays ours: released on the way out
                raise LegFailed(rpc_error(grpc.StatusCode.UNAVAILABLE, str(exc)), "decode", self.pools.decode,
                                None) from None
        if self.on_decode_replica is not None:
            self.on_decode_replica(self.decode)
        self.decode.in_flight += 1
        received = False
        try:
            self.leg = self.decode.open_call(leg, self._remaining(), self.metadata, self.multiplexed)
            # From here the consumer owns the lease: it releases it after its pull (or failure).
            self._lease_held = False
            async for resp in self.leg:
                received = True
                yield resp
        except grpc.aio.AioRpcError as exc:
            if not received and exc.code() in REFUSED_BEFORE_START:
                # The consumer never started the request (gone, or refused it at admission): no
                # pull can be reading the producer's blocks, so releasing the lease races nothing.
                # (After any other ending the consumer released it, or will, itself.)
                self._lease_held = True
            if exc.code() == grpc.StatusCode.UNAVAILABLE and PRODUCER_UNAVAILABLE in (exc.details() or ""):
                # The decode engine is fine; the producer it pulled from is not (retryable).
                raise LegFailed(exc, "decode", self.pools.prefill, self.prefill) from None
            raise LegFailed(exc, "decode", self.pools.decode, self.decode) from None
        finally:
            self.decode.in_flight -= 1

    def cancel(self) -> None:
        """Ends the choice early: cancels whichever leg is live (the engine aborts it; a consumer
        aborted mid-pull releases the lease itself) and releases a lease no decode leg holds."""
        if self.cancelled:
            return
        self.cancelled = True
        if self.leg is not None:
            self.leg.cancel()
        if self._lease_held:
            self._release_lease()

    def _release_lease(self) -> None:
        """Utility ABORT of the prefill request id on the producer frees the leased blocks."""
        self._lease_held = False
        release_lease(self.prefill, self.request.request_id, self.metadata)


def release_lease(replica: EngineReplica, request_id: str, metadata) -> None:
    """Frees, in the background, the lease a finished prefill request `request_id` holds on
    `replica` (Utility ABORT of that id; a no-op there when it holds none)."""
    asyncio.ensure_future(_abort_on(replica, request_id, metadata))


async def _abort_on(replica: EngineReplica, request_id: str, metadata) -> None:
    try:
        await replica.stub.Utility(
            common_pb2.UtilityRequest(command=common_pb2.UTILITY_COMMAND_ABORT, request_id=request_id),
            timeout=10.0, metadata=metadata)
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.NOT_FOUND:  # NOT_FOUND: the lease had already ended
            log.warning("lease_release_failed", request_id=request_id, engine=replica.address, code=exc.code().name)
