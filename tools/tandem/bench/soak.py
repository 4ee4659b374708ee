"""`tandem bench soak`: many requests with random cancels, aborts, short deadlines, n > 1, stops
and bad inputs against a live server, then a leak check.

Each call draws a scenario (seeded, so a run can be repeated):

| scenario  | what the client does                                   | outcomes accepted             |
|-----------|--------------------------------------------------------|-------------------------------|
| plain     | stream or unary, a few tokens                          | OK                            |
| n         | n = 2..4 choices, sampled                              | OK                            |
| stop      | stop strings and a stop token id                       | OK                            |
| cancel    | stream, cancelled after 0..3 token messages            | CANCELLED, or OK if done      |
| abort     | stream, Utility ABORT by request id after a token      | OK (ABORT or done first)      |
| deadline  | a deadline of 5..300 ms                                | DEADLINE_EXCEEDED, or OK      |
| bad       | an invalid field (temperature -1, n 0, top_p 2, ...)   | INVALID_ARGUMENT              |

Per call the client checks that it ended exactly once (one terminal status: the stream's end or
one error) within `call_timeout`, and on OK that every choice index 0..n-1 got exactly one
finish reason, after which that choice carried no more tokens. Afterwards it waits until the
server is idle and checks through the Utility `stats` of the frontend and of every engine that
nothing leaked: no request IDs or choice mappings on the frontend, no running/waiting
sequences, in-flight requests, used KV blocks or used state slots on an engine.

Results: a table of outcomes per scenario on stdout and `results["soak"]` in the bench JSON.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

import structlog

log = structlog.get_logger(__name__)

SCENARIOS = ("plain", "n", "stop", "cancel", "abort", "deadline", "bad")
ACCEPTED: dict[str, set[str]] = {
    "plain": {"OK"},
    "n": {"OK"},
    "stop": {"OK"},
    "cancel": {"CANCELLED", "OK"},
    "abort": {"OK"},
    "deadline": {"DEADLINE_EXCEEDED", "OK"},
    "bad": {"INVALID_ARGUMENT"},
}
PROMPTS = ("Tell me a story about a cat.", "List three colors.", "What is two plus two?",
           "Write a haiku about the sea.", "Count from one to twenty.", "Explain rain in one sentence.")
BAD_FIELDS: tuple[tuple[str, Any], ...] = (
    ("temperature", -1.0), ("n", 0), ("top_p", 2.0), ("max_tokens", -5), ("min_p", 1.5),
    ("presence_penalty", 9.0), ("logprobs", 99), ("repetition_penalty", -1.0),
)


@dataclass
class SoakOptions:
    """How many calls, how many at once, and the client's patience."""

    num_requests: int = 1000
    concurrency: int = 16
    max_seconds: float | None = None  # stop starting calls after this long (None: run all)
    max_tokens: int = 24
    call_timeout: float = 120.0  # a call not ended by then counts as hung
    idle_timeout: float = 60.0  # after the last call, for the server to release everything
    seed: int = 0
    vocab_size: int = 1000  # stop_token_ids are drawn below it (a tiny model's vocabulary is small)
    # Outcomes accepted in every scenario besides its own (the disaggregated soak restarts the
    # producer: a call caught by a restart ends UNAVAILABLE).
    also_accepted: tuple[str, ...] = ()
    unavailable_backoff: float = 0.0  # a worker waits this long after an UNAVAILABLE, as a client retrying would
    weights: dict[str, float] = field(default_factory=lambda: {
        "plain": 3, "n": 2, "stop": 2, "cancel": 2, "abort": 1.5, "deadline": 1.5, "bad": 1})


@dataclass
class CallResult:
    scenario: str
    outcome: str  # OK or a gRPC status name, or HUNG
    detail: str = ""
    violation: str = ""  # a broken per-call invariant ("" when none)


def _request(scenario: str, i: int, rng: random.Random, opts: SoakOptions) -> dict[str, Any]:
    """Keyword arguments of `tandem.client.build_request` for call `i`."""
    kw: dict[str, Any] = {"prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(1, opts.max_tokens),
                          "temperature": rng.choice([0.0, 0.7, 1.0]), "request_id": f"soak-{i}"}
    if scenario in ("cancel", "abort", "deadline"):
        kw["max_tokens"] = opts.max_tokens
        kw["ignore_eos"] = True
    if scenario == "n":
        kw.update(n=rng.randint(2, 4), temperature=0.8, seed=rng.randrange(1 << 31))
    elif scenario == "stop":
        kw.update(stop=[rng.choice([".", "\n", " the", "e"])],
                  stop_token_ids=[rng.randrange(min(100, opts.vocab_size - 1), min(1000, opts.vocab_size))])
    elif scenario == "bad":
        key, value = rng.choice(BAD_FIELDS)
        kw[key] = value
    return kw


