"""`tandem bench disagg`: one engine vs a prefill engine + a decode engine, same mixed traffic.

The case disaggregation exists for: long prompts arriving while decode-heavy traffic runs. With
one engine, every long prompt's prefill chunks share steps with the running decodes and stretch
their inter-token latency; with a prefill engine and a decode engine, the decodes' engine only
loads the prompts' KV (pulled from the prefill engine) and computes one position each.

Each shape runs the traffic of `tandem bench serve --mixed` (the same client, the same seeded
requests) through a fresh `tandem serve`:

- `single`: `tandem serve` with the engine flags (`--single-kv-blocks` blocks, default twice
  `--num-kv-blocks`: the memory both engines of the other shape hold together);
- `disaggregated`: `tandem serve --disaggregated` (a producer and a consumer engine on the same
  device, `--num-kv-blocks` each; `--kv-transport` picks tcp or cuda_ipc).

Reported per shape: decode ITL p50/p99, short and long requests' TTFT, output tokens/s, and for
the disaggregated shape the decode engine's KV transfer counters (tokens loaded, bytes, GB/s of
the pulls). On a GPU `--num-kv-blocks` is required: two engines sizing their pools from free
memory at the same time would both take it. Results go under `results["disagg"]`.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import structlog

from tandem.bench.mixed import MixedOptions, _one_cap, prepare_traffic
from tandem.bench.results import BenchRecord, Deadline
from tandem.bench.serve import free_port
from tandem.bench.workloads import BenchRequest

log = structlog.get_logger(__name__)


@dataclass
class DisaggOptions:
    """The traffic (as `bench serve --mixed`) and the two shapes' KV pools."""

    traffic: MixedOptions = field(default_factory=MixedOptions)
    single_kv_blocks: int | None = None  # default: 2 x --num-kv-blocks
    shapes: list[str] = field(default_factory=lambda: ["single", "disaggregated"])


def with_flag(flags: list[str], name: str, value: str | None) -> list[str]:
    """`flags` without any earlier `name VALUE`, then `name value` (nothing when value is None)."""
    out, skip = [], False
    for flag in flags:
        if skip:
            skip = False
            continue
        if flag == name:
            skip = True
            continue
        out.append(flag)
    return out + ([name, value] if value is not None else [])


def shape_args(shape: str, engine_flags: list[str], num_blocks: int | None, single_blocks: int | None) -> list[str]:
    """The `tandem serve` arguments of one shape (engine flags with its KV pool and role)."""
    flags = with_flag(engine_flags, "--kv-role", None)
    if shape == "single":
        blocks = single_blocks or (2 * num_blocks if num_blocks else None)
        return with_flag(flags, "--num-kv-blocks", str(blocks) if blocks else None)
    if shape == "disaggregated":
        return flags + ["--disaggregated", "--decode-engine-port", str(free_port())]
    raise ValueError(f"unknown shape {shape!r}")


def _kv_counters(address: str) -> dict[str, Any]:
    """The KV transfer counters of every engine behind the frontend (Utility stats)."""
    from tandem.client import TandemClient

    with TandemClient(address) as client:
        engines = client.utility("stats", timeout=30.0).get("engines", {})
    out = {}
    for name, st in engines.items():
        nbytes, secs = float(st.get("kv_remote_bytes_pulled", 0)), float(st.get("kv_remote_load_seconds", 0))
        out[name] = {"tokens_loaded": int(st.get("kv_remote_tokens_loaded", 0)), "bytes_pulled": int(nbytes),
                     "load_failures": int(st.get("kv_remote_load_failures", 0)),
                     "leases_expired": int(st.get("kv_leases_expired", 0)),
                     # Bytes over the loads' summed durations (each from its plan to its last block
                     # written, waits for the consumer's steps included; loads overlap): what a
                     # request's pull achieved, not the link's bandwidth (gpu_checks.kv_transfer).
                     "load_gb_per_s": round(nbytes / secs / 1e9, 3) if secs else None}
    return out


