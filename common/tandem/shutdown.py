"""How a server process stops: SIGTERM or Ctrl-C starts a drain, a second one stops at once.

Both services (and the frontend inside `tandem serve`) install `StopSignals` on their event
loop. The first signal sets `stop` (the server refuses new work and lets in-flight requests
finish within --drain-timeout); a second sets `force` (the drain ends now, requests still in
flight are cut off). Each transition is one log record: `draining` when the drain starts,
`drained` when it ends (with how long it took and how many requests it cut off; both at debug
level when nothing was in flight), and `stopping_now` for the second signal.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

import structlog

log = structlog.get_logger(__name__)


class StopSignals:
    """SIGTERM/SIGINT handlers on the running loop: the first sets `stop`, the next `force`."""

    def __init__(self, on_stop: Callable[[], None] | None = None,
                 on_force: Callable[[], None] | None = None) -> None:
        self.stop = asyncio.Event()
        self.force = asyncio.Event()
        self._on_stop, self._on_force = on_stop, on_force

    def install(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self.signalled)
            except (NotImplementedError, RuntimeError):  # not the main thread (tests)
                pass

    def signalled(self) -> None:
        if not self.stop.is_set():
            self.stop.set()
            if self._on_stop is not None:
                self._on_stop()
        elif not self.force.is_set():
            self.force.set()
            log.warning("stopping_now", reason="a second stop signal: requests in flight are cut off")
            if self._on_force is not None:
                self._on_force()

    async def drain(self, in_flight: Callable[[], int], timeout: float) -> int:
        """Waits until nothing is in flight, `timeout` passes or `force` is set, logging the
        start and the end; returns how many requests were still in flight."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        waiting = in_flight()
        # Nothing in flight: nothing to wait for, and no lines (an engine that `tandem serve`
        # stops after its frontend drained stays quiet).
        emit = log.info if waiting else log.debug
        emit("draining", in_flight=waiting, timeout_s=timeout, hint="a second Ctrl-C or SIGTERM stops at once")
        while in_flight() and loop.time() < start + timeout and not self.force.is_set():
            await asyncio.sleep(0.05)
        left = in_flight()
        emit("drained", seconds=round(loop.time() - start, 2), cut_off=left)
        return left
