"""CPU time per request of a real `tandem serve`, tracing off and on (--otlp-endpoint).

Starts `tandem serve` (the embedded model, one frontend worker, the default mux transport) once
without and once with `--otlp-endpoint` pointing at an OTLP receiver in this process, sends the
same requests (`--concurrency` at a time, a client `traceparent`, `max_tokens` 1, so the engine core's work is
small and alike), and reads the CPU time (user + system, from /proc via psutil) the frontend
process and the engine's gRPC process spent over them, including a wait of one export interval
afterwards so the spans' export is counted, less what the idle processes spend in as long (health
checks, load polls, timers). CPU time depends less than latency on what else the machine runs, so
the difference between the two runs estimates the tracing's cost per request.

    python bench/probes/tracing_served_probe.py [--requests 400] [--concurrency 8] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import time
from concurrent import futures

import grpc
import psutil
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

from tandem.client import TandemClient
from tracing_probe import SpanCounter  # this folder is the script's own: first on sys.path

EXPORT_WAIT_S = 1.5  # OTEL_BSP_SCHEDULE_DELAY is set to 500 ms below: every span is out by then
IDLE_WINDOW_S = 10.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu(procs: list[psutil.Process]) -> list[float]:
    return [sum(p.cpu_times()[:2]) for p in procs]


def run(requests: int, concurrency: int, endpoint: str | None) -> dict:
    port, eport = _free_port(), _free_port()
    argv = [sys.executable, "-P", "-m", "tandem.cli", "--log-level", "warning", "serve", "--host", "127.0.0.1",
            "--port", str(port), "--engine-port", str(eport), "--frontend-workers", "1"]
    if endpoint:
        argv += ["--otlp-endpoint", endpoint]
    serve = subprocess.Popen(argv, env={**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "500"}, cwd="/")
    try:
        with TandemClient(f"127.0.0.1:{port}", metadata=[("traceparent", "00-%s-%s-01" % (
                secrets.token_hex(16), secrets.token_hex(8)))]) as client:
            client.wait_ready(600, progress=None)
            frontend = psutil.Process(serve.pid)
            engine = next(c for c in frontend.children() if "engine" in c.cmdline())
            ask = dict(max_tokens=1, temperature=0.0, ignore_eos=True)
            for _ in range(20):
                client.generate("Hello there, how are you?", **ask)
            time.sleep(EXPORT_WAIT_S)
            # The idle processes' own CPU rate (health checks, load polls, timers), subtracted
            # below for the measured interval's length.
            idle, t = _cpu([frontend, engine]), time.perf_counter()
            time.sleep(IDLE_WINDOW_S)
            idle_rate = [(b - a) / (time.perf_counter() - t) for a, b in zip(idle, _cpu([frontend, engine]))]
            before, start = _cpu([frontend, engine]), time.perf_counter()
            def one(_) -> float:
                t = time.perf_counter()
                client.generate("Hello there, how are you?", **ask)
                return time.perf_counter() - t

            # Concurrent requests: more of them per second of wall time, so the processes'
            # time-bound background work weighs less per request.
            with futures.ThreadPoolExecutor(concurrency) as pool:
                latencies = list(pool.map(one, range(requests)))
            time.sleep(EXPORT_WAIT_S)
            after, elapsed = _cpu([frontend, engine]), time.perf_counter() - start
        spent = [(b - a - rate * elapsed) / requests * 1e6 for a, b, rate in zip(before, after, idle_rate)]
        return {"frontend_us": spent[0], "engine_grpc_us": spent[1],
                "median_latency_ms": statistics.median(latencies) * 1e3}
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(120)
        except subprocess.TimeoutExpired:
            serve.kill()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    sink = SpanCounter()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    otlp = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print("| round | tracing | frontend CPU us/req | engine gRPC process CPU us/req | median latency ms |")
    print("|---|---|---|---|---|")
    for r in range(args.rounds):
        for mode, endpoint in (("off", None), ("on", f"http://127.0.0.1:{otlp}")):
            res = run(args.requests, args.concurrency, endpoint)
            print(f"| {r + 1} | {mode} | {res['frontend_us']:.0f} | {res['engine_grpc_us']:.0f} | "
                  f"{res['median_latency_ms']:.2f} |", flush=True)
    server.stop(0)
    print(f"spans received: {sink.spans}")


if __name__ == "__main__":
    main()
