"""The result record every benchmark writes: one JSON file per run, errors kept, never faked.

Layout (schema `tandem.bench/v1`):

    {"schema", "kind", "model", "env": {...}, "config": {...}, "results": {...},
     "errors": [{"stage", "error", "traceback"}], "wall_s", "complete"}

A sub-benchmark that raises is recorded under `errors` with its stage name and the run goes on;
`complete` is False when any stage failed or ran out of time.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from tandem.bench.env_info import collect_env

log = structlog.get_logger(__name__)

SCHEMA = "tandem.bench/v1"
KINDS = ("roofline", "throughput", "serve", "overhead", "transport", "soak", "disagg", "prefix", "kv_transfer",
         "profile")
DEFAULT_RESULTS_DIR = "bench/results"


class Deadline:
    """A wall-clock budget shared by the stages of one benchmark run."""

    def __init__(self, seconds: float | None) -> None:
        self.start = time.monotonic()
        self.seconds = seconds
        self.end = math.inf if seconds is None else self.start + seconds

    def remaining(self) -> float:
        return self.end - time.monotonic()

    def expired(self) -> bool:
        return self.remaining() <= 0

    def sub(self, seconds: float | None = None, fraction: float | None = None) -> Deadline:
        """A nested budget: at most `seconds` (or `fraction` of what is left), never past this one."""
        left = self.remaining()
        cap = left
        if seconds is not None:
            cap = min(cap, seconds)
        if fraction is not None and math.isfinite(left):
            cap = min(cap, left * fraction)
        return Deadline(None if math.isinf(cap) else max(cap, 0.0))


@dataclass
class BenchRecord:
    """The JSON document of one benchmark run, filled in as stages finish."""

    kind: str
    model: str
    config: dict[str, Any] = field(default_factory=dict)
    env: dict[str, Any] = field(default_factory=dict)
    results: dict[str, Any] = field(default_factory=dict)
    errors: list[dict[str, Any]] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    incomplete: bool = False

    @contextlib.contextmanager
    def stage(self, name: str, reraise: bool = False) -> Iterator[None]:
        """Run a stage; an exception becomes an entry in `errors` (and is re-raised if asked)."""
        start = time.monotonic()
        log.info("bench stage started", kind=self.kind, stage=name)
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - recorded, so that the other stages still run
            self.add_error(name, exc)
            if reraise:
                raise
        finally:
            log.info("bench stage ended", kind=self.kind, stage=name, seconds=round(time.monotonic() - start, 2))

    def add_error(self, stage: str, exc: BaseException) -> None:
        log.error("bench stage failed", kind=self.kind, stage=stage, error=repr(exc))
        self.errors.append({
            "stage": stage,
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-4000:],
        })

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "kind": self.kind,
            "model": self.model,
            "env": self.env,
            "config": self.config,
            "results": self.results,
            "errors": self.errors,
            "wall_s": round(time.monotonic() - self.started, 3),
            "complete": not self.errors and not self.incomplete,
        }


def new_record(kind: str, model: str, config: dict[str, Any], device: Any = None) -> BenchRecord:
    if kind not in KINDS:
        raise ValueError(f"unknown benchmark kind {kind!r}")
    return BenchRecord(kind=kind, model=model, config=config, env=collect_env(device))


def model_slug(model: str) -> str:
    """A file-name-safe short model name: `dummy:qwen3-8b` -> `qwen3-8b`, `/x/SmolLM2` -> `SmolLM2`."""
    name = model.split(":", 1)[1] if model.startswith("dummy:") else Path(model.rstrip("/")).name
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name) or "model"


def result_path(out_dir: str | Path, kind: str, model: str, timestamp: str) -> Path:
    """`<out>/<kind>-<model>-<timestamp>.json` with a compact UTC timestamp."""
    stamp = re.sub(r"[^0-9TZ]", "", timestamp)
    return Path(out_dir) / f"{kind}-{model_slug(model)}-{stamp}.json"


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf; None reads as "not measured"
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return _jsonable(value.item())
    return str(value)


def write_record(record: BenchRecord, out_dir: str | Path) -> Path:
    """Write the record as `<out>/<kind>-<model>-<timestamp>.json` (never overwriting)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = result_path(out, record.kind, record.model, record.env.get("timestamp", "unknown"))
    base, n = path.stem, 1
    while path.exists():
        path = path.with_name(f"{base}-{n}.json")
        n += 1
    path.write_text(json.dumps(_jsonable(record.to_json()), indent=2, sort_keys=False) + "\n")
    log.info("bench result written", path=str(path))
    return path


def read_records(results_dir: str | Path) -> list[tuple[Path, dict[str, Any]]]:
    """Every valid result JSON in `results_dir` (others are skipped with a warning), oldest first."""
    found: list[tuple[Path, dict[str, Any]]] = []
    for path in sorted(Path(results_dir).glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            log.warning("unreadable bench result skipped", path=str(path), error=repr(exc))
            continue
        if not isinstance(data, dict) or data.get("schema") != SCHEMA or data.get("kind") not in KINDS:
            log.warning("not a tandem bench result, skipped", path=str(path))
            continue
        found.append((path, data))
    found.sort(key=lambda item: (item[1].get("env", {}).get("timestamp", ""), item[0].name))
    return found
