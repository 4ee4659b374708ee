"""`tandem bench profile`: where one step's time goes, kernel by kernel and layer by layer.

Built like `tandem bench roofline` (dummy weights, the engine's `ModelRunner` and `StepWorker`,
fake step plans on the paged cache; `roofline.py`'s helpers), then profiled with torch.profiler:

* Decode (`BATCHxCONTEXT`, default 1x1024): the step as served, `StepWorker.execute` of a
  pure-decode batch (host inputs, copies into the graph's buffers, CUDA-graph replay, logits),
  `steps` times, each step closed by a synchronisation inside its own annotation. Kernels the
  graph launched are those sharing the `cudaGraphLaunch`'s correlation id; the others are the
  step's input copies and logits gather. A graph replay carries no host-side annotation, so each
  graph kernel is given a decoder layer by aligning the graph's kernel names (difflib, no junk
  heuristic) with one eager forward of the same batch whose decoder layers are annotated
  (`record_function` from forward hooks); a kernel left unaligned is counted as such.
* Prefill (`NxLEN`, optional): one eager step, its kernels given a layer by their launch call
  (correlation id → the annotated layer whose host interval holds the launch); the per-layer host
  time is what issuing the launches costs.

Per kernel position the medians over the profiled steps are kept. A gap is the idle time on the
GPU between the end of the previous kernel and the start of this one, counted to this kernel
(and so to its layer). Unprofiled CUDA-event medians of the same steps are recorded beside: the
profiler adds some cost per launch, mostly to eager steps.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog
import torch

from tandem.bench.results import BenchRecord, Deadline
from tandem.bench.roofline import (
    PlannedBatch,
    RooflineOptions,
    describe_runner,
    fake_plan,
    make_worker,
    num_paged_groups,
    num_state_slots,
    plan_num_blocks,
    replay_only,
    uniform_window,
)
from tandem.bench.timing import cuda_time, require_cuda

log = structlog.get_logger(__name__)

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
OUTSIDE = "outside layers"
UNALIGNED = "unaligned"


@dataclass
class ProfileOptions:
    decode_shapes: list[tuple[int, int]] = field(default_factory=lambda: [(1, 1024)])
    prefill_shapes: list[tuple[int, int]] = field(default_factory=list)
    steps: int = 10  # profiled decode steps (medians per kernel position)
    reps: int = 30  # unprofiled timing runs
    top: int = 15  # kernels listed by total time
    seed: int = 0


# -- trace reading ---------------------------------------------------------------------------------


def trace_events(prof: Any) -> list[dict[str, Any]]:
    """The complete ('X') events of a finished torch.profiler run, from its Chrome trace."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    return [e for e in events if e.get("ph") == "X"]


def _correlation(event: dict[str, Any]) -> Any:
    return event.get("args", {}).get("correlation")


