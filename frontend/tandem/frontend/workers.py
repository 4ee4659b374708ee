"""Several frontend processes on one port.

The frontend is stateless, so when one process's event loop saturates (detokenizing and
sending one message per token per client), more processes help where a cleverer single
process would not. Extra workers bind the same address with SO_REUSEPORT (gRPC's default on
Linux), and the kernel spreads client connections across them. Each worker has its own engine
connections and, when metrics are on, its own metrics port (base port + worker index).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import shutil
import signal
import tempfile
from collections.abc import Callable

from tandem.frontend.app import FrontendOptions, run_frontend


def _worker_main(options: FrontendOptions, log_level: str, log_json: bool) -> None:
    from tandem.logging_setup import configure_logging

    configure_logging(log_level, json=log_json)
    raise SystemExit(run_frontend(options))


def worker_options(options: FrontendOptions, index: int) -> FrontendOptions:
    """The options of worker `index` (1-based for the extra workers): same port, own metrics port
    and relay socket."""
    metrics_port = options.metrics_port + index if options.metrics_port else options.metrics_port
    return dataclasses.replace(options, metrics_port=metrics_port, listen_when_ready=True, worker_index=index)


def start_extra_workers(options: FrontendOptions, count: int, log_level: str, log_json: bool) -> list:
    """Starts `count` more frontend processes (spawned: no state is inherited) and returns them."""
    ctx = multiprocessing.get_context("spawn")
    workers = []
    for i in range(1, count + 1):
        p = ctx.Process(target=_worker_main, args=(worker_options(options, i), log_level, log_json),
                        name=f"tandem-frontend-{i}", daemon=False)
        p.start()
        workers.append(p)
    return workers


def signal_workers(workers: list, sig: int = signal.SIGTERM) -> None:
    for p in workers:
        if p.is_alive():
            p.terminate() if sig == signal.SIGTERM else p.kill()


def stop_workers(workers: list, timeout: float, already_signalled: bool) -> int:
    """SIGTERM (each drains) unless already sent, wait, kill stragglers; the worst exit code.
    A second SIGTERM could land while a worker tears down, after its handler is gone."""
    if not already_signalled:
        signal_workers(workers)
    worst = 0
    for p in workers:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join()
        worst = worst or (p.exitcode or 0)
    return worst


def run_frontend_workers(options: FrontendOptions, count: int, log_level: str, log_json: bool,
                         on_stop: Callable[[], None] | None = None,
                         on_ready: Callable[[], None] | None = None,
                         on_force: Callable[[], None] | None = None) -> int:
    """Runs `count` frontend processes (this one included) until SIGTERM; drains them all."""
    if count < 1:
        raise ValueError("at least one frontend worker is needed")
    relay_dir = None
    if count > 1:
        # mkdtemp's folder is the user's alone (0700): only their processes reach the relay sockets.
        relay_dir = tempfile.mkdtemp(prefix="tandem-frontend-")
        options = dataclasses.replace(options, relay_dir=relay_dir, worker_index=0, num_workers=count)
    extra = start_extra_workers(options, count - 1, log_level, log_json) if count > 1 else []

    signalled = False

    def forward() -> None:
        nonlocal signalled
        signalled = True
        signal_workers(extra)
        if on_stop is not None:
            on_stop()

    def force() -> None:  # a second signal: the extra workers stop at once too
        signal_workers(extra, signal.SIGKILL)
        if on_force is not None:
            on_force()

    try:
        rc = run_frontend(options, on_stop=forward, on_ready=on_ready, on_force=force)
    finally:
        worst = stop_workers(extra, options.drain_timeout + 10, already_signalled=signalled)
        if relay_dir is not None:
            shutil.rmtree(relay_dir, ignore_errors=True)
    return rc or worst