def run_disagg(record: BenchRecord, engine_config: Any, engine_flags: list[str], opts: DisaggOptions,
               deadline: Deadline, log_dir: Path | None = None) -> None:
    """Fill `record.results["disagg"]`: one entry per shape, the same traffic each time."""
    from tandem.engine_service.worker.model_runner import resolve_device

    num_blocks = engine_config.cache.num_blocks
    if resolve_device(engine_config.model.device).type == "cuda" and num_blocks is None:
        raise ValueError("pass --num-kv-blocks: two engines share the device and cannot both size their "
                         "KV pools from free memory")
    t = opts.traffic
    cap = engine_config.scheduler.prefill_cap(resolve_device(engine_config.model.device).type)
    tmp = Path(tempfile.mkdtemp(prefix="tandem-bench-disagg-"))
    try:
        traffic = prepare_traffic(engine_config, t, tmp)
        result: dict[str, Any] = {"options": asdict(opts) | {"long_prompt_len": traffic.long_prompt_len}, "runs": []}
        record.results["disagg"] = result
        for shape in opts.shapes:
            if deadline.remaining() < 1.0:
                result["runs"].append({"shape": shape, "status": "skipped", "reason": "time budget spent"})
                record.incomplete = True
                continue
            args = shape_args(shape, engine_flags, num_blocks, opts.single_kv_blocks) + ["--tokenizer", traffic.tokenizer]
            with record.stage(f"disagg_{shape}"):
                run = _run_shape(args, shape, cap, t, traffic.decode, traffic.longs, traffic.shorts, deadline,
                                 Path(log_dir or tmp) / f"tandem-serve-{shape}.log")
                result["runs"].append(run)
                record.incomplete |= run["timed_out"] or bool(run["errors"])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run_shape(args: list[str], shape: str, cap: int, opts: MixedOptions, decode: list[BenchRequest],
               longs: list[BenchRequest], shorts: list[BenchRequest], deadline: Deadline, log_path: Path) -> dict:
    counters: dict[str, Any] = {}

    def after(address: str) -> None:
        counters.update(_kv_counters(address))

    run = _one_cap(args, cap, opts, decode, longs, shorts, deadline, log_path, after=after)
    run.pop("prefill_cap", None)
    log.info("disagg run", shape=shape, itl_p99_ms=run["decode_itl_ms"]["p99"])
    return {"shape": shape, **run, "kv_transfer": counters}


def short_table(results: dict[str, Any]) -> list[str]:
    """Terminal summary: one line per shape."""
    def f(v: Any) -> str:
        return "-" if v is None else f"{v:.1f}"

    lines = [f"{'shape':>14} {'ITL p50/p99 ms':>17} {'short TTFT p50/p99 ms':>22} "
             f"{'long TTFT p50/p99 ms':>22} {'short':>6} {'long':>5} {'out tok/s':>10} {'load GB/s*':>10}"]
    for run in (results.get("disagg") or {}).get("runs", []):
        if run.get("status") == "skipped":
            lines.append(f"{run['shape']:>14} skipped ({run['reason']})")
            continue
        itl, st, lt = run["decode_itl_ms"], run["short_ttft_ms"], run["long_ttft_ms"]
        rates = [c["load_gb_per_s"] for c in run.get("kv_transfer", {}).values() if c.get("load_gb_per_s")]
        lines.append(f"{run['shape']:>14} {f(itl['p50']) + '/' + f(itl['p99']):>17} "
                     f"{f(st['p50']) + '/' + f(st['p99']):>22} {f(lt['p50']) + '/' + f(lt['p99']):>22} "
                     f"{run['short_completed']:>6} {run['long_completed']:>5} {f(run['output_tokens_per_s']):>10} "
                     f"{(f'{rates[0]:.2f}' if rates else '-'):>10}")
    lines.append("* bytes pulled / summed per-request load time (waits for the consumer's steps included); "
                 "the link's bandwidth: python -m tandem.gpu_checks.kv_transfer")
    return lines
