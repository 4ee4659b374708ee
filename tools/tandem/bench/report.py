"""`tandem bench report`: docs/benchmarks.md (+ a decode plot) from every JSON in bench/results/.

The tables show the latest result per (kind, model, device); a history lists every file. Each
row carries the device, library versions, git commit, workload and the ratio to its anchor:

| table | anchor | ratio |
|---|---|---|
| decode step | floor = (weight + KV + state bytes) / measured HBM bandwidth | floor / measured |
| prefill | measured bf16 matmul rate | MFU |
| offline throughput | HF continuous batching (static `generate` batches for models it cannot serve), same weights and requests | ours / peer (output tok/s) |
| serving | in-process engine, same requests and concurrency | served / in-process (output tok/s) |

Nothing is ever filled in by hand: a table without results says "not measured yet".
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import structlog

from tandem.bench.results import DEFAULT_RESULTS_DIR, read_records

log = structlog.get_logger(__name__)

DEFAULT_MARKDOWN = "docs/benchmarks.md"
DEFAULT_PLOT = "docs/benchmarks_decode.png"
NOT_MEASURED = "_not measured yet_"

Record = tuple[Path, dict[str, Any]]


# -- cell formatting -----------------------------------------------------------------------------


def _num(v: Any, spec: str = ".1f", suffix: str = "") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    return f"{format(v, spec)}{suffix}"


def _pct(v: Any) -> str:
    return _num(None if v is None else 100.0 * v, ".1f", "%")


def _triple(d: dict[str, Any] | None, spec: str = ".1f") -> str:
    d = d or {}
    return " / ".join(_num(d.get(k), spec) for k in ("p50", "p90", "p99"))


def commit_cell(env: dict[str, Any]) -> str:
    c = str(env.get("git_commit") or "unknown")
    short = c[:10] if c != "unknown" else c
    return f"`{short}`{'+dirty' if env.get('git_dirty') else ''}"


def versions_cell(env: dict[str, Any]) -> str:
    parts = [f"torch {env.get('torch') or '?'}"]
    if env.get("triton"):
        parts.append(f"triton {env['triton']}")
    parts.append(f"transformers {env.get('transformers') or '?'}")
    parts.append(f"py {env.get('python') or '?'}")
    return ", ".join(parts)


def device_cell(env: dict[str, Any]) -> str:
    return str(env.get("device") or "?")


def model_cell(data: dict[str, Any]) -> str:
    """The model, and its weight format where it is not the checkpoint's own (`--quantization fp8`)."""
    quantization = (data.get("config") or {}).get("quantization")
    suffix = f" ({quantization})" if quantization not in (None, "auto", "none") else ""
    return f"`{data.get('model', '?')}`{suffix}"


def _status_cell(point: dict[str, Any]) -> str:
    """`skipped (KV does not fit)` / `error (OutOfMemoryError)`: the status and the reason's head."""
    why = point.get("reason") or point.get("error") or ""
    head = why.split(":")[0].split(" (")[0][:48]
    return f"{point.get('status', '?')} ({head})" if head else str(point.get("status", "?"))


def _row(cells: Iterable[Any]) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |"


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    if not rows:
        return [NOT_MEASURED, ""]
    return [_row(header), _row(["---"] * len(header)), *(_row(r) for r in rows), ""]


def served_stack_of(data: dict[str, Any]) -> tuple[str, str, int, int]:
    """(engine core, engine transport, frontend workers, client processes) of a serve run's
    primary stack; a result that does not record them ran the engine core on a thread of the
    gRPC process, the stream transport, one frontend and one client process."""
    if data.get("kind") != "serve":
        return ("", "", 0, 0)
    res = data.get("results", {})
    stack = res.get("served_stack") or {}
    options = res.get("options") or {}
    return (stack.get("engine_core") or "thread",
            stack.get("engine_transport") or options.get("engine_transport", "stream"),
            int(stack.get("frontend_workers") or 1), int(stack.get("client_procs") or 1))


def serve_rounds_of(data: dict[str, Any]) -> int:
    """`--rounds` of a serve run (1 for a result that does not record it)."""
    return int(((data.get("results") or {}).get("options") or {}).get("rounds") or 1)


