"""The load generator of `tandem bench serve`: closed-loop streaming clients in one process or
several, and how their connections spread over the frontend's worker processes.

A level is `concurrency` slots. Each slot streams one request at a time and, when it ends,
takes the level's next request (closed loop), so requests start in the level's order wherever a
slot frees up. With P client processes (`--client-procs`) the slots are split over P spawned
processes and the next request index comes from one counter they share, so the loop is the same
as in one process; only its CPU is spread. Every channel is its own TCP connection
(`grpc.use_local_subchannel_pool`: without it, channels of one process to one address share a
single connection). Times are `time.perf_counter()`, which on Linux reads CLOCK_MONOTONIC, one
clock for every process of the machine, so the parent merges the per-request records of all
processes into the statistics of one run, exactly as if one process had recorded them.

Frontend workers (`tandem serve --frontend-workers W`) share the port through SO_REUSEPORT: the
kernel puts each new connection on one listener by a hash of its addresses, so which worker a
connection reaches is chance (and a few connections can easily miss a worker). Before the
level's clock starts, every connection asks which worker it reached (Utility HEALTH answers with
the worker's pid). Slot k of process j is meant for worker (j + k) mod W, and a process dials
until each worker its slots are meant for has its connections; a connection that lands on a
worker already covered is closed and dialled again (at most DIALS_PER_CONNECTION times per
connection needed). The result records per level the connections, requests and output tokens
per worker and whether the spread came out as meant (`frontend_spread`).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import multiprocessing
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.bench.stats import summarize
from tandem.bench.workloads import BenchRequest

STREAMS_PER_CHANNEL = 64
DIALS_PER_CONNECTION = 16
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 16 << 20),
    ("grpc.max_send_message_length", 16 << 20),
    ("grpc.use_local_subchannel_pool", 1),  # one TCP connection per channel
]
READY_TIMEOUT_S = 120.0  # a client process dialling and probing its connections
RESULT_GRACE_S = 60.0  # beyond the level's time limit, for cancelling and sending the records back


def auto_client_procs(cpu_count: int | None = None) -> int:
    """`--client-procs auto`: min(4, cores // 4), at least 1 (the rest of the cores are left to
    the engine process and the frontend workers on the same machine)."""
    cores = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    return max(1, min(4, cores // 4))


@dataclass
class ClientTiming:
    """One streamed request as the client saw it (perf_counter seconds)."""

    start: float
    prompt_len: int
    target_output_len: int
    tokens: int = 0
    chunks: int = 0
    first: float | None = None
    last: float | None = None
    itl: list[float] = field(default_factory=list)
    done: bool = False
    error: str | None = None


def _new_timing(req: BenchRequest) -> ClientTiming:
    return ClientTiming(start=0.0, prompt_len=len(req.prompt_token_ids), target_output_len=req.output_len)


async def _stream_one(stub: Any, rid: str, req: BenchRequest, timing: ClientTiming) -> None:
    import grpc

    from tandem.v1 import common_pb2, frontend_pb2

    msg = frontend_pb2.GenerateRequest(
        request_id=rid,
        prompt_token_ids=req.prompt_token_ids,
        sampling=common_pb2.SamplingParams(max_tokens=req.output_len, temperature=0.0, ignore_eos=True),
    )
    timing.start = time.perf_counter()
    try:
        async for resp in stub.Stream(msg):
            now = time.perf_counter()
            n = sum(len(c.token_ids) for c in resp.choices)
            if not n:
                continue
            if timing.first is None:
                timing.first = now
            else:
                timing.itl.append(now - timing.last)
            timing.last = now
            timing.tokens += n
            timing.chunks += 1
        timing.done = True
    except grpc.aio.AioRpcError as exc:
        timing.error = f"{exc.code().name}: {exc.details()}"


# -- connections and the frontend workers they reach ----------------------------------------------


def plan_slots(concurrency: int, procs: int, worker_pids: Sequence[int]) -> list[list[int | None]]:
    """Per client process, the worker each of its slots is meant for (None: any worker).
    Slots go round-robin over the processes; slot k of process j is meant for worker
    (j + k) mod W, so each process covers every worker and each worker gets ~concurrency / W."""
    procs = max(1, min(procs, concurrency))
    counts = [concurrency // procs + (1 if j < concurrency % procs else 0) for j in range(procs)]
    if not worker_pids:
        return [[None] * n for n in counts]
    w = len(worker_pids)
    return [[worker_pids[(j + k) % w] for k in range(n)] for j, n in enumerate(counts)]


def probe_worker_pid_sync(address: str, tag: int, timeout: float = 5.0) -> tuple[int | None, bool]:
    """(pid, serving) of the frontend worker that a new connection to `address` reaches."""
    import grpc

    from tandem.v1 import common_pb2, frontend_pb2_grpc

    channel = grpc.insecure_channel(address, options=[*CHANNEL_OPTIONS, ("tandem.bench.probe", tag)])
    try:
        # STATS names the worker (health says only SERVING/NOT_SERVING to unauthenticated callers);
        # a worker that answers STATS has its engines and tokenizer, so it serves.
        resp = frontend_pb2_grpc.FrontendStub(channel).Utility(
            common_pb2.UtilityRequest(command=common_pb2.UTILITY_COMMAND_STATS), timeout=timeout)
        return int(resp.result["frontend"]["pid"]), True
    except grpc.RpcError:
        return None, False
    finally:
        channel.close()


async def _worker_pid(stub: Any) -> int | None:
    import grpc

    from tandem.v1 import common_pb2

    try:
        resp = await stub.Utility(common_pb2.UtilityRequest(command=common_pb2.UTILITY_COMMAND_STATS), timeout=30)
        return int(resp.result["frontend"]["pid"])
    except grpc.aio.AioRpcError:
        return None


@dataclass
class _Connection:
    channel: Any
    stub: Any
    pid: int | None  # the frontend worker it reached (None: the probe failed)
    meant: int | None  # the worker it was dialled for (None: any)


async def _connect(address: str, needs: dict[int | None, int]) -> tuple[list[_Connection], bool]:
    """Connections until every worker in `needs` has its count (None: any worker), and whether
    that worked out; a worker not reached within the dial budget gets whatever connections come."""
    import grpc

    from tandem.v1 import frontend_pb2_grpc

    dials = itertools.count(1)

    async def dial(meant: int | None = None) -> _Connection:
        channel = grpc.aio.insecure_channel(address, options=[*CHANNEL_OPTIONS, ("tandem.bench.connection", next(dials))])
        stub = frontend_pb2_grpc.FrontendStub(channel)
        return _Connection(channel, stub, await _worker_pid(stub), meant)

    missing = {k: v for k, v in needs.items() if v > 0}
    conns: list[_Connection] = []
    budget = DIALS_PER_CONNECTION * sum(missing.values())
    while missing and budget > 0:
        budget -= 1
        conn = await dial()
        meant = conn.pid if conn.pid in missing else (None if None in missing else -1)
        if meant == -1:  # a worker already covered: try another connection
            await conn.channel.close()
            continue
        conn.meant = meant
        conns.append(conn)
        missing[meant] -= 1
        if not missing[meant]:
            del missing[meant]
    balanced = not missing
    for meant, n in missing.items():  # a worker not reached: its slots use whatever comes
        conns += [await dial(meant) for _ in range(n)]
    return conns, balanced


def _connections_needed(slot_workers: Sequence[int | None]) -> dict[int | None, int]:
    return {w: math.ceil(n / STREAMS_PER_CHANNEL) for w, n in Counter(slot_workers).items()}


def _slot_connections(slot_workers: Sequence[int | None], conns: list[_Connection]) -> list[int]:
    """Connection index of each slot: round-robin over the connections meant for its worker."""
    by_worker: dict[int | None, list[int]] = {}
    for i, c in enumerate(conns):
        by_worker.setdefault(c.meant, []).append(i)
    seen: Counter = Counter()
    out = []
    for w in slot_workers:
        mine = by_worker[w]
        out.append(mine[seen[w] % len(mine)])
        seen[w] += 1
    return out


# -- one process's share of a level -----------------------------------------------------------------


@dataclass
class ShareResult:
    """What one client process saw of a level: its requests' records by index into the level."""

    timings: dict[int, ClientTiming]
    request_worker: dict[int, int | None]  # request index -> the frontend worker that served it
    connection_workers: list[int | None]
    balanced: bool
    start: float
    end: float
    cpu_s: float
    timed_out: bool


