"""The disaggregated soak: the soak's calls (soak.py) through a frontend with a prefill and a
decode pool, while the producer is killed and restarted and a router-style client leaves leases
to expire, then a leak check of both engines.

The topology is the one `tandem serve --disaggregated` starts (a producer engine, a consumer
engine trusting the producer's loopback pull ports, a frontend over both pools), assembled from
its three processes so that the producer can be killed (SIGKILL) and started again on its port,
which `serve` does not do (an engine that dies ends it). Everything listens on loopback.

While the calls run:

- every `restart_every` seconds the producer is killed and restarted: calls caught by it end
  UNAVAILABLE (accepted in every scenario), never INTERNAL; the frontend takes the producer back
  once its health check passes;
- every `router_every` seconds a router-style client drives the legs itself on the engine port:
  a prefill leg with `do_remote_decode`, then either nothing (the lease expires after
  `lease_seconds`), a Utility ABORT of its id (released), or the decode leg on the consumer (the
  pull releases it). Its outcomes are counted like the calls'.

Afterwards both engines must hold nothing: requests, blocks, state slots, leases, loads
(`soak.leaks`, through the frontend's Utility STATS), within `lease_seconds` plus the soak's idle
timeout. Run it with `python -m tandem.bench.disagg_soak --requests 10000` (or the CI test,
tests/integration/test_disaggregated_soak.py, for a bounded two minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.bench.soak import SoakOptions, run_soak, short_table

ENGINE_SERVICE = "tandem.v1.Engine"
FRONTEND_SERVICE = "tandem.v1.Frontend"
# What a router-style call may end with besides OK: the producer was restarting (UNAVAILABLE) or
# its lease caps were reached (RESOURCE_EXHAUSTED).
ROUTER_ACCEPTED = {"OK", "UNAVAILABLE", "RESOURCE_EXHAUSTED"}


@dataclass
class DisaggSoakOptions:
    """The topology and the chaos around the soak's calls (see the module docstring)."""

    soak: SoakOptions = field(default_factory=SoakOptions)
    model: str = "dummy:tiny-qwen3"
    max_model_len: int = 256
    num_kv_blocks: int = 256
    lease_seconds: float = 2.0
    restart_every: float = 40.0  # seconds between producer restarts (0: never)
    router_every: float = 0.5  # seconds between router-style prefill legs (0: none)
    startup_timeout: float = 300.0
    log_dir: str | None = None  # keep the processes' logs here (default: a temporary directory)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(address: str, service: str, timeout: float, proc: subprocess.Popen) -> None:
    """Polls grpc.health.v1 until `service` at `address` is SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{service} at {address} exited with {proc.returncode} before it was ready")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{service} at {address} not serving after {timeout}s")


class Topology:
    """A producer engine, a consumer engine and a frontend over both, on loopback ports."""

    def __init__(self, opts: DisaggSoakOptions, workdir: Path) -> None:
        from tandem.engine_service.worker.loader import read_eos_token_ids, resolve_model
        from tandem.wordlevel_tokenizer import write_wordlevel_tokenizer

        self.opts = opts
        self.workdir = workdir
        resolved = resolve_model(opts.model, None)
        if resolved.path is not None:
            tokenizer = str(resolved.path)
        else:  # dummy weights: a word-level tokenizer over their vocabulary
            eos = read_eos_token_ids(resolved)
            tokenizer = str(write_wordlevel_tokenizer(workdir / "tokenizer", int(resolved.config["vocab_size"]),
                                                      eos[0] if eos else None, opts.max_model_len))
        pport, dport, fport = _free_port(), _free_port(), _free_port()
        self.prefill, self.decode, self.frontend = (f"127.0.0.1:{p}" for p in (pport, dport, fport))
        engine = ["engine", "--host", "127.0.0.1", "--model", opts.model, "--max-model-len", str(opts.max_model_len),
                  "--num-kv-blocks", str(opts.num_kv_blocks)]
        self.producer_argv = engine + ["--port", str(pport), "--kv-role", "producer",
                                       "--kv-lease-seconds", str(opts.lease_seconds)]
        # The producer's pull port is picked anew at each start: the consumer trusts loopback's.
        consumer_argv = engine + ["--port", str(dport), "--kv-role", "consumer", "--kv-producer", "127.0.0.1:*"]
        frontend_argv = ["frontend", "--host", "127.0.0.1", "--port", str(fport), "--prefill-engine", self.prefill,
                         "--decode-engine", self.decode, "--tokenizer", tokenizer, "--allow-admin-commands",
                         "--engine-connect-timeout", str(int(opts.startup_timeout))]
        self.producer = self._start(self.producer_argv, "producer")
        self.consumer = self._start(consumer_argv, "consumer")
        self.front = self._start(frontend_argv, "frontend")
        self.restarts = 0
        for address, service, proc in ((self.prefill, ENGINE_SERVICE, self.producer),
                                       (self.decode, ENGINE_SERVICE, self.consumer),
                                       (self.frontend, FRONTEND_SERVICE, self.front)):
            wait_serving(address, service, opts.startup_timeout, proc)

    def _start(self, argv: list[str], name: str) -> subprocess.Popen:
        env = {**os.environ, "TANDEM_LOG_LEVEL": os.environ.get("TANDEM_LOG_LEVEL", "warning")}
        log = open(self.workdir / f"{name}.log", "ab")
        try:
            # -P: the working directory never shadows the installed packages.
            return subprocess.Popen([sys.executable, "-P", "-m", "tandem.cli", *argv], env=env, cwd="/",
                                    stdout=log, stderr=log)
        finally:
            log.close()

    def restart_producer(self) -> None:
        """SIGKILL the producer (its core process follows it), start it again on its port."""
        self.producer.kill()
        self.producer.wait()
        self.producer = self._start(self.producer_argv, "producer")
        wait_serving(self.prefill, ENGINE_SERVICE, self.opts.startup_timeout, self.producer)
        self.restarts += 1

    def stop(self) -> None:
        for proc in (self.front, self.consumer, self.producer):
            if proc.poll() is None:
                proc.terminate()
        for proc in (self.front, self.consumer, self.producer):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class Chaos:
    """The producer restarts and the router-style legs, on threads, until `stop`."""

    def __init__(self, topo: Topology, opts: DisaggSoakOptions) -> None:
        self.topo = topo
        self.opts = opts
        self.router: Counter[str] = Counter()  # outcome -> count, over router-style calls
        self.actions: Counter[str] = Counter()
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._guard, args=(fn,), daemon=True)
                         for fn, every in ((self._restarts, opts.restart_every), (self._router, opts.router_every))
                         if every > 0]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(self.opts.startup_timeout + 30)

    def _guard(self, fn) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - reported in the summary, failing the run
            self.errors.append(f"{fn.__name__}: {exc!r}")

    def _restarts(self) -> None:
        while not self._stop.wait(self.opts.restart_every):
            self.topo.restart_producer()

    def _router(self) -> None:
        import grpc

        from tandem.v1 import common_pb2, engine_pb2, engine_pb2_grpc

        rng = random.Random(self.opts.soak.seed + 1)
        vocab = min(self.opts.soak.vocab_size, 1000)
        with grpc.insecure_channel(self.topo.prefill) as pch, grpc.insecure_channel(self.topo.decode) as dch:
            producer, consumer = engine_pb2_grpc.EngineStub(pch), engine_pb2_grpc.EngineStub(dch)
            i = 0
            while not self._stop.wait(self.opts.router_every):
                i += 1
                rid = f"router-{i}"
                prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(4, 40))]
                action = rng.choice(["expire", "release", "pull"])
                self.actions[action] += 1
                leg = engine_pb2.EngineRequest(request_id=rid, prompt_token_ids=prompt)
                leg.sampling.max_tokens = 1
                leg.sampling.temperature = 0.0
                leg.kv_transfer_params.do_remote_decode = True
                try:
                    final = producer.Generate(leg, timeout=30)
                    if action == "release":
                        producer.Utility(common_pb2.UtilityRequest(command=common_pb2.UTILITY_COMMAND_ABORT,
                                                                   request_id=rid), timeout=10)
                    elif action == "pull" and final.kv_transfer_params.lease_id:
                        dec = engine_pb2.EngineRequest(request_id=rid + "-decode",
                                                       prompt_token_ids=prompt + list(final.token_ids))
                        dec.sampling.max_tokens = 4
                        dec.sampling.temperature = 0.0
                        dec.kv_transfer_params.CopyFrom(final.kv_transfer_params)
                        consumer.Generate(dec, timeout=30)
                    self.router["OK"] += 1
                except grpc.RpcError as exc:
                    self.router[exc.code().name] += 1


def run_disagg_soak(opts: DisaggSoakOptions) -> dict[str, Any]:
    """Starts the topology, runs the soak's calls with the chaos around them, stops the chaos
    (the producer is up again), then the leak check of both engines. The JSON-able summary adds
    `restarts`, `router` outcomes and `internal` (INTERNAL endings, calls and router legs); its
    `passed` also needs no chaos error, no INTERNAL and router outcomes in ROUTER_ACCEPTED."""
    workdir = Path(opts.log_dir) if opts.log_dir else Path(tempfile.mkdtemp(prefix="tandem-disagg-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    soak = opts.soak
    # Calls caught by a producer restart end UNAVAILABLE; the leak check waits for leases to expire.
    soak.also_accepted = tuple(sorted({*soak.also_accepted, "UNAVAILABLE"}))
    soak.unavailable_backoff = soak.unavailable_backoff or 0.25
    soak.idle_timeout = max(soak.idle_timeout, opts.lease_seconds + 10)
    topo = Topology(opts, workdir)
    chaos = Chaos(topo, opts)
    try:
        chaos.start()
        summary = run_soak(topo.frontend, soak, after_calls=chaos.stop)
    finally:
        chaos.stop()
        topo.stop()
        if opts.log_dir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    internal = summary["totals"].get("INTERNAL", 0) + chaos.router.get("INTERNAL", 0)
    router_bad = {k: v for k, v in chaos.router.items() if k not in ROUTER_ACCEPTED}
    summary.update(restarts=topo.restarts, router=dict(chaos.router), router_actions=dict(chaos.actions),
                   router_unexpected=router_bad, chaos_errors=chaos.errors, internal=internal)
    summary["passed"] = summary["passed"] and not chaos.errors and not internal and not router_bad
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem.bench.disagg_soak", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=10_000, help="calls to make")
    p.add_argument("--seconds", type=float, default=None, help="stop starting calls after this long")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=19)
    p.add_argument("--model", default=DisaggSoakOptions.model)
    p.add_argument("--restart-every", type=float, default=DisaggSoakOptions.restart_every)
    p.add_argument("--router-every", type=float, default=DisaggSoakOptions.router_every)
    p.add_argument("--lease-seconds", type=float, default=DisaggSoakOptions.lease_seconds)
    p.add_argument("--log-dir", default=None, help="keep the three processes' logs here")
    p.add_argument("--json", default=None, help="write the summary here")
    a = p.parse_args(argv)
    from tandem.engine_service.dummy_configs import get_dummy_config

    vocab = int(get_dummy_config(a.model.removeprefix("dummy:"))["vocab_size"]) if a.model.startswith("dummy:") \
        else 1000
    soak = SoakOptions(num_requests=a.requests, concurrency=a.concurrency, max_seconds=a.seconds,
                       max_tokens=a.max_tokens, seed=a.seed, vocab_size=vocab)
    summary = run_disagg_soak(DisaggSoakOptions(soak=soak, model=a.model, restart_every=a.restart_every,
                                                router_every=a.router_every, lease_seconds=a.lease_seconds,
                                                log_dir=a.log_dir))
    print("\n".join(short_table({"soak": summary})))
    print(f"producer restarts {summary['restarts']}; router legs {summary['router']} "
          f"({summary['router_actions']}); INTERNAL {summary['internal']}; chaos errors {summary['chaos_errors']}")
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=2))
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