def variant_of(data: dict[str, Any]) -> tuple:
    """What keeps a run's rows apart from another run of the same kind, model and device: the
    served stack of a `serve` run (transport, frontend workers, client processes) and whether it
    alternated the sides in rounds, the workload of a `throughput` run; nothing for the others."""
    if data.get("kind") == "serve":
        return (*served_stack_of(data), serve_rounds_of(data) > 1)
    if data.get("kind") == "throughput":
        return ((data.get("results") or {}).get("workload") or {}).get("name", ""),
    return ()


def latest_per_key(records: list[Record], kind: str) -> list[Record]:
    """The newest record of `kind` for each (model, device, variant); records are oldest first."""
    latest: dict[tuple[str, str, tuple], Record] = {}
    for path, data in records:
        if data.get("kind") == kind:
            latest[(data.get("model", ""), device_cell(data.get("env", {})), variant_of(data))] = (path, data)
    return sorted(latest.values(), key=lambda r: (r[1].get("model", ""), device_cell(r[1].get("env", {})),
                                                  repr(variant_of(r[1]))))


# -- tables --------------------------------------------------------------------------------------


def decode_rows(records: list[Record]) -> list[list[Any]]:
    rows = []
    for path, data in latest_per_key(records, "roofline"):
        env, res = data.get("env", {}), data.get("results", {})
        bw = (res.get("bandwidth") or {}).get("bytes_per_s")
        runner = res.get("runner") or {}
        backend = runner.get("attention_backend") or "?"
        for p in res.get("decode", []):
            status = p.get("status", "?")
            ratio = _num(p.get("floor_pct"), ".1f", "%") if status == "ok" else _status_cell(p)
            if p.get("kv_aliased"):
                ratio += " (kv aliased)"
            rows.append([
                model_cell(data), device_cell(env), "decode-sweep", p.get("batch"), p.get("context"),
                _num(p.get("median_ms"), ".3f"), _num(p.get("floor_ms"), ".3f"), ratio,
                _num(p.get("replay_only_ms"), ".3f"), _num(p.get("floor_pct_replay_only"), ".1f", "%"),
                _num(None if bw is None else bw / 1e12, ".2f"),
                f"{p['path']}, {backend}" if p.get("path") else "–",
                commit_cell(env), versions_cell(env),
                f"`{path.name}`",
            ])
    return rows


def prefill_rows(records: list[Record]) -> list[list[Any]]:
    rows = []
    for path, data in latest_per_key(records, "roofline"):
        env, res = data.get("env", {}), data.get("results", {})
        mm = (res.get("matmul") or {}).get("flops_per_s")
        for p in res.get("prefill", []):
            status = p.get("status", "?")
            rows.append([
                model_cell(data), device_cell(env), f"prefill {p.get('shape')}", p.get("tokens"),
                _num(p.get("median_ms"), ".2f"), _num(None if p.get("flops_per_s") is None else p["flops_per_s"] / 1e12),
                _num(None if mm is None else mm / 1e12, ".0f"), _pct(p.get("mfu")) if status == "ok" else _status_cell(p),
                commit_cell(env), versions_cell(env), f"`{path.name}`",
            ])
    return rows


