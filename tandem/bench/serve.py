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

Each concurrency level uses its own slice of the workload, so no level hits the prefix cache
with another level's prompts.
"""

from __future__ import annotations

import json
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
from tandem.bench.workloads import BenchRequest, make_workload, warmup_prompt_lens, warmup_requests

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


def write_wordlevel_tokenizer(directory: str | Path, vocab_size: int, eos_token_id: int | None,
                              max_model_len: int | None) -> Path:
    """A tokenizer for a model without one: token i <-> the word "t<i>", words split on spaces."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0"}
    if eos_token_id is not None:
        config["eos_token"] = f"t{eos_token_id}"
    if max_model_len:
        config["model_max_length"] = max_model_len
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


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
    """Fill `record.results["levels"]` with served and in-process figures per concurrency."""
    from tandem.engine_service.loader import read_eos_token_ids, resolve_model

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
    workload = make_workload(options.workload, vocab, sum(sizes), options.scale, max_model_len=max_len)
    res["workload"] = workload.describe()
    slices, start = [], 0
    for n in sizes:
        slices.append(workload.requests[start : start + n])
        start += n
    levels: list[dict[str, Any]] = [{"concurrency": c, "num_requests": n} for c, n in zip(options.concurrencies, sizes)]
    res["levels"] = levels
    # Every side warms up on the same short requests whose prompts span the workload's lengths,
    # all at once: Triton compiles each new prefill shape on first use (about a second),
    # and whichever side met a shape first would otherwise pay for the others (its on-disk cache).
    # As many as the highest level runs at once, so the batch shapes of every level are met too.
    # Then one pass per level at that level's concurrency: arrivals staggered by finishing
    # requests give the mixed prefill + decode steps of the measured run, whose kernel shapes
    # the all-at-once pass does not meet (at 3df50f2-fc06df2 the first measured level of the
    # first side still paid a ~1.7 s compile stall: TTFT max 1.7 s served vs 0.1 s in-process).
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
        for stack in [primary, *options.also_stacks]:
            serve_args = engine_flags + ["--tokenizer", tokenizer, "--engine-transport", stack["engine_transport"],
                                         "--frontend-workers", str(stack["frontend_workers"]),
                                         "--engine-core", stack["engine_core"]]
            label = None if stack is primary else stack_label(stack)
            _served_levels(record, serve_args, slices, warm, options, deadline, log_dir or tmp, stack, label)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if options.in_process:
        _in_process_levels(record, engine_config, slices, warm, options, deadline)
    _compare(res)


def _slot(level: dict[str, Any], side: str, label: str | None) -> dict[str, Any]:
    """Where a level's figures for `side` go: the level itself, or its served_stacks[label]."""
    return level if label is None else level.setdefault("served_stacks", {}).setdefault(label, {})


def _levels_within_budget(record: BenchRecord, levels: list[dict[str, Any]], slices: list[list[BenchRequest]],
                          side: str, deadline: Deadline, label: str | None = None):
    """Yields (level, its requests, concurrency) while time is left; marks the rest skipped."""
    for level, requests in zip(levels, slices):
        if deadline.remaining() < 1.0:
            _slot(level, side, label)[side] = {"status": "skipped", "reason": "time budget (--max-seconds) spent"}
            record.incomplete = True
            continue
        yield level, requests, level["concurrency"]


