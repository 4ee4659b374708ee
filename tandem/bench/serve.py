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
   coalesced tokens), end-to-end latency.
3. After the server stops, the same requests run through an in-process `LLMEngine` at the
   same concurrency (`engine_run.py`). ratio = gRPC output tok/s / in-process output tok/s;
   the gRPC TTFT overhead at concurrency 1 = served p50 TTFT - in-process p50 TTFT.

Each concurrency level uses its own slice of the workload, so no level hits the prefix cache
with another level's prompts.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from tandem.bench.results import BenchRecord, Deadline
from tandem.bench.stats import summarize
from tandem.bench.workloads import BenchRequest, make_workload, warmup_requests

log = structlog.get_logger(__name__)

FRONTEND_SERVICE = "tandem.v1.Frontend"
STREAMS_PER_CHANNEL = 64


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
    warmup_requests: int = 8
    engine_transport: str = "stream"  # frontend-engine transport of the served side

    def level_sizes(self) -> list[int]:
        if self.requests_per_level is not None:
            return [self.requests_per_level for _ in self.concurrencies]
        return [max(2 * c, 16) for c in self.concurrencies]


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


# -- the client ------------------------------------------------------------------------------------


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


async def _run_level_async(address: str, requests: SequenceOf[BenchRequest], concurrency: int,
                           seconds: float, prefix: str) -> tuple[list[ClientTiming], float, float, bool]:
    import grpc

    from tandem.v1 import frontend_pb2_grpc

    n_channels = max(1, math.ceil(concurrency / STREAMS_PER_CHANNEL))
    opts = [("grpc.max_receive_message_length", 16 << 20), ("grpc.max_send_message_length", 16 << 20)]
    channels = [grpc.aio.insecure_channel(address, options=opts) for _ in range(n_channels)]
    stubs = [frontend_pb2_grpc.FrontendStub(ch) for ch in channels]
    sem = asyncio.Semaphore(concurrency)
    timings = [ClientTiming(start=0.0, prompt_len=len(r.prompt_token_ids), target_output_len=r.output_len)
               for r in requests]

    async def worker(i: int, req: BenchRequest) -> None:
        async with sem:
            await _stream_one(stubs[i % n_channels], f"{prefix}-{i}", req, timings[i])

    cpu0, start = time.process_time(), time.perf_counter()
    tasks = [asyncio.create_task(worker(i, r)) for i, r in enumerate(requests)]
    _, pending = await asyncio.wait(tasks, timeout=max(seconds, 0.1))
    timed_out = bool(pending)
    for t in pending:
        t.cancel()  # cancels the gRPC call: the frontend aborts the request in the engine
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
    ends = [t.last for t in timings if t.done and t.last is not None]
    end = time.perf_counter() if timed_out or not ends else max(ends)
    cpu = time.process_time() - cpu0
    for ch in channels:
        await ch.close()
    return timings, end - start, cpu, timed_out


def summarize_client(timings: list[ClientTiming], elapsed: float, client_cpu_s: float, timed_out: bool,
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
        "client_cpu_s": client_cpu_s,
        # Near 1.0 the Python client itself is the bottleneck, not the server.
        "client_cpu_fraction": client_cpu_s / el,
    }


def run_level(address: str, requests: SequenceOf[BenchRequest], concurrency: int, seconds: float,
              prefix: str = "bench") -> dict[str, Any]:
    """Drive one concurrency level to completion (or `seconds`); its summary."""
    timings, elapsed, cpu, timed_out = asyncio.run(
        _run_level_async(address, requests, concurrency, seconds, prefix))
    return summarize_client(timings, elapsed, cpu, timed_out, concurrency)


# -- the benchmark ---------------------------------------------------------------------------------