def throughput_rows(records: list[Record]) -> list[list[Any]]:
    rows = []
    for path, data in latest_per_key(records, "throughput"):
        env, res = data.get("env", {}), data.get("results", {})
        ours, peer, ratio = res.get("ours") or {}, res.get("peer") or {}, res.get("ratio") or {}
        w = res.get("workload") or {}
        notes = []
        if not w.get("standard", True):
            notes.append(f"non-standard: {w.get('num_requests')} prompts, scale {w.get('scale')}")
        if ratio.get("on") == "peer subset":
            notes.append(f"ratio on the first {ratio.get('num_requests')} requests (peer subset)")
        if ours.get("timed_out") or peer.get("timed_out"):
            notes.append("partial: timed out")
        if "output_tokens_per_s" not in peer:
            notes.append("peer: " + (peer.get("status") or "failed (see errors)"))
        if peer.get("mode") == "generate_static_batches":
            notes.append(f"peer: static generate batches of {peer.get('batch_size')} (continuous batching cannot "
                         "serve this model)")
            kernels = peer.get("linear_attention_kernels") or {}
            if kernels and not all(kernels.values()):
                notes.append("peer GDN kernels: PyTorch fallback (" + ", ".join(k for k, v in kernels.items() if not v)
                             + " missing)")
        attn = peer.get("attn_implementation")
        if attn:
            notes.append(f"peer attn {attn}")
        rows.append([
            model_cell(data), device_cell(env), f"{w.get('name', '?')} ({w.get('num_requests', '?')} req)",
            _num(ours.get("output_tokens_per_s")), _num(ours.get("total_tokens_per_s")),
            _num(peer.get("output_tokens_per_s")), _num(peer.get("total_tokens_per_s")),
            _num(ratio.get("output_tokens_per_s"), ".2f", "×"), "; ".join(notes) or "–",
            commit_cell(env), versions_cell(env), f"`{path.name}`",
        ])
    return rows


def serve_rows(records: list[Record]) -> tuple[list[list[Any]], list[str]]:
    rows, notes = [], []
    for path, data in latest_per_key(records, "serve"):
        env, res = data.get("env", {}), data.get("results", {})
        w = res.get("workload") or {}
        core, transport, workers, procs = served_stack_of(data)
        # The primary stack, then any stack measured beside it in the same call (--also-stack).
        stacks = [(None, core, transport, workers, res.get("grpc_ttft_overhead_ms_c1"))]
        for st in res.get("also_stacks", []):
            stacks.append((st["label"], st["engine_core"], st["engine_transport"], st["frontend_workers"],
                           (res.get("also_stack_overheads", {}).get(st["label"]) or {}).get("grpc_ttft_overhead_ms_c1")))
        for label, core, transport, workers, overhead in stacks:
            for level in res.get("levels", []):
                slot = level if label is None else (level.get("served_stacks") or {}).get(label, {})
                s, p = slot.get("served") or {}, level.get("in_process") or {}
                done = f"{s.get('completed', 0)}/{level.get('num_requests', '?')}"
                if s.get("timed_out"):
                    done += " (timed out)"
                rows.append([
                    model_cell(data), device_cell(env), w.get("name", "?"), core, transport, workers, procs,
                    level.get("concurrency"), done,
                    _triple(s.get("ttft_ms")), _triple(s.get("tpot_ms"), ".2f"), _triple(s.get("itl_ms"), ".2f"),
                    _num(s.get("output_tokens_per_s")), _num(p.get("output_tokens_per_s")),
                    _ratio_cell(slot), _num(s.get("client_cpu_fraction"), ".2f"),
                    commit_cell(env), versions_cell(env), f"`{path.name}`",
                ])
            if overhead is not None:
                notes.append(f"- {model_cell(data)} on {device_cell(env)}, engine core {core}, transport {transport}, "
                             f"{workers} frontend worker(s), {procs} client process(es): "
                             f"frontend + gRPC TTFT overhead at "
                             f"concurrency 1 = {overhead:.2f} ms (served p50 − in-process p50)")
    return rows, notes


def _ratio_cell(slot: dict[str, Any]) -> str:
    """served ÷ in-process; for a run in rounds, the ratio of the medians and, beside it, the
    per-round paired ratios' median and range."""
    cell = _num(slot.get("ratio_output_tokens_per_s"), ".2f", "×")
    spread = slot.get("ratio_rounds")
    if spread:
        cell += (f" (medians of {len(spread['values'])} rounds; per round median {spread['median']:.2f}×, "
                 f"{spread['min']:.2f}–{spread['max']:.2f}×)")
    return cell


def transport_rows(records: list[Record]) -> list[list[Any]]:
    rows = []
    for path, data in latest_per_key(records, "transport"):
        env = data.get("env", {})
        for p in (data.get("results") or {}).get("points", []):
            rows.append([device_cell(env), p.get("shape"), p.get("transport"), p.get("bytes_per_message"),
                         _num(p.get("encode_us")), _num(p.get("send_us_in_burst")),
                         f"{_num(p.get('round_trip_us_p50'))} / {_num(p.get('round_trip_us_p99'))}",
                         _num(p.get("messages_per_s"), ".0f"), commit_cell(env), f"`{path.name}`"])
    return rows


