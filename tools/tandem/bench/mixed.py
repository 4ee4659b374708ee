"""`tandem bench serve --mixed`: long prompts arriving during decode traffic, once per prefill cap.

Fair prefill (`--max-prefill-tokens-per-seq`) spreads a long prompt over steps so that it does
not hold up the decodes and the short requests that share its steps. This run measures that:
for each cap in `--prefill-caps` (0 = no cap, the scheduler before fair prefill) it starts a
fresh `tandem serve` with that cap and drives the same traffic through it:

- `decode_streams` closed-loop streams of short prompts with long outputs (decode traffic);
- `num_long` long prompts (`long_prompt_len` tokens, a few output tokens), one every
  `long_interval_s` seconds from the start;
- `num_short` short chat-like requests (`short_prompt_len` tokens, `short_output_len` output
  tokens), one every `short_interval_s` seconds from the start.

Every prompt is random token ids (a seeded generator, the same for every cap), so nothing hits
the prefix cache. The run ends when every long and short request has ended (or at
`run_seconds`); the decode streams are then cancelled. Reported per cap: the decode streams'
inter-token latency (ITL; p50/p99), the short requests' TTFT (p50/p99), the long requests'
TTFT and output tokens per second. Results go under `results["mixed"]`.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import structlog

from tandem.bench.results import BenchRecord, Deadline
from tandem.bench.serve import ServeProcess
from tandem.bench.serve_client import CHANNEL_OPTIONS, ClientTiming, _stream_one
from tandem.bench.stats import summarize
from tandem.bench.workloads import BenchRequest
from tandem.wordlevel_tokenizer import write_wordlevel_tokenizer

log = structlog.get_logger(__name__)

CAP_FLAG = "--max-prefill-tokens-per-seq"


@dataclass
class MixedOptions:
    """The traffic of one mixed run (identical for every cap) and which caps to compare."""

    prefill_caps: list[int] = field(default_factory=lambda: [0, 512])
    decode_streams: int = 32
    decode_prompt_len: int = 128
    decode_output_len: int = 512
    num_long: int = 8
    long_prompt_len: int = 8000
    long_output_len: int = 4
    long_interval_s: float = 2.0
    num_short: int = 40
    short_prompt_len: int = 32
    short_output_len: int = 8
    short_interval_s: float = 0.4
    run_seconds: float = 180.0
    startup_timeout: float = 600.0
    tokenizer: str | None = None
    seed: int = 0


def _requests(n: int, prompt_len: int, output_len: int, vocab: int, rng: random.Random) -> list[BenchRequest]:
    return [BenchRequest([rng.randrange(vocab) for _ in range(prompt_len)], output_len) for _ in range(n)]


def with_cap(engine_flags: list[str], cap: int) -> list[str]:
    """`engine_flags` with the prefill cap set to `cap` (any earlier value of the flag dropped)."""
    out, skip = [], False
    for flag in engine_flags:
        if skip:
            skip = False
            continue
        if flag == CAP_FLAG:
            skip = True
            continue
        out.append(flag)
    return out + [CAP_FLAG, str(cap)]


async def _traffic(address: str, opts: MixedOptions, decode: list[BenchRequest], longs: list[BenchRequest],
                   shorts: list[BenchRequest], tag: str) -> dict[str, Any]:
    import grpc

    from tandem.v1 import frontend_pb2_grpc

    channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    stub = frontend_pb2_grpc.FrontendStub(channel)
    t0 = time.perf_counter()
    stop = asyncio.Event()
    decode_timings: list[ClientTiming] = []
    next_decode = iter(range(1 << 30))

    async def decode_slot(slot: int) -> None:
        while not stop.is_set():
            i = next(next_decode)
            req = decode[i % len(decode)]
            timing = ClientTiming(start=0.0, prompt_len=len(req.prompt_token_ids), target_output_len=req.output_len)
            decode_timings.append(timing)
            await _stream_one(stub, f"{tag}-d{i}", req, timing)

    async def timed(kind: str, i: int, req: BenchRequest, at: float) -> ClientTiming:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        timing = ClientTiming(start=0.0, prompt_len=len(req.prompt_token_ids), target_output_len=req.output_len)
        await _stream_one(stub, f"{tag}-{kind}{i}", req, timing)
        return timing

    slots = [asyncio.create_task(decode_slot(k)) for k in range(opts.decode_streams)]
    probes = [timed("l", i, r, i * opts.long_interval_s) for i, r in enumerate(longs)]
    probes += [timed("s", i, r, i * opts.short_interval_s) for i, r in enumerate(shorts)]
    timed_out = False
    try:
        ended = await asyncio.wait_for(asyncio.gather(*probes), timeout=opts.run_seconds)
    except asyncio.TimeoutError:
        ended, timed_out = [], True
    elapsed = time.perf_counter() - t0
    stop.set()
    for task in slots:
        task.cancel()
    await asyncio.gather(*slots, return_exceptions=True)
    await channel.close()
    long_t, short_t = ended[: len(longs)], ended[len(longs):]
    window_end = t0 + elapsed
    itl = [gap for t in decode_timings for gap in t.itl]
    out_tokens = sum(t.tokens for t in decode_timings + list(ended))

    def ttft(ts: list[ClientTiming]) -> dict[str, Any]:
        return summarize([t.first - t.start for t in ts if t.first is not None], 1000.0)

    return {
        "elapsed_s": round(elapsed, 3),
        "timed_out": timed_out,
        "decode_itl_ms": summarize(itl, 1000.0),
        "short_ttft_ms": ttft(short_t),
        "long_ttft_ms": ttft(long_t),
        "short_completed": sum(t.done for t in short_t),
        "long_completed": sum(t.done for t in long_t),
        "decode_requests": len(decode_timings),
        "errors": sorted({t.error for t in decode_timings + list(ended) if t.error and "CANCELLED" not in t.error}),
        "output_tokens_per_s": round(out_tokens / elapsed, 2) if elapsed > 0 else None,
        "window_end": window_end,
    }


@dataclass
class MixedTraffic:
    """The requests of one mixed run, fixed before the first server starts (every run replays
    them): closed-loop decode streams, long prompts (clipped to the context), short requests, and
    the tokenizer the servers load (the model's, or a word-level stand-in written under `tmp`)."""

    decode: list[BenchRequest]
    longs: list[BenchRequest]
    shorts: list[BenchRequest]
    long_prompt_len: int
    tokenizer: str


def prepare_traffic(engine_config: Any, opts: MixedOptions, tmp: Path) -> MixedTraffic:
    """`opts`'s traffic for the model of `engine_config`, from `opts.seed`."""
    from tandem.engine_service.worker.loader import read_eos_token_ids, resolve_model

    resolved = resolve_model(engine_config.model.model, engine_config.model.cache_dir)
    vocab = int(resolved.config["vocab_size"])
    max_len = engine_config.model.max_model_len or resolved.config.get("max_position_embeddings") or 8192
    long_len = min(opts.long_prompt_len, max_len - opts.long_output_len - 1)
    rng = random.Random(opts.seed)
    decode = _requests(max(4 * opts.decode_streams, 16), opts.decode_prompt_len, opts.decode_output_len, vocab, rng)
    longs = _requests(opts.num_long, long_len, opts.long_output_len, vocab, rng)
    shorts = _requests(opts.num_short, opts.short_prompt_len, opts.short_output_len, vocab, rng)
    tokenizer = opts.tokenizer or (str(resolved.path) if resolved.path is not None else None)
    if tokenizer is None:
        eos = read_eos_token_ids(resolved)
        tokenizer = str(write_wordlevel_tokenizer(tmp / "tokenizer", vocab, eos[0] if eos else None, max_len))
    return MixedTraffic(decode, longs, shorts, long_len, tokenizer)


def run_mixed(record: BenchRecord, engine_config: Any, engine_flags: list[str], opts: MixedOptions,
              deadline: Deadline, log_dir: Path | None = None) -> None:
    """Fill `record.results["mixed"]`: one entry per prefill cap, the same traffic each time."""
    tmp = Path(tempfile.mkdtemp(prefix="tandem-bench-mixed-"))
    try:
        traffic = prepare_traffic(engine_config, opts, tmp)
        mixed: dict[str, Any] = {"options": asdict(opts) | {"long_prompt_len": traffic.long_prompt_len}, "runs": []}
        record.results["mixed"] = mixed
        record.results.setdefault("levels", [])
        for cap in opts.prefill_caps:
            if deadline.remaining() < 1.0:
                mixed["runs"].append({"prefill_cap": cap, "status": "skipped", "reason": "time budget spent"})
                record.incomplete = True
                continue
            with record.stage(f"mixed_cap{cap}"):
                run = _one_cap(with_cap(engine_flags, cap) + ["--tokenizer", traffic.tokenizer], cap, opts,
                               traffic.decode, traffic.longs, traffic.shorts, deadline,
                               Path(log_dir or tmp) / f"tandem-serve-cap{cap}.log")
                mixed["runs"].append(run)
                record.incomplete |= run["timed_out"] or bool(run["errors"])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _one_cap(serve_args: list[str], cap: int, opts: MixedOptions, decode: list[BenchRequest],
             longs: list[BenchRequest], shorts: list[BenchRequest], deadline: Deadline, log_path: Path,
             after: Callable[[str], None] | None = None) -> dict:
    """One `tandem serve` with `serve_args` under the traffic; `after(address)` runs before it stops."""
    server = ServeProcess(serve_args, log_path)
    try:
        startup_s = server.wait_serving(min(opts.startup_timeout, max(deadline.remaining(), 1.0)))
        engine_cap = _engine_prefill_cap(server.address)
        warm = [BenchRequest(r.prompt_token_ids[:8], 2) for r in decode[:2]]
        asyncio.run(_traffic(server.address, MixedOptions(decode_streams=0, run_seconds=60.0), [], [], warm,
                             f"warm{cap}"))
        budget = MixedOptions(**{**asdict(opts), "run_seconds": min(opts.run_seconds, max(deadline.remaining(), 1.0))})
        run = asyncio.run(_traffic(server.address, budget, decode, longs, shorts, f"cap{cap}"))
        run.pop("window_end")
        if after is not None:
            after(server.address)
        log.info("mixed run", prefill_cap=cap, itl_p99_ms=run["decode_itl_ms"]["p99"],
                 short_ttft_p99_ms=run["short_ttft_ms"]["p99"])
        return {"prefill_cap": cap, "engine_prefill_cap": engine_cap, "startup_s": round(startup_s, 2), **run}
    finally:
        rc = server.stop()
        if rc not in (0, None):
            log.warning("tandem serve exited badly", rc=rc, log_tail=server.log_tail())


def _engine_prefill_cap(address: str) -> int | None:
    """The cap the served engine reports (Utility `stats`), to confirm the flag reached it."""
    from tandem.client import TandemClient

    with TandemClient(address) as client:
        engines = client.utility("stats", timeout=30.0)["engines"]
    caps = {e.get("max_prefill_tokens_per_seq") for e in engines.values()}
    return int(caps.pop()) if len(caps) == 1 and None not in caps else None


def short_table(results: dict[str, Any]) -> list[str]:
    """Terminal summary: one line per prefill cap."""
    def f(v: Any) -> str:
        return "-" if v is None else f"{v:.1f}"

    lines = [f"{'prefill cap':>11} {'ITL p50/p99 ms':>17} {'short TTFT p50/p99 ms':>22} "
             f"{'long TTFT p50/p99 ms':>22} {'short':>6} {'long':>5} {'out tok/s':>10}"]
    mixed = results.get("mixed") or {}
    for run in mixed.get("runs", []):
        if run.get("status") == "skipped":
            lines.append(f"{run['prefill_cap']:>11} skipped ({run['reason']})")
            continue
        itl, st, lt = run["decode_itl_ms"], run["short_ttft_ms"], run["long_ttft_ms"]
        cap = str(run["prefill_cap"]) + (" (off)" if run["prefill_cap"] == 0 else "")
        lines.append(f"{cap:>11} {f(itl['p50']) + '/' + f(itl['p99']):>17} {f(st['p50']) + '/' + f(st['p99']):>22} "
                     f"{f(lt['p50']) + '/' + f(lt['p99']):>22} {run['short_completed']:>6} {run['long_completed']:>5} "
                     f"{f(run['output_tokens_per_s']):>10}")
    return lines
