"""`MultiprocessCoreClient`: the engine core in its own process, over ZeroMQ IPC + msgpack.

This process (the gRPC server) binds a PUSH socket for `CoreInput` messages and a PULL socket
for `CoreMessage`s in a private temporary directory, then spawns
``python -m tandem.engine_service.core.core_process``, which loads the model and connects. Nothing
here imports torch. A reader task on the event loop decodes each step's `CoreOutputs` and hands
it to `CoreClient._on_outputs`. A watcher thread waits on the child: if it exits while this
side did not ask it to, every request in flight fails with a message saying the engine core died
(and how), and `on_fatal` fires so the service exits non-zero.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import threading

import msgspec
import structlog
import zmq
import zmq.asyncio

from tandem.core_protocol import (
    CoreCodec,
    CoreFailed,
    CoreInput,
    CoreOutputs,
    CoreReady,
    CoreShutdown,
    UtilityResult,
)
from tandem.engine_service.config import EngineConfig
from tandem.engine_service.core.core_process import KV_TOKENS_ENV, with_kv_tokens
from tandem.engine_service.api.core_client import CoreClient

log = structlog.get_logger(__name__)


class CoreStartupError(RuntimeError):
    """The engine-core process exited or failed before it was ready."""


class MultiprocessCoreClient(CoreClient):
    """Talks to one engine-core child process (see the module docstring). Create with `launch`."""

    def __init__(self, ready: CoreReady, config: EngineConfig, proc: subprocess.Popen, ctx: zmq.asyncio.Context,
                 push: zmq.Socket, pull: zmq.asyncio.Socket, tmpdir: str, codec: CoreCodec) -> None:
        sched = config.scheduler
        super().__init__(ready.info, ready.stats, sched.max_waiting_requests, sched.max_waiting_tokens)
        self.proc = proc
        self.core_pid = ready.pid
        self._ctx, self._push, self._pull = ctx, push, pull
        self._tmpdir = tmpdir
        self._codec = codec
        self._encode = codec.encoder.encode
        self._reader: asyncio.Task | None = None
        self._stopping = False

    @classmethod
    async def launch(cls, config: EngineConfig, fail_after_steps: int | None = None,
                     log_level: str = "info", log_format: str = "json") -> "MultiprocessCoreClient":
        """Spawns the core process and waits until its model is loaded."""
        tmpdir = tempfile.mkdtemp(prefix="tandem-core-")
        in_addr, out_addr = f"ipc://{tmpdir}/input", f"ipc://{tmpdir}/output"
        ctx = zmq.asyncio.Context()
        # Sends are synchronous (never block: no high-water mark); only receiving awaits.
        push = zmq.Context.shadow(ctx.underlying).socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 0)
        push.setsockopt(zmq.LINGER, 0)
        push.bind(in_addr)
        pull = ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.RCVHWM, 0)
        pull.bind(out_addr)
        # The KV tokens travel in the child's environment, not on its (world-readable) command line.
        public = with_kv_tokens(config, ())
        env = {**os.environ, KV_TOKENS_ENV: " ".join(config.kv_transfer.auth_tokens)}
        argv = [sys.executable, "-P", "-m", "tandem.engine_service.core.core_process", "--input", in_addr,
                "--output", out_addr, "--config", msgspec.json.encode(public).decode(),
                "--log-level", log_level, "--log-format", log_format]
        if fail_after_steps is not None:
            argv += ["--fail-after-steps", str(fail_after_steps)]
        # Spawned from the event loop's thread, which lives as long as the process: the child's
        # PR_SET_PDEATHSIG fires when the spawning *thread* ends.
        proc = subprocess.Popen(argv, env=env)
        codec = CoreCodec()
        try:
            while True:
                if await pull.poll(500):
                    msg = codec.message_decoder.decode(await pull.recv())
                    if isinstance(msg, CoreReady):
                        break
                    if isinstance(msg, CoreFailed):
                        raise CoreStartupError(msg.error)
                elif proc.poll() is not None:
                    raise CoreStartupError(f"engine core exited with code {proc.returncode} while loading")
        except BaseException:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            pull.close(0)
            push.close(0)
            ctx.term()
            shutil.rmtree(tmpdir, ignore_errors=True)
            raise
        log.info("engine_core_started", pid=proc.pid, transport="zmq-ipc")
        return cls(msg, config, proc, ctx, push, pull, tmpdir, codec)

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._reader = self._loop.create_task(self._read())
        threading.Thread(target=self._watch, name="engine-core-watch", daemon=True).start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        if self.proc.poll() is None:
            try:
                self._send(CoreShutdown())
                self.proc.wait(timeout)
            except (subprocess.TimeoutExpired, zmq.ZMQError):
                self.proc.kill()
                self.proc.wait()
        if self._reader is not None:
            self._reader.cancel()
        self._pull.close(0)
        self._push.close(0)
        self._ctx.term()
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    @property
    def alive(self) -> bool:
        return self.fatal_error is None and self.proc.poll() is None

    def _send(self, msg: CoreInput) -> None:
        # No high-water mark: never blocks, never drops.
        self._push.send(self._encode(msg), zmq.NOBLOCK)

    # -- from the core ---------------------------------------------------------------------------
    async def _read(self) -> None:
        decode = self._codec.message_decoder.decode
        pull = self._pull
        while True:
            try:
                frame = await pull.recv(copy=False)
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            msg = decode(frame.buffer)
            if isinstance(msg, CoreOutputs):
                self._on_outputs(msg)
            elif isinstance(msg, UtilityResult):
                self._on_utility_result(msg)
            elif isinstance(msg, CoreFailed):
                self._on_core_death(msg.error)

    def _watch(self) -> None:
        code = self.proc.wait()
        if self._stopping:
            return
        message = f"engine core process {self.proc.pid} died (exit code {code})"
        try:
            self._loop.call_soon_threadsafe(self._on_core_death, message)
        except RuntimeError:  # the loop is closed: nothing left to fail
            pass

