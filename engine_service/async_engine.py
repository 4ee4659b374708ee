"""Runs `LLMEngine` on its own thread and hands each request's deltas to asyncio consumers.

Threading model: the engine thread is the only one that touches the scheduler, block manager
and sequences. The asyncio side (the gRPC server) sends commands through a locked inbox and
receives per-step outputs through `loop.call_soon_threadsafe`. Each request has a
`RequestStream`; a consumer that lags simply finds several step outputs queued and merges them
into one message (coalescing), so the engine never waits on a slow client.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import structlog

from tandem.engine_service.engine import LLMEngine, StepOutput
from tandem.engine_service.sequence import FinishReason, SamplingParams

log = structlog.get_logger(__name__)


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
    step outputs arrive here in order."""

    request_id: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False
    channel: str | None = None  # set when the request's outputs go to a multiplexed channel

    async def next_batch(self) -> list[StepOutput]:
        """Waits for at least one step output and returns every one already queued."""
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        return items


class AsyncEngine:
    """Owns the engine thread; the asyncio-facing API of one engine replica."""

    def __init__(
        self,
        engine: LLMEngine,
        on_fatal: Callable[[BaseException], None] | None = None,
        fail_after_steps: int | None = None,
    ):
        self.engine = engine
        # Fault injection for the failure tests: raise inside the loop after this many steps.
        self._fail_after_steps = fail_after_steps
        self.max_waiting_requests = engine.config.scheduler.max_waiting_requests
        self.max_waiting_tokens = engine.config.scheduler.max_waiting_tokens
        # Adds posted but not yet reflected in `stats_snapshot` (requests, prompt tokens).
        self._pending_requests = 0
        self._pending_tokens = 0
        self._on_fatal = on_fatal
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}
        self._channels: dict[str, RequestStream] = {}
        self._channel_members: dict[str, set[str]] = {}
        self._inbox: deque[tuple[str, tuple]] = deque()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.accepting = True  # False while draining: new requests get UNAVAILABLE
        self.fatal_error: BaseException | None = None
        # Refreshed by the engine thread after every step; read by the asyncio side.
        self.stats_snapshot: dict = engine.stats()
        self.step_listeners: list[Callable[[list[StepOutput], float], None]] = []

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self.fatal_error is None and self._thread is not None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def in_flight_ids(self) -> list[str]:
        return list(self._streams)

    # -- requests (called on the event loop) ------------------------------------------------------
    def submit(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, channel: str | None = None
    ) -> RequestStream:
        """Admits a request. With `channel`, its outputs go to that open channel's queue."""
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
        with self._wake:
            self._pending_requests += 1
            self._pending_tokens += len(prompt_token_ids)
        stream = RequestStream(request_id, channel=channel)
        self._streams[request_id] = stream
        if channel is not None:
            self._channel_members[channel].add(request_id)
        self._post("add", (request_id, list(prompt_token_ids), params, time.monotonic()))
        return stream

    # -- multiplexed channels (one per frontend connection) ---------------------------------------
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

    def queue_depth(self) -> tuple[int, int]:
        """Requests and prompt tokens waiting for their first step, including adds in transit."""
        snap = self.stats_snapshot
        with self._wake:
            return (snap["num_waiting"] + self._pending_requests, snap["waiting_tokens"] + self._pending_tokens)

    def abort(self, request_id: str) -> bool:
        """Aborts a request; its stream gets a final ABORT output once the engine confirmed."""
        if request_id not in self._streams:
            return False
        self._post("abort", (request_id,))
        return True

    def release(self, request_id: str) -> None:
        """Forgets a consumer that went away; aborts the request if it had not ended."""
        stream = self._streams.get(request_id)
        if stream is not None and not stream.finished:
            self._post("abort", (request_id,))
        else:
            self._streams.pop(request_id, None)

    def call(self, fn: Callable[[LLMEngine], object]) -> asyncio.Future:
        """Runs `fn(engine)` on the engine thread between steps and returns its result."""
        fut = self._loop.create_future()
        self._post("call", (fn, fut))
        return fut

    # -- engine thread ---------------------------------------------------------------------------
    def _post(self, op: str, args: tuple) -> None:
        with self._wake:
            self._inbox.append((op, args))
            self._wake.notify()

    def _drain_inbox(self, added: list[int]) -> list[StepOutput]:
        """Applies queued commands; `added` collects the prompt lengths of the adds taken."""
        outputs: list[StepOutput] = []
        while True:
            with self._wake:
                if not self._inbox:
                    return outputs
                op, args = self._inbox.popleft()
            if op == "add":
                request_id, prompt, params, arrival = args
                added.append(len(prompt))
                try:
                    seq = self.engine.add_request(request_id, prompt, params)
                    seq.arrival_time = arrival
                except Exception as exc:  # invalid after all: report instead of dying
                    log.warning("add_request_failed", request_id=request_id, error=str(exc))
                    outputs.append(
                        StepOutput(request_id, finished=True, finish_reason=FinishReason.ERROR, error=str(exc))
                    )
            elif op == "abort":
                (request_id,) = args
                seq = self.engine.abort(request_id)
                outputs.append(
                    StepOutput(
                        request_id,
                        finished=True,
                        finish_reason=FinishReason.ABORT,
                        num_prompt_tokens=seq.num_prompt_tokens if seq else 0,
                        num_output_tokens=seq.num_output_tokens if seq else 0,
                        num_cached_prompt_tokens=(seq.num_cached_prompt_tokens or 0) if seq else 0,
                        arrival_time=seq.arrival_time if seq else 0.0,
                        first_token_time=seq.first_token_time if seq else None,
                    )
                )
            elif op == "call":
                fn, fut = args
                try:
                    result, error = fn(self.engine), None
                except Exception as exc:
                    result, error = None, exc
                self._loop.call_soon_threadsafe(_settle, fut, result, error)

    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    while not self._inbox and not self.engine.has_work() and not self._stopping:
                        self._wake.wait()
                    if self._stopping:
                        return
                added: list[int] = []
                outputs = self._drain_inbox(added)
                t0 = time.perf_counter()
                if self.engine.has_work():
                    if self._fail_after_steps is not None and self.engine.counters.steps >= self._fail_after_steps:
                        raise RuntimeError(f"injected fault after {self._fail_after_steps} steps")
                    outputs.extend(self.engine.step())
                step_time = time.perf_counter() - t0
                snapshot = self.engine.stats()
                with self._wake:  # the adds now show in the snapshot: stop counting them twice
                    self.stats_snapshot = snapshot
                    self._pending_requests -= len(added)
                    self._pending_tokens -= sum(added)
                if outputs:
                    for listener in self.step_listeners:
                        listener(outputs, step_time)
                    self._loop.call_soon_threadsafe(self._deliver, outputs)
        except BaseException as exc:  # fatal: fail everything in flight and say so
            log.exception("engine_fatal_error")
            self.fatal_error = exc
            self._loop.call_soon_threadsafe(self._fail_all, str(exc))
            if self._on_fatal is not None:
                self._on_fatal(exc)

    # -- back on the event loop ---------------------------------------------------------------------
    def _deliver(self, outputs: list[StepOutput]) -> None:
        for o in outputs:
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

    def _fail_all(self, message: str) -> None:
        for request_id, stream in list(self._streams.items()):
            target = stream if stream.channel is None else self._channels.get(stream.channel)
            if target is not None:
                target.queue.put_nowait(
                    StepOutput(request_id, finished=True, finish_reason=FinishReason.ERROR, error=message)
                )
            stream.finished = True
        self._streams.clear()
        for members in self._channel_members.values():
            members.clear()


def _settle(fut: asyncio.Future, result: object, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