def prefix_rows(records: list[Record]) -> list[list[Any]]:
    """`tandem bench prefix`: hit rates (the model and its full-attention twin) and the no-reuse cost."""
    rows = []
    for path, data in latest_per_key(records, "prefix"):
        env, res = data.get("env", {}), (data.get("results") or {}).get("prefix") or {}
        cost = (res.get("noreuse") or {}).get("cost") or {}
        for label, r in (res.get("hit_rate") or {}).items():
            c = r.get("ceiling") or {}
            rows.append([r.get("model"), device_cell(env), label, r.get("checkpoint_stride") or "—",
                         _num(r.get("hit_rate"), ".3f"), _num(r.get("kv_hit_rate"), ".3f"),
                         f"{_num(c.get('block'), '.3f')} / {_num(c.get('checkpoint'), '.3f')}",
                         _num(100 * cost["output_tokens_per_s"], ".2f", " %") if label == "model" and cost else "—",
                         commit_cell(env), f"`{path.name}`"])
    return rows


def disagg_rows(records: list[Record]) -> list[list[Any]]:
    """`tandem bench disagg`: one engine against a prefill and a decode engine, same traffic."""
    rows = []
    for path, data in latest_per_key(records, "disagg"):
        env, res = data.get("env", {}), (data.get("results") or {}).get("disagg") or {}
        runs = {r.get("shape"): r for r in res.get("runs", [])}
        base = (runs.get("single") or {}).get("decode_itl_ms", {}).get("p99")
        for shape, run in runs.items():
            if run.get("status") == "skipped":
                rows.append([model_cell(data), device_cell(env), shape, "skipped", "", "", "", "", "", "",
                             commit_cell(env), f"`{path.name}`"])
                continue
            itl = run.get("decode_itl_ms", {})
            pulled = sum(c.get("bytes_pulled", 0) for c in (run.get("kv_transfer") or {}).values())
            ratio = base / itl["p99"] if base and itl.get("p99") else None
            rows.append([model_cell(data), device_cell(env), shape,
                         f"{_num(itl.get('p50'))} / {_num(itl.get('p99'))}",
                         _num(ratio, ".2f", "×") if shape != "single" else "—",
                         f"{_num(run.get('short_ttft_ms', {}).get('p50'))} / {_num(run.get('short_ttft_ms', {}).get('p99'))}",
                         f"{_num(run.get('long_ttft_ms', {}).get('p50'))} / {_num(run.get('long_ttft_ms', {}).get('p99'))}",
                         f"{run.get('short_completed')} / {run.get('long_completed')}",
                         _num(run.get("output_tokens_per_s")), _num(pulled / 1e9, ".2f") if pulled else "—",
                         commit_cell(env), f"`{path.name}`"])
    return rows


def kv_transfer_rows(records: list[Record]) -> list[list[Any]]:
    """`python -m tandem.gpu_checks.kv_transfer`: pull rate per transport against device copies."""
    rows = []
    for path, data in latest_per_key(records, "kv_transfer"):
        env = data.get("env", {})
        report = (data.get("results") or {}).get("kv_transfer") or {}
        pull = (report.get("parts") or {}).get("pull") or {}
        copies = pull.get("device_copy") or {}
        gather = copies.get("block_gather_scatter_gb_per_s")
        engines = ((report.get("parts") or {}).get("engines") or {}).get("transports") or {}
        for name, t in (pull.get("transports") or {}).items():
            e = engines.get(name) or {}
            tokens = (f"{e.get('prompts_equal')} equal, {len(e.get('near_ties', []))} near ties, "
                      f"{len(e.get('mismatches', []))} mismatches" if e else "—")
            rows.append([model_cell(data), device_cell(env), name, _num(pull.get("bytes", 0) / 1e6, ".0f"),
                         "yes" if t.get("bytes_equal") else "NO", _num(t.get("gb_per_s"), ".2f"),
                         _num(gather, ".1f"), _num(t["gb_per_s"] / gather, ".2f", "×") if gather else "—",
                         _num(copies.get("contiguous_copy_gb_per_s"), ".0f"), tokens,
                         commit_cell(env), f"`{path.name}`"])
    return rows


