"""Rounds of `tandem bench serve --rounds N`: which side runs when, on which requests, and how the
rounds' figures become one figure per level.

Why rounds: the in-process anchor drifts between (and within) device calls — its ms/step at
concurrency 64 moved 4.99-6.18 ms across three calls — so one served level followed minutes later
by one in-process level folds that drift into the ratio. With N rounds both sides stay alive
and alternate, and the comparison is made on medians.

Invariants (the pure functions below; `serve.py` runs what they describe):

- Side names: `served` (the primary stack), `served[<label>]` (an `--also-stack`), `in_process`.
  The order of a round is the side list for even rounds and its reverse for odd ones, so with
  two sides round 0 is served then in-process, round 1 in-process then served, and so on.
- `schedule`: with one round every side opens, runs its levels and closes before the next opens
  (one engine on the device at a time); with more, every side
  opens before round 0 and closes after the last round, so setup, warm-up and compile stalls all
  happen before any measured level.
- `round_slices`: round r of level i gets its own requests, the same on every side; round 0 is
  the single-round workload (the workload generator is prefix-stable), later rounds follow it,
  so no round finds another round's prompts in a prefix cache.
- Within a round each side's level may take `1/len(order)` of what is left of the round, except
  the round's last side, which may take the rest (with one round and the in-process side last,
  the single-round run); `--level-seconds` caps every level. Round r's budget is
  `1/(N - r)` of what is left of the run when it starts, so time a round did not use passes on.
- A level's round is usable when every side has figures there that were neither skipped nor
  timed out and completed every request; the others are marked (`cut_short`) and left out of
  the medians. The medians of all sides come from the same usable rounds.
- Summaries: each side's figure per level is the per-metric median over the usable rounds of
  `MEDIAN_KEYS` (each numeric field of a nested dict, e.g. `ttft_ms.p99`, separately: the median
  of the rounds' p99s, not a p99 over pooled requests); with an even count the median is the
  mean of the middle two. The level's ratio is the ratio of the output tok/s medians;
  `ratio_rounds` gives the median, min and max of the per-round paired ratios beside it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

IN_PROCESS = "in_process"
PRIMARY = "served"

# Fields whose per-round values are reduced to their median (nested dicts: each numeric field).
MEDIAN_KEYS = ("output_tokens_per_s", "total_tokens_per_s", "requests_per_s", "elapsed_s", "completed",
               "input_tokens", "output_tokens", "steps", "client_cpu_fraction", "tokens_per_message",
               "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "engine")


@dataclass(frozen=True)
class Step:
    """One step of a run: `open` or `close` a side, or `run` its levels for round `round`."""

    action: str
    side: str
    round: int | None = None


def served_name(label: str | None) -> str:
    """The side name of a served stack: the primary (`label` None) or an `--also-stack`."""
    return PRIMARY if label is None else f"{PRIMARY}[{label}]"


def round_order(sides: Sequence[str], r: int) -> list[str]:
    """The sides in the order round `r` runs them: as given for even rounds, reversed for odd."""
    return list(sides) if r % 2 == 0 else list(reversed(sides))


def schedule(sides: Sequence[str], rounds: int) -> list[Step]:
    """Every step of a run (see the module docstring); every side opens once and closes once."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if rounds == 1:
        return [step for side in sides for step in (Step("open", side), Step("run", side, 0), Step("close", side))]
    steps = [Step("open", side) for side in sides]
    for r in range(rounds):
        steps += [Step("run", side, r) for side in round_order(sides, r)]
    return steps + [Step("close", side) for side in reversed(sides)]


def level_fraction(order: Sequence[str], side: str) -> float | None:
    """The share of a round's remaining time one level of `side` may take (None: all of it)."""
    return None if order[-1] == side else 1.0 / len(order)


def round_slices(requests: Sequence[T], sizes: Sequence[int], rounds: int) -> list[list[list[T]]]:
    """`[round][level]` request lists: consecutive, disjoint slices of `requests`, round after round."""
    per_round = sum(sizes)
    if len(requests) < rounds * per_round:
        raise ValueError(f"{rounds} rounds of {per_round} requests need {rounds * per_round}, got {len(requests)}")
    out = []
    for r in range(rounds):
        start, levels = r * per_round, []
        for n in sizes:
            levels.append(list(requests[start : start + n]))
            start += n
        out.append(levels)
    return out


