"""`tandem bench serve`: the whole path (client -> frontend -> engine over gRPC) against the
in-process engine on the same requests.

1. `tandem serve` starts as a subprocess on free loopback ports with the model under test.
   Dummy models have no tokenizer, so unless one is given a word-level tokenizer covering the
   model's vocabulary is written to a temporary directory (token i <-> "t<i>"): the frontend
   then detokenizes every generated id, as it would for a real model.
2. An asyncio client keeps `concurrency` `Stream` calls in flight (closed loop: a new request
   starts when one ends) with pre-tokenized prompts, greedy, ignore_eos, max_tokens = the
   request's output length. Per request: TTFT (call start -> first token), TPOT ((last - first)
   / (tokens - 1)), ITL (gaps between messages that carry tokens; a message may carry several
   coalesced tokens), end-to-end latency. With `client_procs` > 1 the same loop runs in that
   many processes and their records are merged (`serve_client.py`); with `frontend_workers` > 1
   the served stack runs that many frontend processes on its port, and the client spreads its
   connections over them.
   With `also_stacks`, further served stacks (engine core process/thread, transport, frontend
   workers) run the same levels in the same call, one `tandem serve` after another; their
   figures go under each level's `served_stacks[<label>]` beside the primary stack's `served`,
   so old and new stacks are compared on one host in one lease.
3. After the servers stop, the same requests run through an in-process `LLMEngine` at the
   same concurrency (`engine_run.py`). ratio = gRPC output tok/s / in-process output tok/s;
   the gRPC TTFT overhead at concurrency 1 = served p50 TTFT - in-process p50 TTFT.
4. With `rounds` N > 1, every side (each served stack, the in-process engine) starts once and
   stays alive for the whole run; each round runs every level on every side, the order
   reversed from one round to the next, on a slice of the workload of its own; each side's
   figure per level is the median over the rounds, the ratio is the ratio of the medians,
   with the per-round paired ratios' median, min and max beside it (`serve_rounds.py` says
   which metrics, how the budget is shared and which rounds count). Every side's engine is on
   the device at once, so on a GPU `--num-kv-blocks` is required (the same for every side).
   One round is the special case of the same path: the run described in 1-3.

Each concurrency level uses its own slice of the workload, so no level hits the prefix cache
with another level's prompts.

Side objects (`_ServedSide`, `_InProcessSide`) share one shape: `open(deadline) -> bool` (start
and warm up), `run_level(requests, concurrency, budget, prefix) -> figures`, `close()` (safe to
call twice); `field` / `label` say where their figures go, `name` is their side name in
`serve_rounds`.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from tandem.bench.results import BenchRecord, Deadline
from tandem.bench.serve_client import ClientProcesses, auto_client_procs, probe_worker_pid_sync, run_level
from tandem.bench.serve_rounds import (IN_PROCESS, level_fraction, round_order, round_slices, schedule, served_name,
                                       summarize_level_rounds)
from tandem.bench.workloads import BenchRequest, make_workload, warmup_prompt_lens, warmup_requests
from tandem.wordlevel_tokenizer import write_wordlevel_tokenizer

log = structlog.get_logger(__name__)

FRONTEND_SERVICE = "tandem.v1.Frontend"
WORKERS_TIMEOUT_S = 120.0  # after the first frontend worker serves, for the others to answer


@dataclass
class ServeOptions:
    """Levels, their sizes and time limits."""

    workload: str = "nanovllm"
    scale: float = 1.0
    concurrencies: list[int] = field(default_factory=lambda: [1, 16, 64, 256])
    requests_per_level: int | None = None  # None: max(2 x concurrency, 16)
    level_seconds: float = 60.0
    startup_timeout: float = 600.0
    tokenizer: str | None = None
    in_process: bool = True
    warmup_requests: int = 32
    engine_transport: str = "stream"  # frontend-engine transport of the served side
    frontend_workers: int = 1  # `tandem serve --frontend-workers`
    client_procs: int | str = 1  # load-generator processes, or "auto" (auto_client_procs())
    engine_core: str = "process"  # `tandem serve --engine-core` of the primary stack
    also_stacks: list[dict[str, Any]] = field(default_factory=list)  # further stacks: stack_spec() dicts
    rounds: int = 1  # > 1: every side alive throughout, sides alternating per round (serve_rounds.py)

    def resolved_client_procs(self) -> int:
        return auto_client_procs() if self.client_procs == "auto" else max(1, int(self.client_procs))

    def level_sizes(self) -> list[int]:
        if self.requests_per_level is not None:
            return [self.requests_per_level for _ in self.concurrencies]
        return [max(2 * c, 16) for c in self.concurrencies]


def stack_spec(text: str) -> dict[str, Any]:
    """`CORE:TRANSPORT:WORKERS` (e.g. `thread:stream:1`) as a served-stack dict; raises ValueError."""
    parts = text.split(":")
    if len(parts) != 3 or parts[0] not in ("process", "thread") or parts[1] not in ("stream", "mux"):
        raise ValueError(f"expected CORE:TRANSPORT:WORKERS with CORE process|thread and TRANSPORT stream|mux, got {text!r}")
    workers = int(parts[2])
    if workers < 1:
        raise ValueError(f"frontend workers must be >= 1, got {text!r}")
    return {"engine_core": parts[0], "engine_transport": parts[1], "frontend_workers": workers}


def stack_label(stack: dict[str, Any]) -> str:
    return f"{stack['engine_core']}:{stack['engine_transport']}:{stack['frontend_workers']}"


# -- tokenizer and server ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`tandem serve` in a subprocess on loopback ports; its log goes to a file."""

    def __init__(self, extra_args: list[str], log_path: Path) -> None:
        self.port, self.engine_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "ab")
        env = {**os.environ, "TANDEM_LOG_LEVEL": os.environ.get("TANDEM_LOG_LEVEL", "warning")}
        self.argv = [sys.executable, "-P", "-m", "tandem.cli", "serve", "--host", "127.0.0.1",
                     "--port", str(self.port), "--engine-port", str(self.engine_port), "--drain-timeout", "5",
                     *extra_args]
        # -P: the working directory must not shadow the installed packages.
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=self._log, env=env, cwd="/")

    def wait_serving(self, timeout: float) -> float:
        """Seconds until the frontend's health check says SERVING; raises with the log's tail."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        start = time.monotonic()
        channel = grpc.insecure_channel(self.address)
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            while time.monotonic() - start < timeout:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"tandem serve exited with {self.proc.returncode}: {self.log_tail()}")
                try:
                    r = stub.Check(health_pb2.HealthCheckRequest(service=FRONTEND_SERVICE), timeout=1.0)
                    if r.status == health_pb2.HealthCheckResponse.SERVING:
                        return time.monotonic() - start
                except grpc.RpcError:
                    pass
                time.sleep(0.25)
        finally:
            channel.close()
        raise TimeoutError(f"tandem serve not serving after {timeout:.0f}s: {self.log_tail()}")

    def wait_workers(self, count: int, timeout: float) -> list[int]:
        """The pids of the frontend workers reached on new connections, until `count` of them
        answer SERVING or `timeout` passes (extra workers listen only once ready, so right after
        the first worker serves, every connection still reaches it)."""
        start, pids, tag = time.monotonic(), set(), 0
        while len(pids) < count and time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tandem serve exited with {self.proc.returncode}: {self.log_tail()}")
            tag += 1
            pid, serving = probe_worker_pid_sync(self.address, tag)
            if pid is not None and serving:
                pids.add(pid)
            else:
                time.sleep(0.1)
        return sorted(pids)

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


# -- the benchmark ---------------------------------------------------------------------------------


def run_serve(record: BenchRecord, engine_config: Any, engine_flags: list[str], options: ServeOptions,
              deadline: Deadline, log_dir: Path | None = None) -> None:
    """Fill `record.results["levels"]` with served and in-process figures per concurrency (with
    `options.rounds` > 1: per round under `level["rounds"]`, medians in the level; serve_rounds.py)."""
    from tandem.engine_service.worker.loader import read_eos_token_ids, resolve_model
    from tandem.engine_service.worker.model_runner import resolve_device

    if options.rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {options.rounds}")
    if options.rounds > 1 and engine_config.cache.num_blocks is None \
            and resolve_device(engine_config.model.device).type == "cuda":
        raise ValueError("--rounds > 1 keeps every side's engine on the device at once: pass --num-kv-blocks, "
                         "or both would size their KV pools from the same free memory")
    res = record.results
    res["options"] = dict(vars(options))
    # The served stack's shape, read by `tandem bench report` (runs without it: stream, 1, 1).
    primary = {"engine_core": options.engine_core, "engine_transport": options.engine_transport,
               "frontend_workers": options.frontend_workers}
    res["served_stack"] = {**primary,
                           "client_procs": options.resolved_client_procs(),
                           "client_procs_requested": options.client_procs}
    res["also_stacks"] = [{**st, "label": stack_label(st)} for st in options.also_stacks]
    resolved = resolve_model(engine_config.model.model, engine_config.model.cache_dir)
    vocab = int(resolved.config["vocab_size"])
    max_len = engine_config.model.max_model_len or resolved.config.get("max_position_embeddings")
    sizes = options.level_sizes()
    workload = make_workload(options.workload, vocab, options.rounds * sum(sizes), options.scale,
                             max_model_len=max_len)
    res["workload"] = workload.describe()
    slices = round_slices(workload.requests, sizes, options.rounds)
    levels: list[dict[str, Any]] = [{"concurrency": c, "num_requests": n} for c, n in zip(options.concurrencies, sizes)]
    res["levels"] = levels
    # Every side warms up on the same short requests whose prompts span the workload's lengths,
    # all at once: Triton compiles each new prefill shape on first use (about a second),
    # and whichever side met a shape first would otherwise pay for the others (its on-disk cache).
    # As many as the highest level runs at once, so the batch shapes of every level are met too.
    # Then one pass per level at that level's concurrency: arrivals staggered by finishing
    # requests give the mixed prefill + decode steps of the measured run, whose kernel shapes
    # the all-at-once pass does not meet (without these passes the first measured level of the
    # first side pays a compile stall of ~1.7 s in its TTFT; bench/NOTES.md).
    lens = warmup_prompt_lens(workload.requests)
    warm: list[tuple[list[BenchRequest], int]] = [
        (warmup_requests(vocab, max(options.warmup_requests, max(options.concurrencies)), lens), 0)]
    warm += [(warmup_requests(vocab, 2 * c, lens, output_len=16, seed=i + 1), c)
             for i, c in enumerate(sorted(set(options.concurrencies)))]

    tmp = Path(tempfile.mkdtemp(prefix="tandem-bench-serve-"))
    try:
        tokenizer = options.tokenizer
        if tokenizer is None and resolved.path is not None:
            tokenizer = resolved.path
        if tokenizer is None:
            eos = read_eos_token_ids(resolved)
            tokenizer = str(write_wordlevel_tokenizer(tmp / "tokenizer", vocab, eos[0] if eos else None, max_len))
            res["tokenizer"] = "word-level stand-in (token i <-> 't<i>') covering the model's vocabulary"
        else:
            res["tokenizer"] = tokenizer
        sides: dict[str, Any] = {}
        for stack in [primary, *options.also_stacks]:
            serve_args = engine_flags + ["--tokenizer", tokenizer, "--engine-transport", stack["engine_transport"],
                                         "--frontend-workers", str(stack["frontend_workers"]),
                                         "--engine-core", stack["engine_core"]]
            label = None if stack is primary else stack_label(stack)
            sides[served_name(label)] = _ServedSide(record, serve_args, stack, label, warm, options,
                                                    Path(log_dir or tmp))
        if options.in_process:
            sides[IN_PROCESS] = _InProcessSide(record, engine_config, warm, options)
        if options.rounds > 1:
            for level in levels:
                level["rounds"] = [{"round": r, "order": round_order(list(sides), r)} for r in range(options.rounds)]
            res["rounds"] = []
        _run_schedule(record, sides, slices, options, deadline)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _compare(res)


def _slot(level: dict[str, Any], side: str, label: str | None) -> dict[str, Any]:
    """Where a level's figures for `side` go: the level itself, or its served_stacks[label]."""
    return level if label is None else level.setdefault("served_stacks", {}).setdefault(label, {})