def _headline(data: dict[str, Any]) -> str:
    res = data.get("results", {})
    kind = data.get("kind")
    if kind == "roofline":
        ok = [p for p in res.get("decode", []) if p.get("status") == "ok"]
        return f"{len(ok)} decode points" if ok else "no decode point"
    if kind == "throughput":
        r = res.get("ratio", {}).get("output_tokens_per_s")
        return f"{_num(res.get('ours', {}).get('output_tokens_per_s'))} out tok/s, ratio {_num(r, '.2f', '×')}"
    if kind == "overhead":
        return f"{len(res.get('points', []))} batch sizes"
    if kind == "soak":
        soak = res.get("soak") or {}
        return f"{soak.get('calls', 0)} calls, {'pass' if soak.get('passed') else 'FAIL'}"
    if kind == "transport":
        return f"{len(res.get('points', []))} transport points"
    if kind == "prefix":
        hits = (res.get("prefix") or {}).get("hit_rate") or {}
        cost = ((res.get("prefix") or {}).get("noreuse") or {}).get("cost") or {}
        parts = [f"{label} hit rate {_num(r.get('hit_rate'), '.3f')}" for label, r in hits.items()]
        if cost:
            parts.append(f"no-reuse cost {_num(100 * cost.get('output_tokens_per_s', 0), '.2f', ' %')}")
        return ", ".join(parts) or "no figure"
    if kind == "kv_transfer":
        report = res.get("kv_transfer") or {}
        rates = ((report.get("parts") or {}).get("pull") or {}).get("transports") or {}
        return ", ".join(f"{n} {_num(t.get('gb_per_s'), '.2f')} GB/s" for n, t in rates.items()) or "no pull"
    if kind == "disagg":
        runs = {r.get("shape"): r for r in (res.get("disagg") or {}).get("runs", [])}
        p99 = [_num((runs.get(k) or {}).get("decode_itl_ms", {}).get("p99")) for k in ("single", "disaggregated")]
        return f"ITL p99 {p99[0]} ms single, {p99[1]} ms disaggregated"
    if kind == "profile":
        return f"{len(res.get('decode', []))} decode, {len(res.get('prefill', []))} prefill profiles"
    levels = [lv for lv in res.get("levels", []) if lv.get("served", {}).get("output_tokens_per_s")]
    rounds = serve_rounds_of(data) if kind == "serve" else 1
    return f"{len(levels)} levels" + (f", {rounds} rounds" if rounds > 1 else "")


def _roofline_step_ms(records: list[Record], device: str, batch: Any, context: Any) -> tuple[float, str] | None:
    """The newest measured decode step of (`batch`, `context`) on `device`, and its file."""
    for path, data in reversed(records):
        if data.get("kind") != "roofline" or device_cell(data.get("env", {})) != device:
            continue
        for point in data.get("results", {}).get("decode", []):
            if point.get("status") == "ok" and point.get("batch") == batch and point.get("context") == context:
                return float(point["median_ms"]), path.name
    return None


def overhead_rows(records: list[Record]) -> list[list[Any]]:
    rows = []
    for path, data in latest_per_key(records, "overhead"):
        env = data.get("env", {})
        for p in data.get("results", {}).get("points", []):
            # Prefer the roofline step of the same batch on the same device over the run's single
            # --gpu-step-ms anchor (given for one batch size only).
            measured = _roofline_step_ms(records, device_cell(env), p.get("num_seqs"), p.get("context"))
            anchor, source = (measured[0], f"`{measured[1]}`") if measured else (p.get("gpu_step_ms_anchor"), "--gpu-step-ms")
            ratio = p.get("host_ms_median") / anchor if anchor and p.get("host_ms_median") is not None else None
            rows.append([device_cell(env), p.get("num_seqs"), p.get("context"), _num(p.get("host_ms_median"), ".2f"),
                         _num(p.get("host_ms_p90"), ".2f"), _num(anchor, ".2f"), source,
                         _num(ratio, ".2f", "×"), commit_cell(env), f"`{path.name}`"])
    return rows