def run_serve(record: BenchRecord, engine_config: Any, engine_flags: list[str], options: ServeOptions,
              deadline: Deadline, log_dir: Path | None = None) -> None:
    """Fill `record.results["levels"]` with served and in-process figures per concurrency."""
    from tandem.engine_service.loader import read_eos_token_ids, resolve_model

    res = record.results
    res["options"] = dict(vars(options))
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
    warm = warmup_requests(vocab, options.warmup_requests)

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
        _served_levels(record, engine_flags + ["--tokenizer", tokenizer, "--engine-transport", options.engine_transport],
                       slices, warm, options, deadline,
                       log_dir or tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if options.in_process:
        _in_process_levels(record, engine_config, slices, warm, options, deadline)
    _compare(res)


def _levels_within_budget(record: BenchRecord, levels: list[dict[str, Any]], slices: list[list[BenchRequest]],
                          side: str, deadline: Deadline):
    """Yields (level, its requests, concurrency) while time is left; marks the rest skipped."""
    for level, requests in zip(levels, slices):
        if deadline.remaining() < 1.0:
            level[side] = {"status": "skipped", "reason": "time budget (--max-seconds) spent"}
            record.incomplete = True
            continue
        yield level, requests, level["concurrency"]


def _served_levels(record: BenchRecord, serve_args: list[str], slices: list[list[BenchRequest]],
                   warm: list[BenchRequest], options: ServeOptions, deadline: Deadline, log_dir: Path) -> None:
    res = record.results
    levels = res["levels"]
    server = None
    with record.stage("serve_start"):
        log_path = Path(log_dir) / "tandem-serve.log"
        server = ServeProcess(serve_args, log_path)
        res["server"] = {"argv": server.argv[1:], "startup_s": server.wait_serving(
            min(options.startup_timeout, max(deadline.remaining(), 1.0)))}
    if server is None or "server" not in res:
        if server is not None:
            server.stop()
        return
    try:
        with record.stage("serve_warmup"):
            t0 = time.perf_counter()
            w = run_level(server.address, warm, min(len(warm), 8), deadline.sub(seconds=options.level_seconds).remaining(),
                          prefix="warmup")
            res["server"]["warmup"] = {"seconds": round(time.perf_counter() - t0, 3), "completed": w["completed"]}
        for level, requests, c in _levels_within_budget(record, levels, slices, "served", deadline):
            with record.stage(f"serve_c{c}"):
                budget = deadline.sub(seconds=options.level_seconds, fraction=0.5 if options.in_process else None)
                level["served"] = run_level(server.address, requests, c, budget.remaining(), prefix=f"c{c}")
                record.incomplete |= level["served"]["timed_out"]
                log.info("serve level", concurrency=c, output_tok_s=round(level["served"]["output_tokens_per_s"], 1),
                         ttft_p50_ms=level["served"]["ttft_ms"]["p50"])
    finally:
        rc = server.stop()
        res["server"]["exit_code"] = rc
        if record.errors:
            res["server"]["log_tail"] = server.log_tail()


def _in_process_levels(record: BenchRecord, engine_config: Any, slices: list[list[BenchRequest]],
                       warm: list[BenchRequest], options: ServeOptions, deadline: Deadline) -> None:
    from tandem.bench.engine_run import reset_prefix_cache, run_engine, warm_up
    from tandem.bench.hf_peer import release_device_memory
    from tandem.engine_service.engine import LLMEngine

    res = record.results
    engine = None
    with record.stage("in_process_build"):
        t0 = time.monotonic()
        engine = LLMEngine(engine_config)
        res["in_process_engine"] = {"build_s": round(time.monotonic() - t0, 2),
                                    "warmup": warm_up(engine, warm, deadline.sub(seconds=options.level_seconds))}
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
    """Ratios per level and the gRPC TTFT overhead at concurrency 1."""
    for level in res.get("levels", []):
        s, p = level.get("served", {}), level.get("in_process", {})
        if s.get("output_tokens_per_s") and p.get("output_tokens_per_s"):
            level["ratio_output_tokens_per_s"] = s["output_tokens_per_s"] / p["output_tokens_per_s"]
            level["comparable"] = not (s.get("timed_out") or p.get("timed_out"))
        if level["concurrency"] == 1 and s.get("ttft_ms", {}).get("p50") is not None \
                and p.get("ttft_ms", {}).get("p50") is not None:
            res["grpc_ttft_overhead_ms_c1"] = s["ttft_ms"]["p50"] - p["ttft_ms"]["p50"]


def short_table(results: dict[str, Any]) -> list[str]:
    """Terminal summary: one line per concurrency level."""
    def f(v: Any, spec: str = ".1f") -> str:
        return "-" if v is None else format(v, spec)

    lines = [f"{'conc':>5} {'done':>9} {'TTFT p50/p99 ms':>17} {'TPOT p50 ms':>11} {'ITL p99 ms':>10} "
             f"{'out tok/s':>10} {'in-proc':>10} {'ratio':>6}"]
    for level in results.get("levels", []):
        s, p = level.get("served", {}), level.get("in_process", {})
        ttft, tpot, itl = s.get("ttft_ms", {}), s.get("tpot_ms", {}), s.get("itl_ms", {})
        done = f"{s.get('completed', 0)}/{level['num_requests']}"
        lines.append(f"{level['concurrency']:>5} {done:>9} {f(ttft.get('p50')) + '/' + f(ttft.get('p99')):>17} "
                     f"{f(tpot.get('p50'), '.2f'):>11} {f(itl.get('p99'), '.2f'):>10} "
                     f"{f(s.get('output_tokens_per_s')):>10} {f(p.get('output_tokens_per_s')):>10} "
                     f"{f(level.get('ratio_output_tokens_per_s'), '.2f'):>6}")
    if "grpc_ttft_overhead_ms_c1" in results:
        lines.append(f"gRPC + frontend TTFT overhead at concurrency 1: {results['grpc_ttft_overhead_ms_c1']:.2f} ms (p50)")
    return lines