def _run_schedule(record: BenchRecord, sides: dict[str, Any], slices: list[list[list[BenchRequest]]],
                  options: ServeOptions, deadline: Deadline) -> None:
    """Runs `schedule(sides, rounds)`: opens, rounds of levels, closes. A side that failed to open
    runs no level; every side opened is closed, also when a step raises."""
    res = record.results
    names = list(sides)
    opened: list[str] = []
    usable: set[str] = set()
    round_deadline: dict[int, Deadline] = {}
    round_start: dict[int, float] = {}
    try:
        for step in schedule(names, options.rounds):
            side = sides[step.side]
            if step.action == "open":
                opened.append(step.side)
                if side.open(deadline):
                    usable.add(step.side)
            elif step.action == "close":
                opened.remove(step.side)
                side.close()
            else:
                r = step.round
                if r not in round_deadline:  # the round's share of what is left, when it starts
                    round_deadline[r] = deadline.sub(fraction=1.0 / (options.rounds - r))
                    round_start[r] = time.monotonic()
                    if options.rounds > 1:
                        res["rounds"].append({"round": r, "order": round_order(names, r),
                                              "budget_s": round(round_deadline[r].remaining(), 3)})
                if step.side in usable:
                    fraction = level_fraction(round_order(names, r), step.side)
                    _side_levels(record, side, r, slices[r], round_deadline[r], fraction, options)
                if options.rounds > 1:
                    res["rounds"][r]["seconds"] = round(time.monotonic() - round_start[r], 3)
    finally:
        for name in reversed(opened):
            sides[name].close()