async def _one_call(stub: Any, utility: Any, scenario: str, kw: dict[str, Any], rng: random.Random,
                    opts: SoakOptions) -> CallResult:
    import grpc

    from tandem.client import build_request
    from tandem.v1 import common_pb2

    req = build_request(**kw)
    n = kw.get("n", 1)
    timeout = rng.uniform(0.005, 0.3) if scenario == "deadline" else opts.call_timeout
    finished: Counter[int] = Counter()
    violation = ""
    unary = scenario in ("plain", "bad", "stop", "n") and rng.random() < 0.3
    try:
        if unary:
            resp = await asyncio.wait_for(stub.Generate(req, timeout=timeout), opts.call_timeout + 5)
            for c in resp.choices:
                finished[c.index] += c.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
        else:
            call = stub.Stream(req, timeout=timeout)
            cancel_after = rng.randint(0, 3) if scenario == "cancel" else None
            aborted = False
            messages = 0

            async def consume() -> None:
                nonlocal messages, aborted, violation
                async for msg in call:
                    messages += 1
                    for c in msg.choices:
                        if finished[c.index] and c.token_ids:
                            violation = violation or f"choice {c.index} got tokens after its finish"
                        if c.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                            finished[c.index] += 1
                    if cancel_after is not None and messages > cancel_after:
                        call.cancel()
                        return
                    if scenario == "abort" and not aborted:
                        aborted = True
                        try:
                            await utility(kw["request_id"])
                        except grpc.aio.AioRpcError as exc:
                            if exc.code() != grpc.StatusCode.NOT_FOUND:  # NOT_FOUND: it ended first
                                raise

            await asyncio.wait_for(consume(), opts.call_timeout + 5)
            if cancel_after is not None and messages > cancel_after:
                return CallResult(scenario, "CANCELLED", violation=violation)
    except asyncio.TimeoutError:
        return CallResult(scenario, "HUNG", f"no end within {opts.call_timeout + 5:.0f}s", "hung call")
    except asyncio.CancelledError:
        return CallResult(scenario, "CANCELLED", violation=violation)
    except grpc.aio.AioRpcError as exc:
        return CallResult(scenario, exc.code().name, (exc.details() or "")[:200], violation)
    if sorted(finished) != list(range(n)) or any(v != 1 for v in finished.values()):
        violation = violation or f"finish reasons per choice {dict(finished)} for n={n}"
    return CallResult(scenario, "OK", violation=violation)