async def run_share(address: str, requests: Sequence[BenchRequest], slot_workers: Sequence[int | None],
                    seconds: float, prefix: str, take: Callable[[], int],
                    before_start: Callable[[], None] | None = None) -> ShareResult:
    """Connects, then runs `len(slot_workers)` slots until `take()` runs past the requests or
    `seconds` pass. `before_start` runs once connected, before the clock starts."""
    conns, balanced = await _connect(address, _connections_needed(slot_workers))
    slot_conn = _slot_connections(slot_workers, conns)
    timings: dict[int, ClientTiming] = {}
    request_worker: dict[int, int | None] = {}

    async def slot(k: int) -> None:
        conn = conns[slot_conn[k]]
        while (i := take()) < len(requests):
            timings[i] = t = _new_timing(requests[i])
            request_worker[i] = conn.pid
            await _stream_one(conn.stub, f"{prefix}-{i}", requests[i], t)

    try:
        if before_start is not None:
            before_start()
        cpu0, start = time.process_time(), time.perf_counter()
        tasks = [asyncio.create_task(slot(k)) for k in range(len(slot_workers))]
        _, pending = await asyncio.wait(tasks, timeout=max(seconds, 0.1))
        timed_out = bool(pending)
        for t in pending:
            t.cancel()  # cancels the gRPC call: the frontend aborts the request in the engine
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        ends = [t.last for t in timings.values() if t.done and t.last is not None]
        end = time.perf_counter() if timed_out or not ends else max(ends)
        cpu = time.process_time() - cpu0
    finally:
        for c in conns:
            await c.channel.close()
    return ShareResult(timings, request_worker, [c.pid for c in conns], balanced, start, end, cpu, timed_out)


