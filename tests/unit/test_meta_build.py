"""`build_model` constructs parameters on the meta device, quantizes there and only then allocates
(`worker/meta_init.py`): the model it returns must be the one the eager build gives (construct on
the device, quantize, fill), with the aliasing of merged projections, tied embeddings and FP8
scale links intact, and building it must never hold the model in the model dtype when its
layers are FP8.

The eager build is `build_model` with the two meta steps switched off (`eager_build`): the same
construction, quantization and filling code, which is what the loader did before.
"""

from __future__ import annotations

import contextlib
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # the fused op set's aliasing is checked on CPU

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from tandem.engine_service.dummy_configs import get_dummy_config  # noqa: E402
from tandem.engine_service.layers.merged_linear import MergedColumnLinear  # noqa: E402
from tandem.engine_service.sequence import SamplingParams, Sequence  # noqa: E402
from tandem.engine_service.worker import loader  # noqa: E402
from tandem.engine_service.worker.input_batch import build_model_inputs  # noqa: E402
from tandem.engine_service.worker.loader import ResolvedModel, build_model, planned_weight_bytes, \
    resolve_model  # noqa: E402
from tandem.engine_service.worker.meta_init import materialize, meta_parameters  # noqa: E402
from tandem.kernels.fp8_gemm import FP8_DTYPE  # noqa: E402
from tests.unit.test_fp8_checkpoint import write_fp8  # noqa: E402

FAMILIES = ["tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen3-next"]
BLOCK_SIZE = 4
NUM_BLOCKS = 32


@contextlib.contextmanager
def eager_build():
    """`build_model` as it was before meta construction: parameters allocated on the device in
    the model dtype at construction, then quantized."""
    saved = loader.meta_parameters, loader.materialize
    loader.meta_parameters, loader.materialize = contextlib.nullcontext, lambda model, device: None
    try:
        yield
    finally:
        loader.meta_parameters, loader.materialize = saved


