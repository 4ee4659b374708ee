"""The engine-core process: loads the model and runs the `EngineCore` loop over ZeroMQ IPC.

Started by `MultiprocessCoreClient` (mp_client.py) as
``python -m tandem.engine_service.core.core_process --input ADDR --output ADDR --config JSON``.
The parent binds both sockets; this process connects a PULL socket for `CoreInput` messages and
a PUSH socket for `CoreMessage`s, all msgpack (msgspec). The loop takes every queued message,
runs one step and sends that step's `CoreOutputs`; the PUSH socket has no high-water mark, so a
slow reader never blocks a step. It exits 0 on `CoreShutdown`, 1 after a fatal error (having
sent `CoreFailed`), and dies with its parent (PR_SET_PDEATHSIG, plus a parent-pid check while
idle), removing the parent's socket directory when the parent cannot.
"""

from __future__ import annotations

import argparse
import dataclasses
import ctypes
import os
import shutil
import signal
import sys
import tempfile
import threading
import time

import msgspec
import structlog
import zmq

from tandem.core_protocol import CoreCodec, CoreFailed, CoreReady, CoreShutdown, UtilityCall
from tandem.engine_service.config import EngineConfig

log = structlog.get_logger(__name__)

IDLE_POLL_MS = 1000  # how often an idle core checks that its parent is still there


def idle_spin_seconds() -> float:
    """`TANDEM_CORE_IDLE_SPIN_MS` in seconds (default 0: off): how long a core that just ran out
    of work busy-polls its input before it blocks. A closed-loop client's next request follows
    the last answer within milliseconds; spinning keeps the core's CPU awake for it (no wake-up
    from a blocked poll, no clock ramp) at the price of one busy core for that long."""
    raw = os.environ.get("TANDEM_CORE_IDLE_SPIN_MS", "")
    try:
        return max(0.0, float(raw)) / 1000.0 if raw else 0.0
    except ValueError:
        raise ValueError(f"TANDEM_CORE_IDLE_SPIN_MS: expected milliseconds, got {raw!r}") from None


def spin_for_input(pull: zmq.Socket, seconds: float) -> bool:
    """Busy-polls `pull` for up to `seconds`; True as soon as a message is waiting."""
    if seconds <= 0:
        return False
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if pull.poll(0):
            return True
    return False


