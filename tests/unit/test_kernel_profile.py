"""`tandem bench profile`'s trace analysis on hand-made Kineto-style events, and its layer
annotations on a real (CPU-only) torch.profiler run."""

import torch

from tandem.bench.kernel_profile import (
    OUTSIDE,
    UNALIGNED,
    align_tags,
    annotated_layers,
    annotations,
    durations_and_gaps,
    layer_kinds,
    layer_tags,
    median_positions,
    summarize,
    trace_events,
)


def kernel(name: str, ts: float, dur: float, corr: int) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def launch(ts: float, corr: int) -> dict:
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1.0,
            "args": {"correlation": corr}}


def test_gaps_are_idle_time_before_each_kernel() -> None:
    ks = [kernel("a", 0.0, 5.0, 1), kernel("b", 7.0, 2.0, 2), kernel("c", 9.0, 1.0, 3), kernel("d", 14.0, 1.0, 4)]
    durs, gaps = durations_and_gaps(ks)
    assert durs == [5.0, 2.0, 1.0, 1.0]
    assert gaps == [0.0, 2.0, 0.0, 4.0]


def test_kernels_take_the_layer_whose_host_range_holds_their_launch() -> None:
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "layer.0", "ts": 10.0, "dur": 10.0},
        {"ph": "X", "cat": "user_annotation", "name": "layer.1", "ts": 20.5, "dur": 10.0},
        launch(5.0, 1), launch(12.0, 2), launch(25.0, 3), launch(40.0, 4),
    ]
    # GPU times say nothing about the layer: kernel 3 runs long after layer.1's host range.
    ks = [kernel("embed", 50.0, 1.0, 1), kernel("x", 51.0, 1.0, 2), kernel("y", 52.0, 1.0, 3),
          kernel("head", 53.0, 1.0, 4)]
    assert layer_tags(ks, events) == [OUTSIDE, "layer.0", "layer.1", OUTSIDE]


def test_graph_kernels_take_the_tags_of_the_aligned_eager_sequence() -> None:
    eager_names = ["copy", "embed", "norm", "gemm", "attn", "norm", "gemm", "attn", "head"]
    eager_tags = [OUTSIDE, OUTSIDE, "layer.0", "layer.0", "layer.0", "layer.1", "layer.1", "layer.1", OUTSIDE]
    graph_names = ["embed", "norm", "gemm", "attn", "norm", "extra", "gemm", "attn", "head"]
    tags = align_tags(eager_names, eager_tags, graph_names)
    assert tags == [OUTSIDE, "layer.0", "layer.0", "layer.0", "layer.1", UNALIGNED, "layer.1", "layer.1", OUTSIDE]


def test_summary_per_layer_kind_and_medians_over_steps() -> None:
    step = [kernel("a", 0.0, 2.0, 1), kernel("b", 3.0, 4.0, 2), kernel("a", 8.0, 2.0, 3), kernel("c", 10.0, 1.0, 4)]
    slower = [dict(k, dur=k["dur"] * 3) for k in step]
    names, durs, gaps = median_positions([step, step, slower])
    assert names == ["a", "b", "a", "c"] and durs == [2.0, 4.0, 2.0, 1.0]
    tags = ["layer.0", "layer.0", "layer.1", OUTSIDE]
    s = summarize(names, tags, durs, gaps, ["Attn+MLP", "Attn+MLP"], top=2)
    assert s["kernels"] == 4 and s["kernel_us"] == 9.0 and s["gap_us"] == gaps[1] + gaps[2] + gaps[3]
    assert [k["name"] for k in s["top_kernels"]] == ["a", "b"] and s["top_kernels"][0]["count"] == 2
    kind = s["layer_kinds"]["Attn+MLP"]
    assert kind["layers"] == 2 and kind["kernel_us_per_layer"] == 4.0
    assert [k["name"] for k in kind["sequence"]] == ["a"]  # layer 1, the middle one of two
    assert s["outside_layers"][OUTSIDE]["kernels"] == 1


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x))


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Block(), Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_layer_annotations_in_a_real_profile_and_hooks_removed_after() -> None:
    from torch.profiler import ProfilerActivity, profile

    model = Tiny()
    assert layer_kinds(model) == ["Linear"] * 3
    with profile(activities=[ProfilerActivity.CPU]) as prof, annotated_layers(model):
        model(torch.randn(2, 4))
    names = [a["name"] for a in annotations(trace_events(prof), "layer.")]
    assert names == ["layer.0", "layer.1", "layer.2"]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(torch.randn(2, 4))
    assert annotations(trace_events(prof), "layer.") == []