def _side_levels(record: BenchRecord, side: Any, r: int, requests_per_level: list[list[BenchRequest]],
                 round_deadline: Deadline, fraction: float | None, options: ServeOptions) -> None:
    """One side's levels of round `r`, in level order, into the level (one round) or its round
    entry; levels the round's budget has no second left for are marked skipped."""
    rounds = options.rounds
    for level, requests in zip(record.results["levels"], requests_per_level):
        c = level["concurrency"]
        slot = _slot(level if rounds == 1 else level["rounds"][r], side.field, side.label)
        if round_deadline.remaining() < 1.0:
            slot[side.field] = {"status": "skipped", "reason": "time budget (--max-seconds) spent"
                                if rounds == 1 else f"round {r}'s share of the time budget (--max-seconds) spent"}
            record.incomplete = True
            continue
        tag = f"c{c}" if rounds == 1 else f"r{r}_c{c}"
        with record.stage(side.stage_name(tag)):
            budget = round_deadline.sub(seconds=options.level_seconds, fraction=fraction)
            figures = side.run_level(requests, c, budget, prefix=tag.replace("_", ""))
            slot[side.field] = figures
            record.incomplete |= bool(figures.get("timed_out")) or bool(figures.get("client_errors"))
            log.info("serve level", side=side.name, round=r, concurrency=c,
                     output_tok_s=round(figures["output_tokens_per_s"], 1), ttft_p50_ms=figures["ttft_ms"]["p50"])


