"""The gRPC server's view of an engine core: per-request streams over per-step batched outputs.

`CoreClient` is the one interface the gRPC server uses; two implementations differ only in
where the core runs and how messages travel:

- `InProcessCoreClient` (inproc_client.py): the core on a thread of this process; messages are
  handed over as objects. Kept for tests and single-process tools.
- `MultiprocessCoreClient` (mp_client.py): the core in its own process; messages travel as
  msgpack over ZeroMQ IPC. The default for `tandem engine`: the core never shares the GIL with
  gRPC.

This module holds what both share, all of it on the asyncio event loop: admission checks and
the waiting-queue bound, per-request `RequestStream`s, multiplexed channels, delivery of each
`CoreOutputs` batch and failing everything in flight when the core dies. A consumer that lags
finds several outputs queued and merges them (coalescing); the core never waits on it.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

import structlog

from tandem.core_protocol import (
    CoreAbort,
    CoreInfo,
    CoreInput,
    CoreOutputs,
    CoreRequest,
    EngineStats,
    FinishReason,
    KVTransferParams,
    RequestOutput,
    SamplingParams,
    UtilityCall,
    UtilityCommand,
    UtilityResult,
)

log = structlog.get_logger(__name__)

# (outputs of one step, its step time, whether a model step ran, the core's timestamp)
StepListener = Callable[[list[RequestOutput], float, bool, float], None]


class EngineUnavailableError(RuntimeError):
    """The engine takes no new requests: it is draining or stopped after a fatal error."""


class DuplicateRequestError(ValueError):
    """A request with this ID is already in flight."""


class UnknownChannelError(KeyError):
    """Submit named a multiplexed channel that is not open (maps to FAILED_PRECONDITION)."""


class QueueFullError(RuntimeError):
    """The bounded waiting queue is full (maps to RESOURCE_EXHAUSTED with a retry hint)."""


@dataclass
class RequestStream:
    """The consumer end of one request (or of a multiplexed channel carrying many requests):
    outputs arrive here in order."""

    request_id: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False
    channel: str | None = None  # set when the request's outputs go to a multiplexed channel

    async def next_batch(self) -> list[RequestOutput]:
        """Waits for at least one output and returns every one already queued."""
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        return items


class CoreClient:
    """The asyncio-facing API of one engine replica, whatever runs its core (see module doc).

    Subclasses implement `_send(msg)` (deliver one CoreInput to the core), `start`, `stop` and
    `alive`, and call `_on_outputs`, `_on_utility_result` and `_on_core_death` on the event loop.
    Invariant: every admitted request's stream gets exactly one finished output.
    """

    def __init__(self, info: CoreInfo, stats: EngineStats, max_waiting_requests: int, max_waiting_tokens: int):
        self.info = info
        self.max_waiting_requests = max_waiting_requests
        self.max_waiting_tokens = max_waiting_tokens
        # Adds sent but not yet reflected in `stats_snapshot` (requests, prompt tokens).
        self._pending_requests = 0
        self._pending_tokens = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}
        self._channels: dict[str, RequestStream] = {}
        self._channel_members: dict[str, set[str]] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count(1)
        self.accepting = True  # False while draining: new requests get UNAVAILABLE
        self.fatal_error: str | None = None
        self.on_fatal: Callable[[str], None] | None = None
        # The core's stats after its latest step (replaced whole; read by metrics and Utility).
        self.stats_snapshot: EngineStats = stats
        self.step_listeners: list[StepListener] = []

    # -- to implement --------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        raise NotImplementedError

    def stop(self, timeout: float = 10.0) -> None:
        raise NotImplementedError

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    def _send(self, msg: CoreInput) -> None:
        raise NotImplementedError

    # -- state -------------------------------------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def in_flight_ids(self) -> list[str]:
        return list(self._streams)

    # -- requests (on the event loop) --------------------------------------------------------------
    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        channel: str | None = None,
        kv_transfer_params: KVTransferParams | None = None,
        deadline: float | None = None,
        caller: str | None = None,
    ) -> RequestStream:
        """Admits a request. With `channel`, its outputs go to that open channel's queue;
        `deadline` (time.monotonic()) is when the core stops it (None: never); `caller` names
        who sent it (lease caps)."""
        if channel is not None and channel not in self._channels:
            raise UnknownChannelError(channel)
        if self.fatal_error is not None:
            raise EngineUnavailableError(f"engine failed: {self.fatal_error}")
        if not self.accepting:
            raise EngineUnavailableError("engine is draining")
        if request_id in self._streams:
            raise DuplicateRequestError(request_id)
        waiting, waiting_tokens = self.queue_depth()
        if waiting + 1 > self.max_waiting_requests or waiting_tokens + len(prompt_token_ids) > self.max_waiting_tokens:
            raise QueueFullError(
                f"waiting queue is full ({waiting} requests, {waiting_tokens} tokens; limits "
                f"{self.max_waiting_requests} requests, {self.max_waiting_tokens} tokens)"
            )
        self._pending_requests += 1
        self._pending_tokens += len(prompt_token_ids)
        stream = RequestStream(request_id, channel=channel)
        self._streams[request_id] = stream
        if channel is not None:
            self._channel_members[channel].add(request_id)
        self._send(CoreRequest(request_id=request_id, prompt_token_ids=list(prompt_token_ids), sampling=params,
                               arrival_time=time.monotonic(), channel=channel,
                               kv_transfer_params=kv_transfer_params, deadline=deadline,
                               caller=caller))
        return stream

    def queue_depth(self) -> tuple[int, int]:
        """Requests and prompt tokens waiting for their first step, including adds in transit."""
        snap = self.stats_snapshot
        return snap.num_waiting + self._pending_requests, snap.waiting_tokens + self._pending_tokens

    def abort(self, request_id: str) -> bool:
        """Aborts a request; its stream gets a final ABORT output once the core confirmed."""
        if request_id not in self._streams:
            return False
        self._send(CoreAbort([request_id]))
        return True

    def release_lease(self, request_id: str) -> None:
        """Forwards an abort of a request no longer in flight here: a producer's core releases
        the lease a finished prefill leg of that id holds (a no-op in the core otherwise)."""
        self._send(CoreAbort([request_id]))

    def release(self, request_id: str) -> None:
        """Forgets a consumer that went away; aborts the request if it had not ended."""
        stream = self._streams.get(request_id)
        if stream is not None and not stream.finished:
            self._send(CoreAbort([request_id]))
        else:
            self._streams.pop(request_id, None)

    def utility(self, command: UtilityCommand) -> asyncio.Future:
        """Runs `command` in the core between two steps; the future gets its typed result."""
        fut = self._loop.create_future()
        if self.fatal_error is not None:
            fut.set_exception(EngineUnavailableError(f"engine failed: {self.fatal_error}"))
            return fut
        call_id = next(self._call_ids)
        self._calls[call_id] = fut
        self._send(UtilityCall(call_id, command))
        return fut

    # -- multiplexed channels (one per frontend connection) ----------------------------------------
    def open_channel(self, channel: str) -> RequestStream:
        """Opens a channel: one queue that receives the outputs of every request bound to it."""
        if channel in self._channels:
            raise DuplicateRequestError(f"channel {channel}")
        stream = RequestStream(channel)
        self._channels[channel] = stream
        self._channel_members[channel] = set()
        return stream

    def channel_members(self, channel: str) -> list[str]:
        """Requests bound to `channel` that have not ended."""
        return list(self._channel_members.get(channel, ()))

    def close_channel(self, channel: str) -> None:
        """Closes a channel whose subscriber went away and aborts the requests still bound to it."""
        self._channels.pop(channel, None)
        for request_id in self._channel_members.pop(channel, set()):
            self.release(request_id)

    # -- from the core (on the event loop) ---------------------------------------------------------
    def _on_outputs(self, batch: CoreOutputs) -> None:
        self.stats_snapshot = batch.stats
        self._pending_requests -= batch.added_requests
        self._pending_tokens -= batch.added_tokens
        if not batch.outputs and not batch.stepped:
            return
        # A step that only computed prompt chunks has no outputs but still counts as a step.
        for listener in self.step_listeners:
            listener(batch.outputs, batch.step_time, batch.stepped, batch.timestamp)
        for o in batch.outputs:
            stream = self._streams.get(o.request_id)
            if stream is None or stream.finished:
                continue
            target = stream if stream.channel is None else self._channels.get(stream.channel)
            if target is not None:
                target.queue.put_nowait(o)
            if o.finished:
                stream.finished = True
                del self._streams[o.request_id]
                if stream.channel is not None:
                    self._channel_members.get(stream.channel, set()).discard(o.request_id)

    def _on_utility_result(self, result: UtilityResult) -> None:
        fut = self._calls.pop(result.call_id, None)
        if fut is None or fut.done():
            return
        if result.error is not None:
            fut.set_exception(RuntimeError(result.error))
        else:
            fut.set_result(result.result)

    def _on_core_death(self, message: str) -> None:
        """The core is gone: fail every request and utility call in flight, once."""
        if self.fatal_error is not None:
            return
        log.error("engine_core_died", error=message, in_flight=len(self._streams))
        self.fatal_error = message
        for request_id, stream in list(self._streams.items()):
            target = stream if stream.channel is None else self._channels.get(stream.channel)
            if target is not None:
                target.queue.put_nowait(
                    RequestOutput(request_id=request_id, finished=True, finish_reason=FinishReason.ERROR,
                                  error=message)
                )
            stream.finished = True
        self._streams.clear()
        for members in self._channel_members.values():
            members.clear()
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(EngineUnavailableError(message))
        self._calls.clear()
        if self.on_fatal is not None:
            self.on_fatal(message)