def cut_short(figures: dict[str, Any] | None) -> str | None:
    """Why one side's figures of one round cannot enter a median (None: they can)."""
    if not figures:
        return "not measured"
    if figures.get("status") == "skipped":
        return "skipped"
    if figures.get("timed_out"):
        return "timed out"
    if figures.get("completed") != figures.get("num_requests"):
        return f"{figures.get('completed')}/{figures.get('num_requests')} completed"
    return None


def median_tree(values: Sequence[Any]) -> Any:
    """The median of numbers (None and bools ignored; None when none is left), field by field for
    dicts (the fields any of them has)."""
    dicts = [v for v in values if isinstance(v, dict)]
    if dicts:
        keys = list(dict.fromkeys(k for d in dicts for k in d))
        return {k: median_tree([d.get(k) for d in dicts]) for k in keys}
    nums = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return statistics.median(nums) if nums else None


def median_summary(runs: Sequence[dict[str, Any]], rounds_used: Sequence[int]) -> dict[str, Any]:
    """One side's figures of a level: the median of `MEDIAN_KEYS` over `runs` (its usable rounds)."""
    out: dict[str, Any] = {"median_of_rounds": list(rounds_used), "num_requests": runs[0].get("num_requests"),
                           "timed_out": False}
    for key in MEDIAN_KEYS:
        if any(key in run for run in runs):
            out[key] = median_tree([run.get(key) for run in runs])
    return out


def output_ratio(served: dict[str, Any], in_process: dict[str, Any]) -> float | None:
    """served ÷ in-process output tokens per second (None when either is missing or zero)."""
    s, p = served.get("output_tokens_per_s"), in_process.get("output_tokens_per_s")
    return s / p if s and p else None


def summarize_level_rounds(level: dict[str, Any], sides: Sequence[str]) -> None:
    """From `level["rounds"]`: marks each round's `cut_short` sides, its paired ratios, and puts
    each side's median summary where a single-round run puts its figures (`level["served"]`,
    `level["in_process"]`, `level["served_stacks"][label]["served"]`), with `ratio_rounds` beside
    every served stack's ratio when the in-process side ran. Sides without any usable round get
    `{"status": "no usable round"}`."""
    rounds = level.get("rounds", [])
    used = []
    for entry in rounds:
        why = {side: reason for side in sides if (reason := cut_short(_figures(entry, side)))}
        if why:
            entry["cut_short"] = why
        else:
            used.append(entry)
        if IN_PROCESS in sides:
            for side in sides:
                if side != IN_PROCESS:
                    ratio = output_ratio(_figures(entry, side) or {}, entry.get(IN_PROCESS) or {})
                    if ratio is not None:
                        _slot(entry, side)["ratio_output_tokens_per_s"] = ratio
    for side in sides:
        key = IN_PROCESS if side == IN_PROCESS else PRIMARY
        if not used:
            _slot(level, side)[key] = {"status": "no usable round", "rounds": len(rounds)}
            continue
        _slot(level, side)[key] = median_summary([_figures(e, side) for e in used], [e["round"] for e in used])
        if side != IN_PROCESS and IN_PROCESS in sides:
            paired = [(e["round"], r) for e in used if (r := _slot(e, side).get("ratio_output_tokens_per_s"))]
            if paired:
                values = [r for _, r in paired]
                _slot(level, side)["ratio_rounds"] = {
                    "median": statistics.median(values), "min": min(values), "max": max(values),
                    "rounds": [i for i, _ in paired], "values": values}


def _slot(entry: dict[str, Any], side: str) -> dict[str, Any]:
    """The dict that holds `side`'s figures in a level or a round entry (see `serve._slot`)."""
    if side in (PRIMARY, IN_PROCESS):
        return entry
    label = side[len(PRIMARY) + 1 : -1]
    return entry.setdefault("served_stacks", {}).setdefault(label, {})


def _figures(entry: dict[str, Any], side: str) -> dict[str, Any] | None:
    if side == IN_PROCESS:
        return entry.get(IN_PROCESS)
    if side == PRIMARY:
        return entry.get(PRIMARY)
    label = side[len(PRIMARY) + 1 : -1]
    return (entry.get("served_stacks", {}).get(label) or {}).get(PRIMARY)