def both_builds(resolved: ResolvedModel, **kwargs) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(meta build, eager build) of the same model, on CPU in float32."""
    meta = build_model(resolved, "cpu", torch.float32, **kwargs)
    with eager_build():
        eager = build_model(resolved, "cpu", torch.float32, **kwargs)
    return meta, eager


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


@torch.inference_mode()
def greedy_logits(model: torch.nn.Module, prompt: list[int], steps: int = 3) -> torch.Tensor:
    """Every position's logits of a prompt's prefill, then of `steps` greedy decode steps, over
    fresh paged K/V and state pools (one request: block table and state slot 0)."""
    caches: list = [None] * model.config.num_hidden_layers
    for group in model.cache_layout("float32").groups:
        for layer in group.layer_ids:
            spec = group.spec
            caches[layer] = (torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim) if group.paged
                             else tuple(torch.zeros(2, *shape) for shape in spec.shapes))
    seq = Sequence("r", list(prompt), SamplingParams())
    seq.state_slot = 0
    seq.block_table.extend(range(NUM_BLOCKS))

    class Item:
        def __init__(self, n: int) -> None:
            self.seq, self.num_new_tokens, self.sample = seq, n, True

    rows, n = [], len(prompt)
    for _ in range(steps + 1):
        inputs = build_model_inputs([Item(n)], BLOCK_SIZE, torch.device("cpu"))
        md = inputs.metadata
        logits = model.compute_logits(model(inputs.input_ids, md.positions, caches, md)).float()
        rows.append(logits)
        seq.num_computed_tokens += n
        seq.append_token(int(logits[-1].argmax()))
        n = 1
    return torch.cat(rows)


def assert_same_model(meta: torch.nn.Module, eager: torch.nn.Module) -> None:
    """The same parameters (names, dtypes, bytes) and buffers, and bit-identical logits."""
    ours = dict(meta.named_parameters(remove_duplicate=False))
    theirs = dict(eager.named_parameters(remove_duplicate=False))
    assert ours.keys() == theirs.keys()
    for name, p in ours.items():
        assert p.dtype == theirs[name].dtype and p.device.type == "cpu", name
        assert torch.equal(as_bytes(p), as_bytes(theirs[name])), name
    buffers = dict(eager.named_buffers())
    for name, b in meta.named_buffers():
        assert torch.equal(as_bytes(b), as_bytes(buffers[name])), name
    prompt = torch.randint(3, meta.config.vocab_size, (11,), generator=torch.Generator().manual_seed(5)).tolist()
    ours_logits, theirs_logits = greedy_logits(meta, prompt), greedy_logits(eager, prompt)
    assert ours_logits.abs().max() > 0  # not a degenerate model
    assert torch.equal(ours_logits, theirs_logits)


@pytest.mark.parametrize("quantization", ["none", "fp8"])
@pytest.mark.parametrize("family", FAMILIES)
def test_dummy_weights_match_the_eager_build(family, quantization) -> None:
    meta, eager = both_builds(resolve_model(f"dummy:{family}"), quantization=quantization)
    assert any(p.dtype == FP8_DTYPE for p in meta.parameters()) == (quantization == "fp8")
    assert_same_model(meta, eager)


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoints(request, tmp_path_factory, hf_checkpoint) -> tuple[Path, Path]:
    """(float checkpoint, the same weights as a block-wise FP8 checkpoint) of a tiny family."""
    root = tmp_path_factory.mktemp(request.param)
    _, source = hf_checkpoint(root, request.param, router_std=0.5)
    write_fp8(source, root / "fp8", (128, 128))
    return source, root / "fp8"


@pytest.mark.parametrize(("which", "quantization"), [("float", "auto"), ("float", "fp8"), ("fp8", "auto"),
                                                     ("fp8", "none")])
def test_checkpoints_match_the_eager_build(checkpoints, which, quantization) -> None:
    path = checkpoints[0] if which == "float" else checkpoints[1]
    meta, eager = both_builds(resolve_model(str(path)), quantization=quantization)
    assert_same_model(meta, eager)


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + ((t.shape[0] - 1) * t.stride(0) + t[0].numel()) * t.element_size()


@pytest.mark.parametrize("quantization", ["none", "fp8"])
@pytest.mark.parametrize("family", FAMILIES)
def test_aliasing_survives(family, quantization) -> None:
    """The fused op set's merged projections: each member's weight (and FP8 scales) is a row slice
    of the merged storage, in order, and a write through a member lands in the merged tensor;
    tied embeddings stay one parameter; FP8 weights keep their scale links and loaders."""
    model = build_model(resolve_model(f"dummy:{family}"), "cpu", torch.float32, attention_backend="triton",
                        quantization=quantization)
    merged = [m for m in model.modules() if isinstance(m, MergedColumnLinear)]
    assert merged
    for module in merged:
        pairs = [(module.weight, [m.weight for m in module.members])]
        if module.weight_scale_inv is not None:
            pairs.append((module.weight_scale_inv, [m.weight_scale_inv for m in module.members]))
        for whole, parts in pairs:
            lo, hi = _span(whole)
            ends = [_span(p) for p in parts]
            assert ends[0][0] == lo and ends[-1][1] == hi
            assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:]))  # in order, inside the merged storage
            assert all(p.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr() for p in parts)
        last = module.members[-1].weight
        with torch.no_grad():
            as_bytes(last)[-1, -1] = 7
        assert int(as_bytes(module.weight)[-1, -1]) == 7
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.nn.Parameter) and weight.dtype == FP8_DTYPE:
            assert weight.fp8_scale is module.weight_scale_inv and callable(weight.weight_loader)
            assert callable(module.weight_scale_inv.weight_loader)
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not any(t.device.type == "meta" for t in (*model.parameters(), *model.buffers()))


def test_materialize_keeps_aliasing_and_attributes_of_a_plain_module() -> None:
    """The mechanism alone: a parameter registered twice, a buffer whose storage a parameter
    views, and a Python attribute on a parameter."""
    with meta_parameters():
        module = torch.nn.Module()
        module.a = torch.nn.Parameter(torch.empty(6, 4), requires_grad=False)
        module.register_buffer("table", torch.arange(3.0))  # a buffer: built for real
        module.sub = torch.nn.Module()
        module.sub.tied = module.a
    assert module.a.device.type == "meta" and module.table.device.type == "cpu"
    module.register_buffer("merged", torch.empty(10, 4, device="meta"))
    module.b = torch.nn.Parameter(module.merged[6:], requires_grad=False)
    module.b.note = "kept"
    identity = id(module.b)
    materialize(module, "cpu")
    assert module.sub.tied is module.a and id(module.b) == identity and module.b.note == "kept"
    assert module.b.data_ptr() == module.merged.data_ptr() + 6 * 4 * 4
    assert torch.equal(module.table, torch.arange(3.0))
    module.merged.fill_(2.0)
    assert torch.equal(module.b, torch.full((4, 4), 2.0))


def _peak_cpu_bytes(build) -> tuple[int, torch.nn.Module]:
    """The highest sum of live CPU allocations while `build()` runs (the profiler's allocation
    and free events in time order), and what it returned."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = build()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak, model