async def _run_calls(address: str, opts: SoakOptions) -> tuple[list[CallResult], float]:
    import grpc

    from tandem.v1 import common_pb2, frontend_pb2_grpc

    rng = random.Random(opts.seed)
    names = list(opts.weights)
    weights = [opts.weights[k] for k in names]
    plan = [(rng.choices(names, weights)[0], random.Random(rng.randrange(1 << 62))) for _ in range(opts.num_requests)]
    channels = [grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(max(1, opts.concurrency // 16))]
    stubs = [frontend_pb2_grpc.FrontendStub(c) for c in channels]
    results: list[CallResult] = []
    next_index = iter(range(opts.num_requests))
    start = time.perf_counter()

    async def abort(stub: Any, request_id: str) -> None:
        await stub.Utility(common_pb2.UtilityRequest(command=common_pb2.UTILITY_COMMAND_ABORT, request_id=request_id),
                           timeout=30)

    async def worker(k: int) -> None:
        stub = stubs[k % len(stubs)]
        for i in next_index:
            if opts.max_seconds is not None and time.perf_counter() - start > opts.max_seconds:
                return
            scenario, call_rng = plan[i]
            kw = _request(scenario, i, call_rng, opts)
            results.append(await _one_call(stub, lambda rid: abort(stub, rid), scenario, kw, call_rng, opts))
            if results[-1].outcome == "UNAVAILABLE" and opts.unavailable_backoff:
                await asyncio.sleep(opts.unavailable_backoff)

    await asyncio.gather(*(worker(k) for k in range(opts.concurrency)))
    elapsed = time.perf_counter() - start
    for c in channels:
        await c.close()
    return results, elapsed


# Engine stats that count something held (besides `*_used` block and slot gauges): requests,
# and a disaggregated engine's leases and loads.
HELD_KEYS = ("num_running", "num_waiting", "in_flight", "kv_blocks_used", "kv_leases_active", "kv_loading_requests")


def leaks(stats: dict[str, Any]) -> dict[str, Any]:
    """What the Utility `stats` of a frontend (and its engines) still holds; {} when idle."""
    out: dict[str, Any] = {}
    front = stats.get("frontend", {})
    for key in ("in_flight", "in_flight_choices"):
        if front.get(key):
            out[f"frontend.{key}"] = front[key]
    for address, engine in (stats.get("engines") or {}).items():
        if "error" in engine:
            out[f"{address}.error"] = engine["error"]
            continue
        for key, value in engine.items():
            held = key in HELD_KEYS or (
                key.endswith("_used") and ("state" in key or "slot" in key or "block" in key))
            if held and value:
                out[f"{address}.{key}"] = value
    return out


def _checked_keys(stats: dict[str, Any]) -> list[str]:
    keys = [f"frontend.{k}" for k in ("in_flight", "in_flight_choices") if k in stats.get("frontend", {})]
    for engine in (stats.get("engines") or {}).values():
        keys += sorted(k for k in engine if k in HELD_KEYS
                       or (k.endswith("_used") and ("state" in k or "slot" in k or "block" in k)))
        break
    return keys


def wait_idle(address: str, timeout: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """(remaining leaks, last stats) once the server holds nothing, or when `timeout` passes."""
    from tandem.client import TandemClient

    deadline = time.monotonic() + timeout
    with TandemClient(address) as client:
        while True:
            stats = client.utility("stats", timeout=30)
            held = leaks(stats)
            if not held or time.monotonic() > deadline:
                return held, stats
            time.sleep(0.2)


def run_soak(address: str, opts: SoakOptions, after_calls: Any = None) -> dict[str, Any]:
    """Runs the calls against `address`, then `after_calls()` (if given), then the leak check;
    returns the JSON-able summary."""
    results, elapsed = asyncio.run(_run_calls(address, opts))
    if after_calls is not None:
        after_calls()
    held, stats = wait_idle(address, opts.idle_timeout)
    table: dict[str, Counter[str]] = defaultdict(Counter)
    unexpected: list[dict[str, str]] = []
    violations: list[dict[str, str]] = []
    for r in results:
        table[r.scenario][r.outcome] += 1
        if r.outcome not in ACCEPTED[r.scenario] and r.outcome not in opts.also_accepted:
            unexpected.append(asdict(r))
        if r.violation:
            violations.append(asdict(r))
    summary = {
        "options": asdict(opts),
        "calls": len(results),
        "elapsed_s": round(elapsed, 2),
        "calls_per_s": round(len(results) / elapsed, 2) if elapsed else None,
        "outcomes": {s: dict(table[s]) for s in SCENARIOS if s in table},
        "totals": dict(sum(table.values(), Counter())),
        "unexpected": unexpected[:50],
        "num_unexpected": len(unexpected),
        "violations": violations[:50],
        "num_violations": len(violations),
        "leaks": held,
        "checked": _checked_keys(stats),
    }
    summary["passed"] = not unexpected and not violations and not held and len(results) > 0
    return summary


def run_soak_with_server(engine_config: Any, engine_flags: list[str], opts: SoakOptions, tokenizer: str | None,
                         startup_timeout: float) -> dict[str, Any]:
    """`run_soak` against a `tandem serve` started for it (and stopped after) on free ports."""
    import shutil
    import tempfile
    from pathlib import Path

    from tandem.bench.serve import ServeProcess
    from tandem.wordlevel_tokenizer import write_wordlevel_tokenizer
    from tandem.engine_service.worker.loader import read_eos_token_ids, resolve_model

    tmp = Path(tempfile.mkdtemp(prefix="tandem-bench-soak-"))
    server = None
    try:
        resolved = resolve_model(engine_config.model.model, engine_config.model.cache_dir)
        tokenizer = tokenizer or (str(resolved.path) if resolved.path is not None else None)
        if tokenizer is None:
            eos = read_eos_token_ids(resolved)
            vocab = int(resolved.config["vocab_size"])
            tokenizer = str(write_wordlevel_tokenizer(tmp / "tokenizer", vocab, eos[0] if eos else None,
                                                      engine_config.model.max_model_len))
        server = ServeProcess(engine_flags + ["--tokenizer", tokenizer], tmp / "tandem-serve.log")
        server.wait_serving(startup_timeout)
        summary = run_soak(server.address, opts)
        summary["server"] = {"argv": server.argv[1:]}
        return summary
    finally:
        if server is not None:
            rc = server.stop()
            if rc not in (0, None):
                log.warning("tandem serve exited badly", rc=rc, log_tail=server.log_tail())
        shutil.rmtree(tmp, ignore_errors=True)


def short_table(results: dict[str, Any]) -> list[str]:
    """Outcomes per scenario, then the verdict."""
    soak = results.get("soak") or {}
    outcomes: dict[str, dict[str, int]] = soak.get("outcomes", {})
    columns = sorted({o for per in outcomes.values() for o in per})
    lines = [f"{'scenario':>9} " + " ".join(f"{c:>18}" for c in columns) + f" {'total':>7}"]
    for scenario, per in outcomes.items():
        lines.append(f"{scenario:>9} " + " ".join(f"{per.get(c, 0):>18}" for c in columns)
                     + f" {sum(per.values()):>7}")
    if soak:
        lines.append(f"{soak['calls']} calls in {soak['elapsed_s']} s; unexpected outcomes {soak['num_unexpected']}, "
                     f"per-call violations {soak['num_violations']}, leaks {soak['leaks'] or 'none'} "
                     f"(checked {', '.join(soak['checked'])}): {'PASS' if soak['passed'] else 'FAIL'}")
    return lines
