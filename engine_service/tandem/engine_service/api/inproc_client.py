"""`InProcessCoreClient`: the engine core on a thread of the gRPC server's own process.

Threading model: the core thread is the only one that touches the engine. The event loop posts
typed messages into a locked inbox; the core thread applies them between steps and hands each
step's `CoreOutputs` back with `loop.call_soon_threadsafe`. Nothing is serialized. Kept for
tests, `bench throughput`-style tools and `tandem engine --engine-core thread`; the default is
the multiprocess client (the two share the GIL here).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque

import structlog

from tandem.core_protocol import CoreInput, CoreShutdown, UtilityCall
from tandem.engine_service.core.engine_core import EngineCore, core_info
from tandem.engine_service.api.core_client import CoreClient
from tandem.engine_service.core.engine import LLMEngine

log = structlog.get_logger(__name__)


class InProcessCoreClient(CoreClient):
    """Runs an `EngineCore` over `engine` on its own thread (see the module docstring)."""

    def __init__(self, engine: LLMEngine, fail_after_steps: int | None = None) -> None:
        sched = engine.config.scheduler
        super().__init__(core_info(engine), engine.stats(), sched.max_waiting_requests, sched.max_waiting_tokens)
        self.engine = engine
        self.core = EngineCore(engine, fail_after_steps)
        self._inbox: deque[CoreInput] = deque()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._send(CoreShutdown())
        if self._thread is not None:
            self._thread.join(timeout)
        self.engine.close()

    @property
    def alive(self) -> bool:
        return self.fatal_error is None and self._thread is not None and self._thread.is_alive()

    def _send(self, msg: CoreInput) -> None:
        with self._wake:
            self._inbox.append(msg)
            self._wake.notify()

    # -- core thread -------------------------------------------------------------------------------
    def _run(self) -> None:
        core, loop = self.core, self._loop
        try:
            while True:
                with self._wake:
                    while not self._inbox and not core.has_work():
                        if not self._wake.wait(core.idle_timeout(3600.0)):
                            core.tick()
                    messages = list(self._inbox)
                    self._inbox.clear()
                for msg in messages:
                    if isinstance(msg, CoreShutdown):
                        return
                    result = core.apply(msg)
                    if isinstance(msg, UtilityCall):
                        loop.call_soon_threadsafe(self._on_utility_result, result)
                batch = core.step()
                if batch is not None:
                    loop.call_soon_threadsafe(self._on_outputs, batch)
        except BaseException as exc:  # fatal: fail everything in flight and say so
            log.exception("engine_fatal_error")
            loop.call_soon_threadsafe(self._on_core_death, f"engine core failed: {exc}")