class _ServedSide:
    """One served stack, from `tandem serve` start to stop: started and warmed up by `open`,
    measured a level at a time by `run_level`, stopped by `close` (which records its exit code).
    The primary (`label` None) records under `res["server"]` and `level["served"]`; another stack
    under `res["servers"][label]` and `level["served_stacks"][label]["served"]`."""

    field = "served"

    def __init__(self, record: BenchRecord, serve_args: list[str], stack: dict[str, Any], label: str | None,
                 warm: list[tuple[list[BenchRequest], int]], options: ServeOptions, log_dir: Path) -> None:
        self.record, self.serve_args, self.stack, self.label = record, serve_args, stack, label
        self.warm, self.options, self.log_dir = warm, options, log_dir
        self.name = served_name(label)
        self.tag = "" if label is None else f"[{label}]"
        self.servers = record.results if label is None else record.results.setdefault("servers", {})
        self.key = "server" if label is None else label
        self.server: ServeProcess | None = None
        self.clients: ClientProcesses | None = None

    def stage_name(self, level_tag: str) -> str:
        return f"serve_{level_tag}{self.tag}"

    def open(self, deadline: Deadline) -> bool:
        """Start the stack, its client processes, and warm it up; False when it cannot serve."""
        record, options, workers = self.record, self.options, self.stack["frontend_workers"]
        with record.stage(f"serve_start{self.tag}"):
            label = self.label
            log_path = self.log_dir / f"tandem-serve{'' if label is None else '-' + label.replace(':', '-')}.log"
            self.server = ServeProcess(self.serve_args, log_path)
            started = time.monotonic()
            startup_s = self.server.wait_serving(min(options.startup_timeout, max(deadline.remaining(), 1.0)))
            # The extra workers load what the first one loaded, so they follow it within seconds.
            pids = self.server.wait_workers(workers, min(WORKERS_TIMEOUT_S, max(deadline.remaining(), 1.0)))
            self.servers[self.key] = {
                "argv": self.server.argv[1:], "startup_s": startup_s, "stack": dict(self.stack),
                "frontend_workers": {"requested": workers, "reached": len(pids), "pids": pids,
                                     "all_listening_s": round(time.monotonic() - started, 3)}}
            if len(pids) < workers:
                log.warning("not every frontend worker answered; the levels use those that did",
                            requested=workers, reached=len(pids))
        if self.server is None or self.key not in self.servers:
            return False
        procs = options.resolved_client_procs()
        if procs > 1:
            with record.stage("client_start"):
                self.clients = ClientProcesses(self.server.address, procs)
            if self.clients is None:
                return False
        with record.stage(f"serve_warmup{self.tag}"):
            t0 = time.perf_counter()
            completed = 0
            for i, (requests, c) in enumerate(self.warm):
                w = run_level(self.server.address, requests, max(c or len(requests), procs),
                              deadline.sub(seconds=options.level_seconds).remaining(), prefix=f"warmup{i}",
                              worker_pids=self._worker_pids(), clients=self.clients)
                completed += w["completed"]
            self.servers[self.key]["warmup"] = {"seconds": round(time.perf_counter() - t0, 3),
                                                "completed": completed, "passes": len(self.warm)}
        return True

    def _worker_pids(self) -> list[int]:
        return self.servers[self.key]["frontend_workers"]["pids"]

    def run_level(self, requests: list[BenchRequest], concurrency: int, budget: Deadline,
                  prefix: str) -> dict[str, Any]:
        """One level through the stack: the client's figures and the engine's own step counters."""
        address = self.server.address
        before = _engine_counters(address)
        served = run_level(address, requests, concurrency, budget.remaining(), prefix=prefix,
                           worker_pids=self._worker_pids(), clients=self.clients)
        served["engine"] = _engine_delta(before, _engine_counters(address), served["elapsed_s"])
        return served

    def close(self) -> None:
        """Stop the client processes and the stack (idempotent)."""
        if self.clients is not None:
            self.clients.close()
            self.clients = None
        if self.server is None:
            return
        rc = self.server.stop()
        info = self.servers.get(self.key)
        if info is not None:
            info["exit_code"] = rc
            if self.record.errors:
                info["log_tail"] = self.server.log_tail()
        self.server = None