# -- several client processes ----------------------------------------------------------------------


def _take_from(counter: Any) -> Callable[[], int]:
    def take() -> int:
        with counter.get_lock():
            i = counter.value
            counter.value = i + 1
        return i

    return take


def _client_process_main(conn: Any, address: str, counter: Any) -> None:
    """A spawned client process: runs one level share per job until told to stop."""
    take = _take_from(counter)
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        requests, slot_workers, seconds, prefix = job

        def ready_then_wait_go() -> None:
            conn.send(("ready", None))
            if conn.recv() != "go":
                raise RuntimeError("the level was called off before it started")

        try:
            result = asyncio.run(run_share(address, requests, slot_workers, seconds, prefix, take, ready_then_wait_go))
            conn.send(("done", result))
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which records it
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class ClientProcesses:
    """P load-generator processes for a whole run (spawned once: nothing of the parent's gRPC or
    torch state is inherited); each level is one job per process that has slots in it."""

    def __init__(self, address: str, procs: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.counter = ctx.Value("q", 0)
        self.procs, self.pipes = [], []
        for j in range(procs):
            parent_end, child_end = ctx.Pipe()
            p = ctx.Process(target=_client_process_main, args=(child_end, address, self.counter),
                            name=f"tandem-bench-client-{j}", daemon=True)
            p.start()
            child_end.close()
            self.procs.append(p)
            self.pipes.append(parent_end)

    def __len__(self) -> int:
        return len(self.procs)

    @staticmethod
    def _receive(pipe: Any, timeout: float) -> tuple[str, Any]:
        try:
            if pipe.poll(timeout):
                return pipe.recv()
            return "error", f"no answer within {timeout:.0f}s"
        except (EOFError, OSError) as exc:
            return "error", f"client process ended: {exc!r}"

    def run_level(self, requests: Sequence[BenchRequest], plans: list[list[int | None]], seconds: float,
                  prefix: str) -> tuple[list[ShareResult], list[str]]:
        """Runs one level over the processes (plan j on process j); their results and errors."""
        self.counter.value = 0
        used = list(zip(self.pipes, plans))
        for pipe, plan in used:
            pipe.send((list(requests), plan, seconds, prefix))
        errors, ready = [], []
        for pipe, _ in used:
            kind, payload = self._receive(pipe, READY_TIMEOUT_S)
            if kind == "ready":
                ready.append(pipe)
            else:
                errors.append(str(payload))
        for pipe in ready:
            pipe.send("go")
        results = []
        for pipe in ready:
            kind, payload = self._receive(pipe, seconds + RESULT_GRACE_S)
            if kind == "done":
                results.append(payload)
            else:
                errors.append(str(payload))
        return results, errors

    def close(self, timeout: float = 10.0) -> None:
        for pipe in self.pipes:
            try:
                pipe.send(None)
            except (OSError, ValueError):
                pass
        for p in self.procs:
            p.join(timeout)
            if p.is_alive():
                p.kill()
                p.join()
        for pipe in self.pipes:
            pipe.close()


# -- one level, merged -----------------------------------------------------------------------------


def run_level(address: str, requests: Sequence[BenchRequest], concurrency: int, seconds: float,
              prefix: str = "bench", worker_pids: Sequence[int] = (),
              clients: ClientProcesses | None = None) -> dict[str, Any]:
    """Drive one concurrency level to completion (or `seconds`) from this process, or from the
    client processes when given; its summary over the merged per-request records."""
    plans = plan_slots(concurrency, len(clients) if clients is not None else 1, worker_pids)
    if clients is None:
        results = [asyncio.run(run_share(address, requests, plans[0], seconds, prefix, itertools.count().__next__))]
        errors: list[str] = []
    else:
        results, errors = clients.run_level(requests, plans, seconds, prefix)
    return merge_shares(requests, results, errors, concurrency, len(plans), len(worker_pids))


def merge_shares(requests: Sequence[BenchRequest], results: list[ShareResult], errors: list[str], concurrency: int,
                 procs: int, workers: int) -> dict[str, Any]:
    """One level's summary from the client processes' records: every request in level order
    (those no process started count as not started), elapsed from the first start to the last end."""
    timings = [_new_timing(r) for r in requests]
    request_worker: dict[int, int | None] = {}
    for res in results:
        for i, t in res.timings.items():
            timings[i] = t
        request_worker.update(res.request_worker)
    if results:
        elapsed = max(r.end for r in results) - min(r.start for r in results)
    else:
        elapsed = 0.0
    timed_out = any(r.timed_out for r in results)
    summary = summarize_client(timings, elapsed, [r.cpu_s for r in results], timed_out, concurrency)
    summary["client_procs"] = procs
    if errors:
        summary["client_errors"] = errors
    summary["frontend_spread"] = _spread(timings, request_worker, results, workers)
    return summary


def _spread(timings: list[ClientTiming], request_worker: dict[int, int | None], results: list[ShareResult],
            workers: int) -> dict[str, Any]:
    def key(pid: int | None) -> str:
        return "unknown" if pid is None else str(pid)

    conns: Counter = Counter(key(p) for r in results for p in r.connection_workers)
    reqs: Counter = Counter(key(p) for p in request_worker.values())
    tokens: Counter = Counter()
    for i, pid in request_worker.items():
        tokens[key(pid)] += timings[i].tokens
    return {
        "frontend_workers": workers,
        "workers_used": len([k for k in reqs if k != "unknown"]),
        "balanced": all(r.balanced for r in results),
        "connections": sum(conns.values()),
        "connections_per_worker": dict(conns),
        "requests_per_worker": dict(reqs),
        "output_tokens_per_worker": dict(tokens),
    }


def summarize_client(timings: list[ClientTiming], elapsed: float, cpu_per_proc: list[float], timed_out: bool,
                     concurrency: int) -> dict[str, Any]:
    """Latency percentiles and throughput of one level, from the client's clock."""
    done = [t for t in timings if t.done]
    started = [t for t in timings if t.start > 0]
    tokens = sum(t.tokens for t in timings)
    el = max(elapsed, 1e-9)
    tpot = [(t.last - t.first) / (t.tokens - 1) for t in done if t.tokens > 1]
    errors = [t.error for t in timings if t.error]
    return {
        "concurrency": concurrency,
        "num_requests": len(timings),
        "started": len(started),
        "completed": len(done),
        "failed": len(errors),
        "errors": errors[:5],
        "timed_out": timed_out,
        "elapsed_s": elapsed,
        "input_tokens": sum(t.prompt_len for t in timings if t.tokens > 0),
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / el,
        "requests_per_s": len(done) / el,
        "ttft_ms": summarize([t.first - t.start for t in done if t.first is not None], 1e3),
        "tpot_ms": summarize(tpot, 1e3),
        "itl_ms": summarize([x for t in done for x in t.itl], 1e3),
        "e2e_ms": summarize([t.last - t.start for t in done if t.last is not None], 1e3),
        "tokens_per_message": (sum(t.tokens for t in done) / max(sum(t.chunks for t in done), 1)) if done else None,
        "requests_not_at_target_length": sum(1 for t in done if t.tokens != t.target_output_len),
        "client_cpu_s": sum(cpu_per_proc),  # all client processes together
        # The busiest client process's share of one core: near 1.0 that process, not the
        # server, is the bottleneck.
        "client_cpu_fraction": max(cpu_per_proc, default=0.0) / el,
    }