def gpu_activities(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Kernels, memcpys and memsets in start order."""
    return sorted((e for e in events if e.get("cat") in GPU_CATEGORIES), key=lambda e: e["ts"])


def annotations(events: list[dict[str, Any]], prefix: str) -> list[dict[str, Any]]:
    """Host-side `record_function` ranges whose name starts with `prefix`, in start order."""
    return sorted((e for e in events if e.get("cat") == "user_annotation" and e.get("name", "").startswith(prefix)),
                  key=lambda e: e["ts"])


def within(kernels: list[dict[str, Any]], span: dict[str, Any]) -> list[dict[str, Any]]:
    """The GPU activities that ran inside a host range closed by a synchronisation."""
    end = span["ts"] + span["dur"]
    return [k for k in kernels if span["ts"] <= k["ts"] and k["ts"] + k.get("dur", 0) <= end]


def layer_tags(kernels: list[dict[str, Any]], events: list[dict[str, Any]], prefix: str = "layer.") -> list[str]:
    """Each kernel's layer annotation, found through its launch call (same correlation id); a
    kernel whose launch was not traced falls back on the annotation's GPU-side range."""
    launches = {_correlation(e): e for e in events if e.get("cat") in LAUNCH_CATEGORIES and _correlation(e) is not None}
    host = annotations(events, prefix)
    gpu = sorted((e for e in events if e.get("cat") == "gpu_user_annotation" and e.get("name", "").startswith(prefix)),
                 key=lambda e: e["ts"])
    tags = []
    for k in kernels:
        launch = launches.get(_correlation(k))
        tag = _enclosing(host, launch["ts"]) if launch is not None else _enclosing(gpu, k["ts"])
        tags.append(tag or OUTSIDE)
    return tags


def _enclosing(ranges: list[dict[str, Any]], ts: float) -> str | None:
    """The name of the range (sorted, not overlapping) that holds `ts`, if any."""
    i = int(np.searchsorted([r["ts"] for r in ranges], ts, side="right")) - 1
    if i >= 0 and ts <= ranges[i]["ts"] + ranges[i]["dur"]:
        return ranges[i]["name"]
    return None


def align_tags(reference_names: list[str], reference_tags: list[str], names: list[str]) -> list[str]:
    """Tags for `names` from the matching stretches of a tagged reference sequence of names."""
    tags = [UNALIGNED] * len(names)
    matcher = difflib.SequenceMatcher(None, reference_names, names, autojunk=False)
    for block in matcher.get_matching_blocks():
        for j in range(block.size):
            tags[block.b + j] = reference_tags[block.a + j]
    return tags


def durations_and_gaps(kernels: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """Per activity its duration and the idle time before it since the previous one ended (µs;
    0 for the first)."""
    durs = [float(k.get("dur", 0.0)) for k in kernels]
    gaps = [0.0]
    end = kernels[0]["ts"] + durs[0] if kernels else 0.0
    for k, d in zip(kernels[1:], durs[1:]):
        gaps.append(max(k["ts"] - end, 0.0))
        end = max(end, k["ts"] + d)
    return durs, gaps


# -- summaries ---------------------------------------------------------------------------------


def layer_kinds(model: torch.nn.Module) -> list[str]:
    """Per decoder layer a label of what it holds (its sub-modules' classes, norms left out)."""
    return ["+".join(type(c).__name__ for c in layer.children() if "Norm" not in type(c).__name__)
            for layer in decoder_layers(model)]


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's decoder stack: its longest ModuleList named `layers`."""
    found = [m for name, m in model.named_modules()
             if isinstance(m, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers"]
    if not found:
        raise ValueError(f"{type(model).__name__} has no `layers` ModuleList")
    return max(found, key=len)


@contextlib.contextmanager
def annotated_layers(model: torch.nn.Module) -> Iterator[None]:
    """A `record_function` range `layer.<i>` around every decoder layer's forward."""
    open_ranges: dict[int, Any] = {}
    handles = []
    for i, layer in enumerate(decoder_layers(model)):
        def pre(_module: Any, _args: Any, i: int = i) -> None:
            open_ranges[i] = torch.profiler.record_function(f"layer.{i}")
            open_ranges[i].__enter__()

        def post(_module: Any, _args: Any, _out: Any, i: int = i) -> None:
            open_ranges.pop(i).__exit__(None, None, None)

        handles += [layer.register_forward_pre_hook(pre), layer.register_forward_hook(post)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def summarize(names: list[str], tags: list[str], durs: list[float], gaps: list[float], kinds: list[str],
              top: int, layer_host_us: dict[str, float] | None = None) -> dict[str, Any]:
    """Totals, the top kernels by time, per layer kind (means per layer) and one layer's sequence."""
    per_name: dict[str, dict[str, float]] = {}
    for n, d in zip(names, durs):
        s = per_name.setdefault(n, {"count": 0, "total_us": 0.0})
        s["count"] += 1
        s["total_us"] += d
    kernel_us, gap_us = float(sum(durs)), float(sum(gaps))
    top_kernels = [{"name": n, **s, "mean_us": s["total_us"] / s["count"], "share": s["total_us"] / kernel_us}
                   for n, s in sorted(per_name.items(), key=lambda kv: -kv[1]["total_us"])[:top]]
    per_tag: dict[str, dict[str, float]] = {}
    for t, d, g in zip(tags, durs, gaps):
        s = per_tag.setdefault(t, {"kernels": 0, "kernel_us": 0.0, "gap_us": 0.0})
        s["kernels"] += 1
        s["kernel_us"] += d
        s["gap_us"] += g
    by_kind: dict[str, dict[str, Any]] = {}
    for i, kind in enumerate(kinds):
        s = per_tag.get(f"layer.{i}", {"kernels": 0, "kernel_us": 0.0, "gap_us": 0.0})
        k = by_kind.setdefault(kind, {"layers": 0, "kernels": [], "kernel_us": [], "gap_us": [], "host_us": []})
        k["layers"] += 1
        k["kernels"].append(s["kernels"])
        k["kernel_us"].append(s["kernel_us"])
        k["gap_us"].append(s["gap_us"])
        if layer_host_us is not None and f"layer.{i}" in layer_host_us:
            k["host_us"].append(layer_host_us[f"layer.{i}"])
    kinds_out = {}
    for kind, k in by_kind.items():
        first = kinds.index(kind)
        middle = [i for i, x in enumerate(kinds) if x == kind][k["layers"] // 2]
        seq = [{"name": n, "us": d, "gap_before_us": g}
               for n, t, d, g in zip(names, tags, durs, gaps) if t == f"layer.{middle}"]
        kinds_out[kind] = {
            "layers": k["layers"], "first_layer": first, "sequence_of_layer": middle,
            "kernels_per_layer": float(np.median(k["kernels"])),
            "kernel_us_per_layer": float(np.mean(k["kernel_us"])),
            "gap_us_per_layer": float(np.mean(k["gap_us"])),
            **({"host_us_per_layer": float(np.mean(k["host_us"]))} if k["host_us"] else {}),
            "sequence": seq,
        }
    outside = {t: s for t, s in per_tag.items() if not t.startswith("layer.")}
    return {"kernels": len(names), "kernel_us": kernel_us, "gap_us": gap_us, "top_kernels": top_kernels,
            "layer_kinds": kinds_out, "outside_layers": outside}


def median_positions(steps: list[list[dict[str, Any]]]) -> tuple[list[str], list[float], list[float]]:
    """Names of the first step's activities and, per position, the median duration and gap over
    the steps that launched the same sequence of names."""
    names = [k["name"] for k in steps[0]]
    same = [s for s in steps if [k["name"] for k in s] == names]
    per_step = [durations_and_gaps(s) for s in same]
    durs = np.median(np.array([d for d, _ in per_step]), axis=0).tolist() if names else []
    gaps = np.median(np.array([g for _, g in per_step]), axis=0).tolist() if names else []
    return names, durs, gaps


# -- the runs ----------------------------------------------------------------------------------


def _profile(fn: Callable[[], None]) -> list[dict[str, Any]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
    return trace_events(prof)


def _eager(runner: Any) -> contextlib.AbstractContextManager[None]:
    """Runs the runner's steps eagerly meanwhile (its decode and piecewise graphs set aside)."""
    @contextlib.contextmanager
    def cm() -> Iterator[None]:
        graphs, runner.cuda_graphs = runner.cuda_graphs, None
        pieces, runner.piecewise_graphs = runner.piecewise_graphs, None
        try:
            yield
        finally:
            runner.cuda_graphs, runner.piecewise_graphs = graphs, pieces
    return cm()


def profile_eager_step(planned: PlannedBatch, kinds: list[str], top: int) -> dict[str, Any]:
    """One eager step (after a warm-up), its kernels per annotated layer, host time per layer."""
    runner = planned.worker.runner
    device = runner.device
    with _eager(runner):
        planned.execute()
        torch.cuda.synchronize(device)

        def step() -> None:
            with annotated_layers(runner.model), torch.profiler.record_function("profile.step"):
                planned.execute()
                torch.cuda.synchronize(device)

        events = _profile(step)
    span = annotations(events, "profile.step")[0]
    kernels = within(gpu_activities(events), span)
    tags = layer_tags(kernels, events)
    durs, gaps = durations_and_gaps(kernels)
    host = {r["name"]: float(r["dur"]) for r in annotations(events, "layer.")}
    out = summarize([k["name"] for k in kernels], tags, durs, gaps, kinds, top, host)
    out["host_step_us"] = float(span["dur"])
    out["gpu_span_us"] = (kernels[-1]["ts"] + durs[-1] - kernels[0]["ts"]) if kernels else 0.0
    out["host_in_layers_us"] = float(sum(host.values()))
    out["tagged_kernels"] = [{"name": k["name"], "tag": t, "us": d, "gap_before_us": g}
                             for k, t, d, g in zip(kernels, tags, durs, gaps)]
    return out


def profile_graph_steps(planned: PlannedBatch, steps: int) -> dict[str, Any]:
    """`steps` served decode steps; the graph's activities and the others, per step."""
    device = planned.worker.runner.device
    for _ in range(3):
        planned.execute()
    torch.cuda.synchronize(device)

    def run() -> None:
        for i in range(steps):
            with torch.profiler.record_function(f"profile.step.{i}"):
                planned.execute()
                torch.cuda.synchronize(device)

    events = _profile(run)
    graph_ids = {_correlation(e) for e in events
                 if e.get("cat") == "cuda_runtime" and e.get("name", "").startswith("cudaGraphLaunch")}
    activities = gpu_activities(events)
    graph_steps, other_steps, step_spans = [], [], []
    for span in annotations(events, "profile.step."):
        mine = within(activities, span)
        graph_steps.append([k for k in mine if _correlation(k) in graph_ids])
        other_steps.append([k for k in mine if _correlation(k) not in graph_ids])
        step_spans.append(float(span["dur"]))
    separable = any(graph_steps)
    if not separable:  # no kernel carried the graph launch's id: keep each step's activities whole
        graph_steps, other_steps = other_steps, [[] for _ in other_steps]
    return {"graph_steps": graph_steps, "other_steps": other_steps, "host_step_us": step_spans,
            "graph_launches": len(graph_ids), "graph_kernels_separable": separable}


def profile_decode(worker: Any, batch: int, context: int, kinds: list[str], options: ProfileOptions,
                   rng: np.random.Generator, shape_window: int | None) -> dict[str, Any]:
    runner = worker.runner
    plan, _ = fake_plan(batch, context, 1, runner.block_size, runner.num_blocks, runner.vocab_size, rng,
                        tag=f"-prof-d{batch}x{context}", window=shape_window, num_groups=num_paged_groups(runner),
                        num_state_slots=num_state_slots(runner))
    planned = PlannedBatch(worker, plan)
    point: dict[str, Any] = {"batch": batch, "context": context}
    try:
        t = cuda_time(planned.execute, runner.device, warmup=3, reps=options.reps)
        point["step_ms"] = t.as_dict()
        replay = replay_only(runner, planned)
        if replay is not None:
            point["replay_only_ms"] = cuda_time(replay, runner.device, warmup=2, reps=options.reps).as_dict()
        eager = profile_eager_step(planned, kinds, options.top)
        with _eager(runner):
            point["eager_step_ms"] = cuda_time(planned.execute, runner.device, warmup=2, reps=options.reps).as_dict()
        point["eager"] = {k: v for k, v in eager.items() if k != "tagged_kernels"}
        served = profile_graph_steps(planned, options.steps)
        point["graph_launches"] = served["graph_launches"]
        point["graph_kernels_separable"] = served["graph_kernels_separable"]
        point["host_step_us_profiled"] = float(np.median(served["host_step_us"]))
        if served["graph_steps"] and served["graph_steps"][0]:
            names, durs, gaps = median_positions(served["graph_steps"])
            ref = eager["tagged_kernels"]
            tags = align_tags([k["name"] for k in ref], [k["tag"] for k in ref], names)
            graph = summarize(names, tags, durs, gaps, kinds, options.top)
            graph["span_us"] = float(np.median([s[-1]["ts"] + s[-1].get("dur", 0) - s[0]["ts"]
                                                for s in served["graph_steps"]]))
            graph["unaligned_kernels"] = tags.count(UNALIGNED)
            point["graph"] = graph
        else:
            point["graph"] = None
            point["graph_note"] = "no GPU activity inside the profiled steps"
        others = served["other_steps"][0] if served["other_steps"] else []
        o_durs, _ = durations_and_gaps(others)
        point["outside_graph"] = {"activities": len(others), "kernel_us": float(sum(o_durs)),
                                  "names": sorted({k["name"] for k in others})}
    finally:
        planned.release()
    return point


def profile_prefill(worker: Any, num_seqs: int, seq_len: int, kinds: list[str], options: ProfileOptions,
                    rng: np.random.Generator) -> dict[str, Any]:
    runner = worker.runner
    plan, _ = fake_plan(num_seqs, seq_len, seq_len, runner.block_size, runner.num_blocks, runner.vocab_size, rng,
                        tag=f"-prof-p{num_seqs}x{seq_len}", num_groups=num_paged_groups(runner),
                        num_state_slots=num_state_slots(runner))
    planned = PlannedBatch(worker, plan)
    try:
        point: dict[str, Any] = {"num_seqs": num_seqs, "seq_len": seq_len}
        # As served: piecewise CUDA graphs when the runner captured them for this many tokens.
        point["piecewise_graphs"] = bool(runner.piecewise_graphs is not None and runner.piecewise_graphs.sizes[-1]
                                         >= num_seqs * seq_len)
        point["step_ms"] = cuda_time(planned.execute, runner.device, warmup=2, reps=options.reps).as_dict()
        with _eager(runner):
            point["eager_step_ms"] = cuda_time(planned.execute, runner.device, warmup=2, reps=options.reps).as_dict()
        eager = profile_eager_step(planned, kinds, options.top)
        point["eager"] = {k: v for k, v in eager.items() if k != "tagged_kernels"}
    finally:
        planned.release()
    return point


def run_profile(record: BenchRecord, engine_config: Any, options: ProfileOptions, deadline: Deadline) -> None:
    """Fill `record.results` with one entry per decode and prefill shape (errors recorded)."""
    from tandem.bench.accounting import shape_from_hf_config, state_bytes_per_request
    from tandem.engine_service.worker.loader import resolve_model
    from tandem.engine_service.worker.model_runner import ModelRunner, resolve_device

    device = require_cuda(resolve_device(engine_config.model.device), "tandem bench profile")
    res = record.results
    res["options"] = {k: v for k, v in vars(options).items()}
    res["method"] = __doc__
    resolved = resolve_model(engine_config.model.model, engine_config.model.cache_dir)
    shape = shape_from_hf_config(resolved.config)
    dtype_bytes = 4 if engine_config.model.dtype == "float32" else 2
    max_len = engine_config.model.max_model_len or resolved.config.get("max_position_embeddings", 1 << 30)
    sc = engine_config.scheduler
    sc.max_num_seqs = max([sc.max_num_seqs] + [b for b, _ in options.decode_shapes])
    sc.max_num_batched_tokens = max([sc.max_num_batched_tokens] + [n * L for n, L in options.prefill_shapes])
    engine_config.cache.enable_prefix_caching = False  # fake batches never hit it (see roofline)
    if engine_config.cache.num_blocks is None:
        free, _ = torch.cuda.mem_get_info(device)
        slots = sc.max_num_seqs if state_bytes_per_request(shape, dtype_bytes) else 0
        sizing = RooflineOptions(batches=[b for b, _ in options.decode_shapes] or [1],
                                 contexts=[c for _, c in options.decode_shapes] or [1],
                                 prefill_shapes=options.prefill_shapes or [(1, 1)])
        engine_config.cache.num_blocks = plan_num_blocks(shape, dtype_bytes, engine_config.cache.block_size, sizing,
                                                         free, max_len, slots)["num_blocks"]
    with record.stage("build_runner", reraise=True):
        runner = ModelRunner(engine_config)
    res["runner"] = describe_runner(runner)
    kinds = layer_kinds(runner.model)
    res["layer_kinds"] = kinds
    worker = make_worker(runner)
    rng = np.random.default_rng(options.seed)
    res["decode"], res["prefill"] = [], []
    for batch, context in options.decode_shapes:
        with record.stage(f"decode {batch}x{context}"):
            res["decode"].append(profile_decode(worker, batch, context, kinds, options, rng, uniform_window(shape)))
    for num_seqs, seq_len in options.prefill_shapes:
        with record.stage(f"prefill {num_seqs}x{seq_len}"):
            res["prefill"].append(profile_prefill(worker, num_seqs, seq_len, kinds, options, rng))


# -- the terminal table ------------------------------------------------------------------------


def _short(name: str, width: int = 56) -> str:
    return name if len(name) <= width else name[: width - 1] + "…"


def _kind_lines(label: str, summary: dict[str, Any]) -> list[str]:
    lines = [f"  {label}: {summary['kernels']} kernels, {summary['kernel_us']:.0f} µs in kernels, "
             f"{summary['gap_us']:.0f} µs in gaps"]
    for kind, k in summary["layer_kinds"].items():
        host = f", host {k['host_us_per_layer']:.0f} µs" if "host_us_per_layer" in k else ""
        lines.append(f"    {kind} x{k['layers']}: {k['kernels_per_layer']:.0f} kernels/layer, "
                     f"{k['kernel_us_per_layer']:.1f} µs kernels + {k['gap_us_per_layer']:.1f} µs gaps per layer{host}")
    for t, s in summary["outside_layers"].items():
        lines.append(f"    {t}: {s['kernels']} kernels, {s['kernel_us']:.1f} µs + {s['gap_us']:.1f} µs gaps")
    for k in summary["top_kernels"][:8]:
        lines.append(f"    {k['total_us']:8.1f} µs {100 * k['share']:5.1f}% x{k['count']:<4} {_short(k['name'])}")
    return lines


def short_table(results: dict[str, Any]) -> list[str]:
    lines = []
    for p in results.get("decode", []):
        lines.append(f"decode {p['batch']}x{p['context']}: step {p['step_ms']['median_ms']:.3f} ms, "
                     f"replay {p.get('replay_only_ms', {}).get('median_ms', float('nan')):.3f} ms, "
                     f"eager {p['eager_step_ms']['median_ms']:.3f} ms")
        if p.get("graph"):
            lines += _kind_lines(f"graph (span {p['graph']['span_us']:.0f} µs, "
                                 f"{p['graph']['unaligned_kernels']} unaligned)", p["graph"])
        lines += _kind_lines(f"eager (host {p['eager']['host_step_us']:.0f} µs)", p["eager"])
    for p in results.get("prefill", []):
        lines.append(f"prefill {p['num_seqs']}x{p['seq_len']}: step {p['step_ms']['median_ms']:.3f} ms"
                     f"{' (piecewise graphs)' if p.get('piecewise_graphs') else ''}, "
                     f"eager {p['eager_step_ms']['median_ms']:.3f} ms")
        lines += _kind_lines(f"eager (host {p['eager']['host_step_us']:.0f} µs, GPU span "
                             f"{p['eager']['gpu_span_us']:.0f} µs)", p["eager"])
    return lines