def _engine_counters(address: str) -> dict[str, float] | None:
    """The served engine's step and token counters (Utility `stats` through the frontend)."""
    from tandem.client import TandemClient

    try:
        with TandemClient(address) as client:
            engines = client.utility("stats", timeout=10.0)["engines"]
    except Exception as exc:  # noqa: BLE001 - a diagnostic; the level's figures stand without it
        log.warning("engine stats unavailable", error=str(exc))
        return None
    keys = ("steps_total", "generation_tokens_total", "prompt_tokens_total")
    return {k: float(sum(e.get(k, 0) for e in engines.values())) for k in keys}


def _engine_delta(before: dict | None, after: dict | None, elapsed_s: float) -> dict[str, Any] | None:
    """What the engine did during a level: steps, tokens per step and mean wall time per step
    (compare with the in-process level's `steps`: a slower step vs. more, smaller steps)."""
    if before is None or after is None:
        return None
    steps = after["steps_total"] - before["steps_total"]
    out = after["generation_tokens_total"] - before["generation_tokens_total"]
    return {"steps": int(steps), "generation_tokens": int(out),
            "generation_tokens_per_step": round(out / steps, 2) if steps else None,
            "ms_per_step": round(1000.0 * elapsed_s / steps, 3) if steps else None}


class _InProcessSide:
    """The in-process `LLMEngine` on the same requests: built and warmed up by `open`, measured a
    level at a time by `run_level` (prefix cache emptied first), released by `close`."""

    field = IN_PROCESS
    label = None
    name = IN_PROCESS

    def __init__(self, record: BenchRecord, engine_config: Any, warm: list[tuple[list[BenchRequest], int]],
                 options: ServeOptions) -> None:
        self.record, self.engine_config, self.warm, self.options = record, engine_config, warm, options
        self.engine: Any = None

    def stage_name(self, level_tag: str) -> str:
        return f"in_process_{level_tag}"

    def open(self, deadline: Deadline) -> bool:
        from tandem.bench.engine_run import warm_up
        from tandem.engine_service.core.warmup import serving_engine

        with self.record.stage("in_process_build"):
            t0 = time.monotonic()
            self.engine = serving_engine(self.engine_config)  # warmed up as the served core is (CUDA)
            self.record.results["in_process_engine"] = {"build_s": round(time.monotonic() - t0, 2), "warmup": [
                warm_up(self.engine, requests, deadline.sub(seconds=self.options.level_seconds), concurrency=c or None)
                for requests, c in self.warm]}
        return self.engine is not None

    def run_level(self, requests: list[BenchRequest], concurrency: int, budget: Deadline,
                  prefix: str) -> dict[str, Any]:
        from tandem.bench.engine_run import reset_prefix_cache, run_engine

        reset_prefix_cache(self.engine)
        run = run_engine(self.engine, requests, concurrency=concurrency, deadline=budget,
                         record_token_times=True, id_prefix=prefix)
        return {"concurrency": concurrency, **run.summary()}

    def close(self) -> None:
        """Drop the engine and give its device memory back (idempotent)."""
        from tandem.bench.hf_peer import release_device_memory

        if self.engine is None:
            return
        self.engine = None
        release_device_memory()