def history_rows(records: list[Record]) -> list[list[Any]]:
    return [[f"`{path.name}`", data.get("kind"), model_cell(data), device_cell(data.get("env", {})),
             commit_cell(data.get("env", {})), data.get("env", {}).get("timestamp", "?"),
             "yes" if data.get("complete") else f"no ({len(data.get('errors', []))} errors)", _headline(data)]
            for path, data in reversed(records)]


# -- plot ----------------------------------------------------------------------------------------


def write_decode_plot(records: list[Record], out: Path) -> bool:
    """Measured decode step time and its floor against batch size, one panel per model/device."""
    series = [(p, d) for p, d in latest_per_key(records, "roofline")
              if any(pt.get("status") == "ok" for pt in d.get("results", {}).get("decode", []))]
    if not series:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(series), figsize=(6 * len(series), 4.2), squeeze=False)
    for ax, (_, data) in zip(axes[0], series):
        points = data["results"]["decode"]
        for ctx in sorted({pt["context"] for pt in points}):
            ok = sorted((pt for pt in points if pt["context"] == ctx and pt.get("status") == "ok"),
                        key=lambda pt: pt["batch"])
            if not ok:
                continue
            line = ax.plot([pt["batch"] for pt in ok], [pt["median_ms"] for pt in ok], marker="o",
                           label=f"measured, ctx {ctx}")[0]
            floor = [pt for pt in ok if pt.get("floor_ms") is not None]
            if floor:
                ax.plot([pt["batch"] for pt in floor], [pt["floor_ms"] for pt in floor], linestyle="--",
                        color=line.get_color(), label=f"floor, ctx {ctx}")
        env = data.get("env", {})
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (sequences)")
        ax.set_ylabel("decode step (ms)")
        ax.set_title(f"{data.get('model')} on {env.get('device')}\ncommit {str(env.get('git_commit'))[:10]}",
                     fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True


# -- the document --------------------------------------------------------------------------------


def render_markdown(records: list[Record], plot_name: str | None) -> str:
    lines = [
        "# Benchmarks",
        "",
        "Generated by `tandem bench report` from the JSON files in `bench/results/` "
        "(one file per run: `tandem bench roofline|throughput|serve`); do not edit by hand. "
        "Models use dummy (random) weights in the real configurations. Each table shows the "
        "latest result per model and device; every run is listed under History.",
        "",
        "Anchors: the decode floor is (weight bytes + KV bytes read, + for hybrid models each "
        "sequence's recurrent/conv state read and written back) ÷ the HBM bandwidth measured "
        "in the same run (device-to-device copy, bytes read + written); prefill MFU divides the "
        "step's FLOPs (2 × matmul weights × tokens, the LM head for sampled rows, causal "
        "attention, the Gated DeltaNet convolution and chunked delta rule) by the bf16 8192³ matmul "
        "rate measured in the same run; offline throughput "
        "is compared with Hugging Face continuous batching (`generate_batch`'s manager, per-request "
        "output lengths, EOS ignored) on the same weights and requests — for models it cannot serve "
        "(hybrids), with static left-padded `model.generate` batches (noted per row); serving is "
        "compared with the in-process engine on the same requests at the same concurrency.",
        "",
        "A serving run has a primary served stack and any stacks measured beside it in the same call "
        "(`--also-stack CORE:TRANSPORT:WORKERS`): the engine core's place (`--engine-core`: its own "
        "process, or a thread of the engine's gRPC process as before the engine-core split; rows "
        "from before it was recorded say thread), the frontend-engine transport (`--engine-transport`), "
        "the frontend processes sharing the port (`--frontend-workers`, SO_REUSEPORT) and the "
        "load-generator processes (`--client-procs`, `auto` = min(4, cores ÷ 4)), which split each "
        "level's concurrency and whose per-request records are merged into one set of statistics; "
        "each stack keeps its own rows. Runs from before these were recorded used one frontend and "
        "one client process whose channels shared a single connection; every channel is now its "
        "own connection, and with several frontend workers each client process dials until its "
        "connections cover the workers evenly (the JSON's `frontend_spread` counts requests per worker).",
        "",
        "A serving run in rounds (`--rounds N`) keeps the served stack and the in-process engine alive "
        "together and runs every level N times, the sides' order reversed each round, on fresh requests "
        "each round; its rows show per-metric medians over the rounds that ran to completion, its ratio "
        "is the ratio of the output tok/s medians, with the per-round paired ratios' median and range "
        "beside it, and it keeps rows of its own beside a single-round run of the same stack.",
        "",
        "Reproduce on a GPU machine (each run writes one JSON into `bench/results/`; commit it, then "
        "regenerate this page):",
        "",
        "```",
        "tandem bench roofline   --model dummy:qwen3-8b      # decode sweep 1..256 x 1k/8k, prefill 8x1024 and 1x8192",
        "tandem bench throughput --model dummy:qwen3-0.6b --workload nanovllm",
        "tandem bench serve      --model dummy:qwen3-0.6b --concurrency 1,16,64,256",
        "tandem bench serve      --model dummy:qwen3-0.6b --engine-transport mux --frontend-workers 4 --client-procs 4",
        "tandem bench serve      --model dummy:qwen3-0.6b --client-procs 4 --also-stack thread:stream:1 --also-stack thread:mux:4",
        "tandem bench serve      --model dummy:qwen3-0.6b --frontend-workers 4 --client-procs 4 --concurrency 64,256 "
        "--requests-per-level 768 --rounds 3 --num-kv-blocks 24576",
        "tandem bench report",
        "```",
        "",
        "## Decode step vs. roofline floor",
        "",
    ]
    lines += _table(["model", "device", "workload", "batch", "context", "step ms (median)", "floor ms",
                     "floor ÷ measured", "graph replay ms", "floor ÷ replay", "HBM TB/s", "path", "commit",
                     "versions", "result"], decode_rows(records))
    if plot_name:
        lines += [f"![Decode step time and its floor against batch size]({plot_name})", ""]
    lines += ["## Prefill MFU", ""]
    lines += _table(["model", "device", "workload", "tokens", "ms (median)", "TFLOP/s", "matmul TFLOP/s", "MFU",
                     "commit", "versions", "result"], prefill_rows(records))
    lines += ["## Offline throughput vs. Hugging Face", ""]
    lines += _table(["model", "device", "workload", "ours out tok/s", "ours total tok/s", "peer out tok/s",
                     "peer total tok/s", "ours ÷ peer", "notes", "commit", "versions", "result"],
                    throughput_rows(records))
    rows, notes = serve_rows(records)
    lines += ["## Serving over gRPC (frontend + engine)", ""]
    lines += _table(["model", "device", "workload", "engine core", "transport", "frontend workers", "client procs",
                     "concurrency", "completed", "TTFT ms p50 / p90 / p99",
                     "TPOT ms p50 / p90 / p99", "ITL ms p50 / p90 / p99", "out tok/s", "in-process out tok/s",
                     "served ÷ in-process", "busiest client CPU", "commit", "versions", "result"], rows)
    if notes:
        lines += [*notes, ""]
    transport = transport_rows(records)
    if transport:  # the engine core's output transport (`tandem bench transport`)
        lines += ["## Engine-core output transport", "",
                  "One `CoreOutputs` message per step sent from a process to a child that decodes it: what the "
                  "sender (the engine core) pays per message when streaming, the round trip of one message, "
                  "and the streaming rate.", ""]
        lines += _table(["host", "shape", "transport", "bytes", "encode µs", "send µs (streaming)",
                         "round trip µs p50 / p99", "messages/s", "commit", "result"], transport)
    prefix = prefix_rows(records)
    if prefix:  # `tandem bench prefix`: hybrid models' prefix caching (state checkpoints)
        lines += ["## Prefix caching of hybrid models", "",
                  "Shared-prefix workload: hit rate (prompt tokens served from the cache) of the hybrid model "
                  "and of its full-attention twin (same depth, every layer attention), the K/V-only hit rate, "
                  "and the ceilings at block / checkpoint granularity. No-reuse workload: 1 − throughput with "
                  "prefix caching on ÷ off (output tok/s; goal ≤ 3 %). Method: docs/architecture.md, "
                  "\"Prefix caching with state checkpoints\".", ""]
        lines += _table(["model", "device", "side", "checkpoint stride", "hit rate", "K/V-only hit rate",
                         "ceiling block / checkpoint", "no-reuse cost", "commit", "result"], prefix)
    disagg = disagg_rows(records)
    if disagg:  # `tandem bench disagg`
        lines += ["## Disaggregated prefill/decode", "",
                  "`tandem bench disagg`: the same mixed traffic (closed-loop decode streams, long prompts "
                  "arriving during them, short requests) against one engine with both engines' KV blocks, then "
                  "against a prefill engine and a decode engine behind one frontend (`serve --disaggregated`). "
                  "The anchor is the single engine's decode ITL p99 in the same call (single ÷ disaggregated: "
                  "above 1× is better).", ""]
        lines += _table(["model", "device", "shape", "decode ITL ms p50 / p99", "ITL p99 gain",
                         "short TTFT ms p50 / p99", "long TTFT ms p50 / p99", "short / long completed",
                         "out tok/s", "KV GB pulled", "commit", "result"], disagg)
    kv = kv_transfer_rows(records)
    if kv:  # `python -m tandem.gpu_checks.kv_transfer`
        lines += ["## KV transfer between engine processes", "",
                  "`python -m tandem.gpu_checks.kv_transfer`: a producer process serves a model-shaped KV cache "
                  "under a lease; this process pulls every block into permuted blocks of its own, checks the "
                  "bytes, and reports GB/s against the same block gather/scatter between two local caches "
                  "(the anchor) and a contiguous copy, both measured in the same run. Then two engine "
                  "processes: greedy tokens of prefill leg + decode leg against one engine's (near ties: a "
                  "flip between tokens within 0.1 nats in the single run's log-probabilities).", ""]
        lines += _table(["model", "device", "transport", "MB pulled", "bytes equal", "GB/s", "gather/scatter GB/s",
                         "÷ gather/scatter", "contiguous copy GB/s", "two engines vs one", "commit", "result"], kv)
    lines += ["## Host overhead per engine step", "",
              "Host (CPU) time of `LLMEngine.step()` with a model-free runner (`tandem bench overhead`): "
              "scheduling, host input preparation, token readback, stop checks and bookkeeping; the "
              "anchor is the GPU decode step at the same batch and context from the newest roofline run on "
              "the same device (its file is named), else the run's own `--gpu-step-ms`. With overlapped "
              "scheduling this host time runs while the GPU computes the previous step.", ""]
    lines += _table(["host", "running seqs", "context", "host ms p50", "host ms p90", "GPU step ms (anchor)",
                     "anchor from", "host ÷ GPU step", "commit", "result"], overhead_rows(records))
    lines += ["## History", ""]
    lines += _table(["result", "kind", "model", "device", "commit", "timestamp (UTC)", "complete", "headline"],
                    history_rows(records))
    return "\n".join(lines).rstrip() + "\n"


def build_report(results_dir: str | Path = DEFAULT_RESULTS_DIR, markdown: str | Path = DEFAULT_MARKDOWN,
                 plot: str | Path = DEFAULT_PLOT) -> dict[str, Any]:
    """Write the markdown (and the plot when there are decode results); what was written."""
    records = read_records(results_dir) if Path(results_dir).is_dir() else []
    md_path, plot_path = Path(markdown), Path(plot)
    has_plot = write_decode_plot(records, plot_path)
    if not has_plot and plot_path.exists():
        plot_path.unlink()  # a plot of results that are gone would be a stale claim
    plot_ref = None
    if has_plot:
        try:
            plot_ref = str(plot_path.resolve().relative_to(md_path.resolve().parent))
        except ValueError:
            plot_ref = str(plot_path.resolve())
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(render_markdown(records, plot_ref))
    log.info("benchmark report written", markdown=str(md_path), plot=str(plot_path) if has_plot else None,
             results=len(records))
    return {"markdown": str(md_path), "plot": str(plot_path) if has_plot else None, "results": len(records)}