def test_peak_memory_is_the_fp8_model() -> None:
    """A Qwen3-Next-shaped model whose experts dominate (16 of 1024 x 512 per layer, ~200 MB in
    bf16) built with FP8 dummy weights: the allocation peak is the FP8 model plus at most a
    tenth of a layer in bf16, while the eager build's peak is at least the whole bf16 model."""
    cfg = get_dummy_config("tiny-qwen3-next") | dict(
        hidden_size=512, intermediate_size=512, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=1024,
        shared_expert_intermediate_size=256, decoder_sparse_step=1)
    resolved = ResolvedModel(path=None, config=cfg, is_dummy=True)
    peak, model = _peak_cpu_bytes(lambda: build_model(resolved, "cpu", torch.bfloat16, quantization="fp8"))
    fp8_bytes = sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers())
    # The same model in bf16: every parameter but the FP8 scales, two bytes each.
    bf16_bytes = sum(2 * p.numel() for name, p in model.named_parameters() if not name.endswith("_scale_inv"))
    del model
    layer_bf16 = bf16_bytes / cfg["num_hidden_layers"]
    assert fp8_bytes < 0.55 * bf16_bytes  # the experts dominate: FP8 is about half
    assert peak <= fp8_bytes + 0.1 * layer_bf16, (peak, fp8_bytes, bf16_bytes)
    with eager_build():
        eager_peak, _ = _peak_cpu_bytes(lambda: build_model(resolved, "cpu", torch.bfloat16, quantization="fp8"))
    assert eager_peak >= bf16_bytes  # the measurement sees the bf16 model when it is there


@pytest.mark.parametrize("quantization", ["none", "fp8"])
@pytest.mark.parametrize("family", FAMILIES)
def test_planned_weight_bytes_are_what_the_build_allocates(family, quantization) -> None:
    """What the roofline sizes its KV pool by: the parameters' storage as `build_model` allocates
    it (merged projections once, FP8 weights and scales), counted before anything is allocated."""
    resolved = resolve_model(f"dummy:{family}")
    planned = planned_weight_bytes(resolved, "cpu", torch.bfloat16, "triton", quantization)
    model = build_model(resolved, "cpu", torch.bfloat16, attention_backend="triton", quantization=quantization)
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    assert planned == sum(storages.values())


def test_full_qwen3_next_fits_one_h200_in_fp8_only() -> None:
    """Issue 26: the 48-layer Qwen3-Next-80B-A3B (36 Gated DeltaNet + 12 attention layers) needs
    more than an H200's 139 GiB in bf16 and about 75 GiB with FP8 projections and experts,
    leaving room for the KV cache and state slots; the roofline plans its pool from the latter."""
    resolved = resolve_model("dummy:qwen3-next-80b-a3b-l48")
    types = resolved.config.get("layer_types") or [
        "full_attention" if (i + 1) % resolved.config["full_attention_interval"] == 0 else "linear_attention"
        for i in range(resolved.config["num_hidden_layers"])]
    assert len(types) == 48 and types.count("full_attention") == 12
    gib = 2**30
    bf16 = planned_weight_bytes(resolved, "cpu", torch.bfloat16, "triton", "none")
    fp8 = planned_weight_bytes(resolved, "cpu", torch.bfloat16, "triton", "fp8")
    assert bf16 > 139 * gib
    assert 70 * gib < fp8 < 80 * gib
    # `bench run_gpu.sh fp8-next`'s KV pool: every point fits beside the FP8 weights, 64 state
    # slots and the 16 GiB headroom (counted in bf16, not even two blocks would).
    from tandem.bench.accounting import shape_from_hf_config
    from tandem.bench.roofline import RooflineOptions, plan_num_blocks

    shape = shape_from_hf_config(resolved.config)
    options = RooflineOptions(batches=[1, 64], contexts=[1024], prefill_shapes=[(8, 1024)])
    plan = plan_num_blocks(shape, 2, 16, options, 139 * gib, 4096, num_state_slots=64, weight_bytes=fp8)
    assert plan["num_blocks"] == plan["needed_blocks"] < plan["fit_blocks"]
    assert plan_num_blocks(shape, 2, 16, options, 139 * gib, 4096, num_state_slots=64)["fit_blocks"] == 0