def _compare(res: dict[str, Any]) -> None:
    """Ratios per level and the gRPC TTFT overhead at concurrency 1, for every served stack; with
    rounds, first each side's medians over the usable rounds (ratio = ratio of the medians)."""
    sides = [served_name(None), *(served_name(st["label"]) for st in res.get("also_stacks", []))]
    if res.get("options", {}).get("in_process", True):
        sides.append(IN_PROCESS)
    for level in res.get("levels", []):
        if "rounds" in level:
            summarize_level_rounds(level, sides)
        p = level.get("in_process", {})
        slots = [(level, res)] + [(slot, res.setdefault("also_stack_overheads", {}).setdefault(label, {}))
                                  for label, slot in level.get("served_stacks", {}).items()]
        for slot, overheads in slots:
            s = slot.get("served", {})
            if s.get("output_tokens_per_s") and p.get("output_tokens_per_s"):
                slot["ratio_output_tokens_per_s"] = s["output_tokens_per_s"] / p["output_tokens_per_s"]
                slot["comparable"] = not (s.get("timed_out") or p.get("timed_out"))
            if level["concurrency"] == 1 and s.get("ttft_ms", {}).get("p50") is not None \
                    and p.get("ttft_ms", {}).get("p50") is not None:
                overheads["grpc_ttft_overhead_ms_c1"] = s["ttft_ms"]["p50"] - p["ttft_ms"]["p50"]


