"""The multiplexed engine transport: one Subscribe stream per engine replica carries every step's
deltas for all of this frontend's requests; requests are admitted with Submit and ended with
Utility ABORT.

Per-request engine streams cost one HTTP/2 message per token per request on the engine's side;
at high concurrency that work competes with the engine loop for the engine process's GIL. Here
the engine sends one message per step per frontend, and the frontend fans it out.

`MuxCall` behaves like the per-request `Stream` call it replaces (async iteration over
`EngineResponse`, `cancel()`), so the request path does not care which transport it uses.
"""

from __future__ import annotations

import asyncio
import contextvars
import uuid

import grpc
import structlog

from tandem.frontend.rpc_error import rpc_error
from tandem.v1 import common_pb2, engine_pb2

log = structlog.get_logger(__name__)


# EngineResponse.error_code (a status code's number) back to the status; 0 (unset) is INTERNAL.
_STATUS_BY_CODE = {code.value[0]: code for code in grpc.StatusCode if code != grpc.StatusCode.OK}


class MuxChannel:
    """One subscription to one engine replica, routing its batches to per-request queues."""

    def __init__(self, stub, replica_address: str) -> None:
        self.stub = stub
        self.address = replica_address
        self.channel_id = f"mux-{uuid.uuid4().hex}"
        self.queues: dict[str, asyncio.Queue] = {}
        self._call = None
        self._task: asyncio.Task | None = None
        self._opening: asyncio.Lock = asyncio.Lock()
        self.open = False
        self._closing = False  # close() ends the subscription: not a loss worth a warning
        self._stopping = False  # the frontend drains: its engines may stop first (serve stops all)

    async def ensure_open(self, timeout: float = 10.0) -> None:
        """Subscribes (once; again after a failure) and waits for the engine's acknowledgement."""
        if self.open:
            return
        async with self._opening:
            if self.open:
                return
            self.channel_id = f"mux-{uuid.uuid4().hex}"
            self._call = self.stub.Subscribe(engine_pb2.SubscribeRequest(channel_id=self.channel_id))
            await asyncio.wait_for(self._call.read(), timeout)  # the empty acknowledgement batch
            self.open = True
            # A fresh context: the pump outlives the request that opened it, and must not log
            # under that request's id (the logging context is a contextvar).
            self._task = asyncio.get_running_loop().create_task(self._pump(self._call), context=contextvars.Context())

    async def _pump(self, call) -> None:
        error: grpc.aio.AioRpcError | None = None
        try:
            # read() rather than async iteration: the acknowledgement was already read() and
            # grpc.aio does not allow mixing the two on one call.
            while (batch := await call.read()) is not grpc.aio.EOF:
                for resp in batch.responses:
                    queue = self.queues.get(resp.request_id)
                    if queue is not None:
                        queue.put_nowait(resp)
        except grpc.aio.AioRpcError as exc:
            error = exc
        except asyncio.CancelledError:
            error = rpc_error(grpc.StatusCode.UNAVAILABLE, "frontend closed the engine subscription")
        finally:
            self.open = False
            failure = error or rpc_error(grpc.StatusCode.UNAVAILABLE, "engine subscription ended")
            if self._stopping and not self._closing:
                # Requests still on it end with `failure`, and report that themselves.
                log.info("engine_subscription_ended_while_stopping", address=self.address,
                         in_flight=len(self.queues))
            elif not self._closing and (error is None or error.code() != grpc.StatusCode.CANCELLED):
                log.warning("engine_subscription_lost", address=self.address, code=failure.code().name)
            for queue in self.queues.values():
                queue.put_nowait(failure)

    def call(self, request: engine_pb2.EngineRequest, timeout: float | None, metadata) -> "MuxCall":
        return MuxCall(self, request, timeout, metadata)

    def stopping(self) -> None:
        """The frontend started to drain: the subscription ending is expected from now on."""
        self._stopping = True

    async def close(self) -> None:
        self._closing = True
        if self._task is not None:
            self._task.cancel()
        if self._call is not None:
            self._call.cancel()


class MuxCall:
    """One engine request on a `MuxChannel`, iterated like a per-request Stream call."""

    def __init__(self, channel: MuxChannel, request: engine_pb2.EngineRequest, timeout: float | None, metadata):
        self.channel = channel
        self.request = engine_pb2.EngineRequest()
        self.request.CopyFrom(request)
        self.timeout = timeout
        self.metadata = metadata
        self.queue: asyncio.Queue = asyncio.Queue()
        self.submitted = False
        self.ended = False
        # The client's deadline covers the whole request, as it does for a per-request Stream
        # call: Submit gets what is left of it, and so does every wait for the engine's output.
        self.deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout

    def _remaining(self) -> float | None:
        if self.deadline is None:
            return None
        return self.deadline - asyncio.get_running_loop().time()

    async def _next(self):
        remaining = self._remaining()
        try:
            if remaining is None:
                return await self.queue.get()
            if remaining <= 0:
                raise asyncio.TimeoutError
            return await asyncio.wait_for(self.queue.get(), remaining)
        except asyncio.TimeoutError:
            self.cancel()  # the engine aborts the request: nothing runs on past the deadline
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None

    async def _responses(self):
        rid = self.request.request_id
        await self.channel.ensure_open()
        self.request.channel_id = self.channel.channel_id
        self.channel.queues[rid] = self.queue
        try:
            # Shielded: if this request is cancelled while Submit is in flight, the admission
            # still completes and `_after_submit` aborts it, so nothing runs on unobserved.
            submit = asyncio.ensure_future(
                self.channel.stub.Submit(self.request, timeout=self._remaining(), metadata=self.metadata)
            )
            submit.add_done_callback(self._after_submit)
            await asyncio.shield(submit)
            while True:
                item = await self._next()
                if isinstance(item, grpc.aio.AioRpcError):
                    raise item
                if item.finish_reason == common_pb2.FINISH_REASON_ERROR:
                    self.ended = True
                    raise rpc_error(_STATUS_BY_CODE.get(item.error_code, grpc.StatusCode.INTERNAL),
                                     item.error or "engine error")
                if item.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                    self.ended = True
                yield item
                if self.ended:
                    return
        finally:
            self.channel.queues.pop(rid, None)

    def __aiter__(self):
        return self._responses()

    def _after_submit(self, fut: asyncio.Future) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return
        self.submitted = True
        if self.ended:  # cancelled while Submit was in flight
            asyncio.ensure_future(self._abort())

    def cancel(self) -> None:
        """Ends the request early: asks the engine to abort it (fire and forget)."""
        if self.ended:
            return
        self.ended = True
        self.channel.queues.pop(self.request.request_id, None)
        if self.submitted:
            asyncio.ensure_future(self._abort())

    async def _abort(self) -> None:
        try:
            await self.channel.stub.Utility(
                common_pb2.UtilityRequest(command=common_pb2.UTILITY_COMMAND_ABORT, request_id=self.request.request_id),
                timeout=10.0,
                metadata=self.metadata,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:  # NOT_FOUND: it had already ended
                log.warning("engine_abort_failed", request_id=self.request.request_id, code=exc.code().name)
        except grpc.aio.UsageError:
            # The gRPC channel was closed under the call: the frontend is stopping, and the
            # engine ends the request itself when the subscription goes away.
            log.info("engine_abort_skipped_channel_closed", request_id=self.request.request_id)