def _served_levels(record: BenchRecord, serve_args: list[str], slices: list[list[BenchRequest]],
                   warm: list[tuple[list[BenchRequest], int]], options: ServeOptions, deadline: Deadline, log_dir: Path,
                   stack: dict[str, Any], label: str | None = None) -> None:
    """One served stack's levels: the primary (`label` None) fills `level["served"]` and
    `res["server"]`; another fills `level["served_stacks"][label]` and `res["servers"][label]`."""
    res = record.results
    levels = res["levels"]
    server = None
    tag = "" if label is None else f"[{label}]"
    workers = stack["frontend_workers"]
    servers = res if label is None else res.setdefault("servers", {})
    key = "server" if label is None else label
    with record.stage(f"serve_start{tag}"):
        log_path = Path(log_dir) / f"tandem-serve{'' if label is None else '-' + label.replace(':', '-')}.log"
        server = ServeProcess(serve_args, log_path)
        started = time.monotonic()
        startup_s = server.wait_serving(min(options.startup_timeout, max(deadline.remaining(), 1.0)))
        # The extra workers load what the first one loaded, so they follow it within seconds.
        pids = server.wait_workers(workers, min(WORKERS_TIMEOUT_S, max(deadline.remaining(), 1.0)))
        servers[key] = {"argv": server.argv[1:], "startup_s": startup_s, "stack": dict(stack),
                        "frontend_workers": {"requested": workers, "reached": len(pids),
                                             "pids": pids, "all_listening_s": round(time.monotonic() - started, 3)}}
        if len(pids) < workers:
            log.warning("not every frontend worker answered; the levels use those that did",
                        requested=workers, reached=len(pids))
    if server is None or key not in servers:
        if server is not None:
            server.stop()
        return
    info = servers[key]
    worker_pids = info["frontend_workers"]["pids"]
    clients = None
    try:
        procs = options.resolved_client_procs()
        if procs > 1:
            with record.stage("client_start"):
                clients = ClientProcesses(server.address, procs)
            if clients is None:
                return
        with record.stage(f"serve_warmup{tag}"):
            t0 = time.perf_counter()
            completed = 0
            for i, (requests, c) in enumerate(warm):
                w = run_level(server.address, requests, max(c or len(requests), procs),
                              deadline.sub(seconds=options.level_seconds).remaining(), prefix=f"warmup{i}",
                              worker_pids=worker_pids, clients=clients)
                completed += w["completed"]
            info["warmup"] = {"seconds": round(time.perf_counter() - t0, 3), "completed": completed,
                              "passes": len(warm)}
        # Every stack and the in-process side share what is left of the budget.
        sides = 1 + len(options.also_stacks) + (1 if options.in_process else 0)
        for level, requests, c in _levels_within_budget(record, levels, slices, "served", deadline, label):
            with record.stage(f"serve_c{c}{tag}"):
                budget = deadline.sub(seconds=options.level_seconds, fraction=1.0 / sides if sides > 1 else None)
                before = _engine_counters(server.address)
                served = run_level(server.address, requests, c, budget.remaining(), prefix=f"c{c}",
                                   worker_pids=worker_pids, clients=clients)
                served["engine"] = _engine_delta(before, _engine_counters(server.address), served["elapsed_s"])
                _slot(level, "served", label)["served"] = served
                record.incomplete |= served["timed_out"] or bool(served.get("client_errors"))
                log.info("serve level", stack=stack_label(stack), concurrency=c,
                         output_tok_s=round(served["output_tokens_per_s"], 1), ttft_p50_ms=served["ttft_ms"]["p50"])
    finally:
        if clients is not None:
            clients.close()
        rc = server.stop()
        info["exit_code"] = rc
        if record.errors:
            info["log_tail"] = server.log_tail()


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


def _in_process_levels(record: BenchRecord, engine_config: Any, slices: list[list[BenchRequest]],
                       warm: list[tuple[list[BenchRequest], int]], options: ServeOptions,
                       deadline: Deadline) -> None:
    from tandem.bench.engine_run import reset_prefix_cache, run_engine, warm_up
    from tandem.bench.hf_peer import release_device_memory
    from tandem.engine_service.engine import LLMEngine

    res = record.results
    engine = None
    with record.stage("in_process_build"):
        t0 = time.monotonic()
        engine = LLMEngine(engine_config)
        res["in_process_engine"] = {"build_s": round(time.monotonic() - t0, 2), "warmup": [
            warm_up(engine, requests, deadline.sub(seconds=options.level_seconds), concurrency=c or None)
            for requests, c in warm]}
    if engine is None:
        return
    try:
        for level, requests, c in _levels_within_budget(record, res["levels"], slices, "in_process", deadline):
            with record.stage(f"in_process_c{c}"):
                reset_prefix_cache(engine)
                run = run_engine(engine, requests, concurrency=c, deadline=deadline.sub(seconds=options.level_seconds),
                                 record_token_times=True, id_prefix=f"c{c}")
                level["in_process"] = {"concurrency": c, **run.summary()}
                record.incomplete |= run.timed_out
    finally:
        del engine
        release_device_memory()


def _compare(res: dict[str, Any]) -> None:
    """Ratios per level and the gRPC TTFT overhead at concurrency 1, for every served stack."""
    for level in res.get("levels", []):
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
    if "grpc_ttft_overhead_ms_c1" in results:
        lines.append(f"gRPC + frontend TTFT overhead at concurrency 1: {results['grpc_ttft_overhead_ms_c1']:.2f} ms (p50)")
    return lines