def short_table(results: dict[str, Any]) -> list[str]:
    """Terminal summary: one line per concurrency level."""
    def f(v: Any, spec: str = ".1f") -> str:
        return "-" if v is None else format(v, spec)

    lines = [f"{'conc':>5} {'done':>9} {'TTFT p50/p99 ms':>17} {'TPOT p50 ms':>11} {'ITL p99 ms':>10} "
             f"{'out tok/s':>10} {'in-proc':>10} {'ratio':>6} {'client cpu':>10}"]
    spread_lines = []
    for level in results.get("levels", []):
        s, p = level.get("served", {}), level.get("in_process", {})
        ttft, tpot, itl = s.get("ttft_ms", {}), s.get("tpot_ms", {}), s.get("itl_ms", {})
        done = f"{s.get('completed', 0)}/{level['num_requests']}"
        lines.append(f"{level['concurrency']:>5} {done:>9} {f(ttft.get('p50')) + '/' + f(ttft.get('p99')):>17} "
                     f"{f(tpot.get('p50'), '.2f'):>11} {f(itl.get('p99'), '.2f'):>10} "
                     f"{f(s.get('output_tokens_per_s')):>10} {f(p.get('output_tokens_per_s')):>10} "
                     f"{f(level.get('ratio_output_tokens_per_s'), '.2f'):>6} {f(s.get('client_cpu_fraction'), '.2f'):>10}")
        spread = s.get("frontend_spread") or {}
        if spread.get("frontend_workers", 1) > 1:
            per = "/".join(str(n) for n in spread.get("requests_per_worker", {}).values())
            spread_lines.append(f"  c{level['concurrency']}: requests per frontend worker {per}"
                                f"{'' if spread.get('balanced') else ' (connections not spread as meant)'}")
    for st in results.get("also_stacks", []):
        label = st["label"]
        lines.append(f"  stack {label} (engine core : transport : frontend workers):")
        for level in results.get("levels", []):
            slot = level.get("served_stacks", {}).get(label, {})
            s = slot.get("served", {})
            ttft = s.get("ttft_ms", {})
            done = f"{s.get('completed', 0)}/{level['num_requests']}"
            lines.append(f"{level['concurrency']:>5} {done:>9} {f(ttft.get('p50')) + '/' + f(ttft.get('p99')):>17} "
                         f"{f(s.get('tpot_ms', {}).get('p50'), '.2f'):>11} {f(s.get('itl_ms', {}).get('p99'), '.2f'):>10} "
                         f"{f(s.get('output_tokens_per_s')):>10} {f(level.get('in_process', {}).get('output_tokens_per_s')):>10} "
                         f"{f(slot.get('ratio_output_tokens_per_s'), '.2f'):>6} {f(s.get('client_cpu_fraction'), '.2f'):>10}")
        over = results.get("also_stack_overheads", {}).get(label, {}).get("grpc_ttft_overhead_ms_c1")
        if over is not None:
            lines.append(f"  stack {label}: TTFT overhead at concurrency 1: {over:.2f} ms (p50)")
    stack = results.get("served_stack") or {}
    if stack:
        lines.append(f"primary stack: engine core {stack.get('engine_core', 'thread')}, transport "
                     f"{stack.get('engine_transport')}, {stack.get('frontend_workers')} frontend worker(s), "
                     f"{stack.get('client_procs')} client process(es); client cpu = busiest client process")
    lines += spread_lines
    lines += _rounds_lines(results)
    if "grpc_ttft_overhead_ms_c1" in results:
        lines.append(f"gRPC + frontend TTFT overhead at concurrency 1: {results['grpc_ttft_overhead_ms_c1']:.2f} ms (p50)")
    return lines


def _rounds_lines(results: dict[str, Any]) -> list[str]:
    """With rounds: per level and served stack, the per-round paired ratios (and which side ran
    first), their median and range, and the rounds left out of the medians."""
    rounds = (results.get("options") or {}).get("rounds", 1)
    if rounds <= 1:
        return []
    lines = [f"{rounds} rounds, sides alternating; table figures = per-metric medians over the usable rounds, "
             f"ratio = ratio of the output tok/s medians"]
    labels = [None, *(st["label"] for st in results.get("also_stacks", []))]
    for level in results.get("levels", []):
        for label in labels:
            spread = _peek(level, label).get("ratio_rounds")
            per_round = []
            for entry in level.get("rounds", []):
                ratio = _peek(entry, label).get("ratio_output_tokens_per_s")
                first = entry["order"][0].replace("_", "-")
                per_round.append(f"r{entry['round']} {'-' if ratio is None else format(ratio, '.3f')} ({first} first)")
            head = f"  c{level['concurrency']}{'' if label is None else ' ' + label}: "
            summary = "no usable round" if not spread else (
                f"median {spread['median']:.3f}, min {spread['min']:.3f}, max {spread['max']:.3f} "
                f"over {len(spread['values'])}")
            lines.append(head + ", ".join(per_round) + f"; {summary}")
        cut = [f"r{e['round']} ({', '.join(f'{k}: {v}' for k, v in e['cut_short'].items())})"
               for e in level.get("rounds", []) if e.get("cut_short")]
        if cut:
            lines.append(f"  c{level['concurrency']}: left out of the medians: {'; '.join(cut)}")
    return lines


def _peek(level: dict[str, Any], label: str | None) -> dict[str, Any]:
    """`_slot(level, "served", label)` for reading: never adds a served_stacks entry."""
    return level if label is None else (level.get("served_stacks") or {}).get(label) or {}