def _die_with_parent() -> None:
    """Asks Linux to SIGTERM this process when its parent dies (no-op elsewhere); the SIGTERM
    handler (`_exit_on_sigterm`) removes the socket directory and exits at once."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _socket_dir(address: str) -> str | None:
    """The private directory of an `ipc://` address the parent made (tandem-core-* under the
    temporary directory), or None for anything else (never removed)."""
    if not address.startswith("ipc://"):
        return None
    directory = os.path.dirname(address[len("ipc://"):])
    parent, name = os.path.split(directory)
    if os.path.realpath(parent) != os.path.realpath(tempfile.gettempdir()) or not name.startswith("tandem-core-"):
        return None
    return directory


def _remove_socket_dir(directory: str | None) -> None:
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


def _exit_on_sigterm(directory: str | None) -> None:
    """SIGTERM (the parent died, or someone asked): leave no socket directory behind, exit 1 at
    once (the parent, if alive, fails the requests in flight)."""

    def handler(signum, frame):
        _remove_socket_dir(directory)
        os._exit(1)

    signal.signal(signal.SIGTERM, handler)


def run_core(config: EngineConfig, input_addr: str, output_addr: str, fail_after_steps: int | None,
             parent_pid: int) -> int:
    codec = CoreCodec()
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 0)
    pull.connect(input_addr)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)  # never block a step on a slow reader
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(output_addr)
    encode = codec.encoder.encode
    try:
        spin_s = idle_spin_seconds()
        torch_threads = os.environ.get("TANDEM_TORCH_THREADS")
        if torch_threads:
            import torch

            torch.set_num_threads(int(torch_threads))
        from tandem.engine_service.core.engine_core import EngineCore, core_info
        from tandem.engine_service.core.warmup import serving_engine

        engine = serving_engine(config)
        core = EngineCore(engine, fail_after_steps)
        push.send(encode(CoreReady(core_info(engine), engine.stats(), os.getpid())))
        log.info("engine_core_ready", pid=os.getpid(), kv_blocks=engine.block_manager.num_blocks)
        # The model is loaded on this (main) thread and the loop runs on another, exactly as
        # in-process (InProcessCoreClient: built on an executor thread, stepped on the engine
        # thread), so the two stacks differ only in the process boundary. It matters on CPU:
        # stepping on the thread that loaded the model measured 10x slower per step on a busy
        # 2-core host (torch's intra-op thread team). The sockets move to the loop thread (a
        # thread start is the memory barrier ZeroMQ asks for) and this thread only waits.
        result: list[int] = []
        loop = threading.Thread(target=lambda: result.append(_loop(core, pull, push, codec, parent_pid, spin_s)),
                                name="tandem-engine-core")
        loop.start()
        loop.join()
        return result[0] if result else 1
    except BaseException as exc:  # fatal while loading: say so, then exit non-zero
        log.exception("engine_fatal_error")
        _send_failed(push, encode, exc)
        return 1
    finally:
        pull.close(0)
        push.close()
        ctx.term()


def _send_failed(push: zmq.Socket, encode, exc: BaseException) -> None:
    try:
        push.send(encode(CoreFailed(f"engine core failed: {exc}")))
    except zmq.ZMQError:
        pass


def _loop(core, pull: zmq.Socket, push: zmq.Socket, codec: CoreCodec, parent_pid: int,
          idle_spin_s: float = 0.0) -> int:
    """Take every queued message, run one step, send its outputs; until CoreShutdown (0), a fatal
    error (1, after CoreFailed) or the parent going away (1)."""
    encode = codec.encoder.encode
    decode = codec.input_decoder.decode
    try:
        while True:
            if not core.has_work() and not spin_for_input(pull, idle_spin_s):
                while not pull.poll(int(core.idle_timeout(IDLE_POLL_MS / 1000) * 1000)):
                    if os.getppid() != parent_pid:
                        log.error("engine_core_parent_gone")
                        return 1
                    core.tick()
                    if core.has_work():
                        break  # the tick ended leases: publish the stats
            while pull.poll(0):
                msg = decode(pull.recv(copy=False).buffer)
                if isinstance(msg, CoreShutdown):
                    log.info("engine_core_stopped")
                    return 0
                result = core.apply(msg)
                if isinstance(msg, UtilityCall):
                    push.send(encode(result))
            batch = core.step()
            if batch is not None:
                push.send(encode(batch), copy=False)
    except BaseException as exc:  # fatal: say so, then exit non-zero
        log.exception("engine_fatal_error")
        _send_failed(push, encode, exc)
        return 1


# The engine's bearer tokens reach the core process (its KV pull port checks them) through this
# variable, never its command line (world-readable); the parent strips them from --config.
KV_TOKENS_ENV = "TANDEM_CORE_KV_AUTH_TOKENS"


def with_kv_tokens(config: EngineConfig, tokens: tuple[str, ...]) -> EngineConfig:
    """`config` with its KV transfer tokens replaced by `tokens`."""
    return dataclasses.replace(config, kv_transfer=dataclasses.replace(config.kv_transfer, auth_tokens=tokens))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tandem-engine-core")
    p.add_argument("--input", required=True, help="ZeroMQ address of the parent's PUSH socket")
    p.add_argument("--output", required=True, help="ZeroMQ address of the parent's PULL socket")
    p.add_argument("--config", required=True, help="EngineConfig as JSON")
    p.add_argument("--fail-after-steps", type=int, default=None, help="testing only: fatal error after N steps")
    p.add_argument("--log-level", default="info")
    p.add_argument("--log-format", default="json", choices=["json", "console"])
    args = p.parse_args(argv)
    socket_dir = _socket_dir(args.input)
    _exit_on_sigterm(socket_dir)
    _die_with_parent()
    parent_pid = os.getppid()
    from tandem.logging_setup import configure_logging

    configure_logging(args.log_level, json=args.log_format == "json")
    # Signals go to the gRPC process, which shuts the core down in order (CoreShutdown).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = with_kv_tokens(msgspec.json.decode(args.config, type=EngineConfig),
                            tuple(os.environ.pop(KV_TOKENS_ENV, "").split()))
    code = run_core(config, args.input, args.output, args.fail_after_steps, parent_pid)
    if code != 0:  # the parent may be gone (nobody else would clean up); on shutdown it removes it
        _remove_socket_dir(socket_dir)
    return code


if __name__ == "__main__":
    sys.exit(main())
