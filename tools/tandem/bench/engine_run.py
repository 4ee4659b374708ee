"""Drives an in-process `LLMEngine` over a list of benchmark requests and times it.

Used for the offline throughput figure (everything submitted at once) and for the serving
comparison (at most `concurrency` requests in flight, a new one admitted as one finishes:
what a closed-loop client at that concurrency does, minus gRPC and the frontend).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from typing import Any

import structlog

from tandem.bench.results import Deadline
from tandem.bench.stats import summarize
from tandem.bench.workloads import BenchRequest

log = structlog.get_logger(__name__)


@dataclass
class RequestTiming:
    """One request's life as seen in the engine loop (perf_counter seconds)."""

    prompt_len: int
    target_output_len: int
    start: float
    output_tokens: int = 0
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    finish_reason: str | None = None
    token_times: list[float] = field(default_factory=list)


@dataclass
class EngineRunResult:
    """Totals and per-request timings of one driven run."""

    requests: list[RequestTiming]
    elapsed_s: float
    steps: int
    timed_out: bool
    prefix_cache_hits: int | None = None
    step_s: list[float] = field(default_factory=list)  # each engine.step() call's duration

    @property
    def completed(self) -> list[RequestTiming]:
        return [r for r in self.requests if r.finished is not None]

    def summary(self) -> dict[str, Any]:
        """vLLM-style totals: requests/s, output tokens/s, total (input + output) tokens/s, plus
        TTFT/TPOT/ITL from the engine loop's clock."""
        done = self.completed
        out_tokens = sum(r.output_tokens for r in self.requests)
        # Input tokens count once a request has been prefilled (it produced a token).
        in_tokens = sum(r.prompt_len for r in self.requests if r.output_tokens > 0)
        el = max(self.elapsed_s, 1e-9)
        ttft = [r.first_token - r.start for r in done if r.first_token is not None]
        tpot = [(r.last_token - r.first_token) / (r.output_tokens - 1) for r in done
                if r.output_tokens > 1 and r.first_token is not None and r.last_token is not None]
        itl = [b - a for r in done for a, b in zip(r.token_times, r.token_times[1:])]
        short = [r for r in done if r.output_tokens != r.target_output_len]
        return {
            "num_requests": len(self.requests),
            "completed": len(done),
            "timed_out": self.timed_out,
            "elapsed_s": self.elapsed_s,
            "steps": self.steps,
            "input_tokens": in_tokens,
            "output_tokens": out_tokens,
            "requests_per_s": len(done) / el,
            "output_tokens_per_s": out_tokens / el,
            "total_tokens_per_s": (in_tokens + out_tokens) / el,
            "ttft_ms": summarize(ttft, 1e3),
            "tpot_ms": summarize(tpot, 1e3),
            "itl_ms": summarize(itl, 1e3),
            "e2e_ms": summarize([r.finished - r.start for r in done], 1e3),
            "requests_not_at_target_length": len(short),
            "prefix_cache_hits": self.prefix_cache_hits,
            "step_ms": summarize(self.step_s, 1e3),
            # (step index, ms) of the slowest steps: a kernel compiled or a graph captured mid-run shows here.
            "slowest_steps_ms": sorted(((i, round(s * 1e3, 2)) for i, s in enumerate(self.step_s)),
                                       key=lambda x: -x[1])[:5],
        }


def greedy_params(output_len: int) -> Any:
    """Greedy, EOS ignored, exactly `output_len` tokens: the benchmark's sampling everywhere."""
    from tandem.engine_service.sequence import SamplingParams

    return SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)


def run_engine(
    engine: Any,
    requests: SequenceOf[BenchRequest],
    *,
    concurrency: int | None = None,
    deadline: Deadline | None = None,
    record_token_times: bool = False,
    id_prefix: str = "bench",
) -> EngineRunResult:
    """Submit `requests` (all at once, or `concurrency` at a time) and step until all finish.

    Past the deadline, the requests still in flight are aborted and the run is marked timed
    out; its totals then cover what was produced until that moment.
    """
    pending = deque(enumerate(requests))
    timings: list[RequestTiming] = []
    by_id: dict[str, RequestTiming] = {}
    in_flight: set[str] = set()
    limit = len(requests) if concurrency is None else max(1, concurrency)
    hits_before = _prefix_hits(engine)

    def admit(now: float) -> None:
        while pending and len(in_flight) < limit:
            i, req = pending.popleft()
            rid = f"{id_prefix}-{i}"
            t = RequestTiming(len(req.prompt_token_ids), req.output_len, start=now)
            timings.append(t)
            by_id[rid] = t
            engine.add_request(rid, list(req.prompt_token_ids), greedy_params(req.output_len))
            in_flight.add(rid)

    start = time.perf_counter()
    admit(start)
    steps = 0
    step_s: list[float] = []
    timed_out = False
    while in_flight or pending:
        if deadline is not None and deadline.expired():
            timed_out = True
            break
        before = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        step_s.append(now - before)
        steps += 1
        for o in outputs:
            t = by_id.get(o.request_id)
            if t is None:
                continue
            n = len(o.new_token_ids)
            if n:
                if t.first_token is None:
                    t.first_token = now
                t.last_token = now
                t.output_tokens += n
                if record_token_times:
                    t.token_times.extend([now] * n)
            if o.finished:
                t.finished = now
                t.finish_reason = getattr(o.finish_reason, "value", str(o.finish_reason))
                in_flight.discard(o.request_id)
        if not outputs and not engine.has_work() and in_flight:
            # Nothing scheduled and nothing left: the engine dropped a request. Do not spin.
            log.warning("engine idle with requests in flight", in_flight=len(in_flight))
            break
        admit(now)
    end = time.perf_counter()
    engine.abort_and_settle(in_flight)
    hits_after = _prefix_hits(engine)
    hits = None if hits_before is None or hits_after is None else hits_after - hits_before
    return EngineRunResult(timings, end - start, steps, timed_out, hits, step_s)


def _prefix_hits(engine: Any) -> int | None:
    try:
        return int(engine.stats().prefix_cache_hits)
    except Exception:  # noqa: BLE001 - stats are informative only
        return None


def reset_prefix_cache(engine: Any) -> bool:
    """Forget cached prefixes between runs, so a rerun of the same prompts recomputes them."""
    bm = getattr(engine, "block_manager", None)
    fn = getattr(bm, "reset_prefix_cache", None)
    return bool(fn()) if callable(fn) else False


def warm_up(engine: Any, requests: SequenceOf[BenchRequest], deadline: Deadline | None = None,
            concurrency: int | None = None) -> dict[str, Any]:
    """Run short requests first (kernel compilation, graph capture, allocator growth happen here),
    all at once or `concurrency` at a time."""
    t0 = time.perf_counter()
    result = run_engine(engine, requests, concurrency=concurrency, deadline=deadline, id_prefix="warmup")
    reset_prefix_cache(engine)
    return {"requests": len(requests), "seconds": round(time.perf_counter() - t0, 3),
            "timed_out": result.timed_out}
