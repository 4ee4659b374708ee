"""Fused MoE: the Triton kernels (CPU interpreter) vs the per-expert PyTorch twin vs a float64
loop over tokens; routing; the expert alignment; the MoE layer (with and without a shared
expert) against transformers' own blocks, on both op sets."""

import os

# Triton reads this when triton.language is first imported (kernels import it lazily, at launch).
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tandem.engine_service.layers.moe import (  # noqa: E402
    SparseMoeBlock,
    expected_distinct_experts,
    per_expert_checkpoint_name,
)
from tandem.kernels.fused_moe import (  # noqa: E402
    align_pairs_by_expert,
    fused_moe,
    fused_moe_reference,
    select_experts,
)

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def naive_moe(x, w_gate_up, w_down, weights, ids) -> torch.Tensor:
    """Token by token, slot by slot, in float64: the definition, no batching by expert."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    inter = w_down.shape[2]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = w_gate_up[e].double() @ x[t].double()
            act = F.silu(gu[:inter]) * gu[inter:]
            out[t] += float(weights[t, j]) * (w_down[e].double() @ act)
    return out


def make_inputs(n: int, e: int, k: int, hd: int, inter: int, dtype: torch.dtype, seed: int, skew: bool = False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hd, generator=gen).to(dtype)
    w_gate_up = (torch.randn(e, 2 * inter, hd, generator=gen) * hd**-0.5).to(dtype)
    w_down = (torch.randn(e, hd, inter, generator=gen) * inter**-0.5).to(dtype)
    logits = torch.randn(n, e, generator=gen)
    if skew:  # most experts get no token at all
        logits[:, : e // 2] -= 100.0
    weights, ids = select_experts(logits, k, renormalize=True)
    return x, w_gate_up, w_down, weights, ids


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 37])
@pytest.mark.parametrize("k", [1, 2, 8])
def test_fused_matches_per_expert_loop(n: int, k: int, dtype: torch.dtype) -> None:
    e, hd, inter = 16, 96, 80  # neither a multiple of the 64-wide tiles
    x, w_gate_up, w_down, weights, ids = make_inputs(n, e, k, hd, inter, dtype, seed=n * 10 + k)
    out = fused_moe(x, w_gate_up, w_down, weights, ids)
    ref = fused_moe_reference(x, w_gate_up, w_down, weights, ids)
    naive = naive_moe(x, w_gate_up, w_down, weights, ids)
    assert out.dtype == dtype and out.shape == (n, hd) and not out.isnan().any()
    assert naive.abs().max() > 0.1
    assert rel_err(out, naive) <= TOL[dtype]
    assert rel_err(ref, naive) <= TOL[dtype]
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("units", [1, 20, 10_000], ids=["tile64", "tile32", "tile16"])
def test_narrow_column_tiles(monkeypatch, units: int) -> None:
    """Small batches on a large GPU get narrower column tiles (more programs); all widths agree."""
    from tandem.kernels import fused_moe as module

    monkeypatch.setattr(module, "num_compute_units", lambda device: units)
    n, e, k, hd, inter = 2, 16, 8, 96, 80
    assert module._block_n(min(e, n * k), inter, torch.device("cpu")) == {1: 64, 20: 32, 10_000: 16}[units]
    x, w_gate_up, w_down, weights, ids = make_inputs(n, e, k, hd, inter, torch.float32, seed=5)
    out = fused_moe(x, w_gate_up, w_down, weights, ids)
    torch.testing.assert_close(out, naive_moe(x, w_gate_up, w_down, weights, ids).float(), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("n", [1, 5, 37])
def test_experts_without_tokens(n: int) -> None:
    e, k = 32, 2
    x, w_gate_up, w_down, weights, ids = make_inputs(n, e, k, 64, 48, torch.float32, seed=7, skew=True)
    used = set(ids.flatten().tolist())
    assert used and max(used) < e and min(used) >= e // 2  # half the experts idle
    # An idle expert's weights must not matter: poison them.
    for idle in set(range(e)) - used:
        w_gate_up[idle].fill_(float("nan"))
        w_down[idle].fill_(float("nan"))
    out = fused_moe(x, w_gate_up, w_down, weights, ids)
    torch.testing.assert_close(out, naive_moe(x, w_gate_up, w_down, weights, ids).float(), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(fused_moe_reference(x, w_gate_up, w_down, weights, ids), out, atol=1e-5, rtol=1e-5)


def test_one_expert_takes_more_than_a_block() -> None:
    """40 tokens all routed to expert 3 (slot 0) and 5 (slot 1): runs longer than BLOCK_M rows."""
    n, e, hd, inter = 40, 8, 64, 32
    x, w_gate_up, w_down, _, _ = make_inputs(n, e, 2, hd, inter, torch.float32, seed=11)
    ids = torch.tensor([[3, 5]] * n, dtype=torch.int64)  # int64 ids are accepted too
    weights = torch.rand(n, 2, generator=torch.Generator().manual_seed(3))
    out = fused_moe(x, w_gate_up, w_down, weights, ids)
    torch.testing.assert_close(out, naive_moe(x, w_gate_up, w_down, weights, ids).float(), atol=2e-5, rtol=2e-5)


def test_alignment_invariants() -> None:
    ids = torch.tensor([[2, 0], [2, 5], [0, 2], [7, 2]], dtype=torch.int32)
    sorted_pairs, block_expert = align_pairs_by_expert(ids, num_experts=8, block_m=4)
    p = ids.numel()
    rows = sorted_pairs.view(-1, 4)
    seen = []
    for block, expert in zip(rows.tolist(), block_expert.tolist()):
        real = [q for q in block if q < p]
        if expert < 0:
            assert real == []
            continue
        assert real and all(int(ids.flatten()[q]) == expert for q in real)
        seen += real
    assert sorted(seen) == list(range(p))  # every pair exactly once
    assert block_expert.tolist()[: 4] == [0, 2, 5, 7]  # expert order, one block each here


def test_empty_batch_and_bad_inputs() -> None:
    x, w_gate_up, w_down, weights, ids = make_inputs(3, 4, 2, 32, 16, torch.float32, seed=1)
    assert fused_moe(x[:0], w_gate_up, w_down, weights[:0], ids[:0]).shape == (0, 32)
    with pytest.raises(ValueError, match="w_down"):
        fused_moe(x, w_gate_up, w_down[:, :, :8], weights, ids)
    with pytest.raises(TypeError, match="topk_weights"):
        fused_moe(x, w_gate_up, w_down, weights.double(), ids)
    with pytest.raises(ValueError, match="top_k"):
        select_experts(torch.randn(3, 4), 5, True)


@pytest.mark.parametrize("renormalize", [False, True])
def test_select_experts(renormalize: bool) -> None:
    logits = torch.randn(9, 12, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    weights, ids = select_experts(logits, 3, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    probs = torch.softmax(logits.double(), dim=-1)
    order = probs.argsort(dim=-1, descending=True)[:, :3]
    assert torch.equal(ids.long(), order)
    expect = probs.gather(1, order)
    if renormalize:
        expect = expect / expect.sum(-1, keepdim=True)
        torch.testing.assert_close(weights.sum(-1), torch.ones(9), atol=1e-6, rtol=0)
    torch.testing.assert_close(weights.double(), expect, atol=1e-6, rtol=0)


def test_expected_distinct_experts() -> None:
    assert expected_distinct_experts(128, 8, 1) == pytest.approx(8.0)
    assert expected_distinct_experts(128, 8, 0) == 0.0
    # Monte-Carlo check of the uniform-routing formula at a middle batch.
    gen = torch.Generator().manual_seed(0)
    trials = [len(set(torch.rand(16, 128, generator=gen).topk(8, dim=-1).indices.flatten().tolist()))
              for _ in range(200)]
    assert sum(trials) / len(trials) == pytest.approx(expected_distinct_experts(128, 8, 16), rel=0.03)
    assert expected_distinct_experts(128, 8, 4096) == pytest.approx(128.0)


def test_per_expert_checkpoint_names() -> None:
    assert per_expert_checkpoint_name("model.layers.3.mlp.experts.17.up_proj.weight") == (
        "model.layers.3.mlp.experts.gate_up_proj", 17, "up_proj")
    assert per_expert_checkpoint_name("model.layers.3.mlp.experts.0.down_proj.weight") == (
        "model.layers.3.mlp.experts.down_proj", 0, "down_proj")
    assert per_expert_checkpoint_name("model.layers.3.mlp.shared_expert.up_proj.weight") is None
    assert per_expert_checkpoint_name("model.layers.3.mlp.experts.gate_up_proj") is None


# --------------------------------------------------------------------------- the layer


def hf_block(kind: str):
    import transformers
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    common = dict(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
    if kind == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**common, norm_topk_prob=False)
        return Qwen3MoeSparseMoeBlock(cfg), False, 0
    if kind == "qwen3_next":
        cfg = transformers.Qwen3NextConfig(**common, shared_expert_intermediate_size=48, norm_topk_prob=True)
        return Qwen3NextSparseMoeBlock(cfg), True, 48
    cfg = transformers.Qwen3_5MoeTextConfig(**common, shared_expert_intermediate_size=48)
    return Qwen3_5MoeSparseMoeBlock(cfg), True, 48  # Qwen3.5-MoE always renormalises


@pytest.mark.parametrize("fused", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen3_next", "qwen3_5_moe"])
@pytest.mark.parametrize("n", [1, 37])
def test_layer_matches_transformers(kind: str, fused: bool, n: int) -> None:
    torch.manual_seed(0)
    hf, renorm, shared = hf_block(kind)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    ours = SparseMoeBlock(64, 32, 8, 2, renorm, shared, fused=fused)
    hf_params = dict(hf.named_parameters())
    assert {name for name, _ in ours.named_parameters()} == set(hf_params)  # checkpoint names
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.copy_(hf_params[name])
    x = torch.randn(n, 64)
    with torch.no_grad():
        ref = hf(x[None])[0]
        out = ours(x)
    assert ref.abs().max() > 0.1
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    if shared:  # the shared expert contributes: dropping it changes the output
        with torch.no_grad():
            ours.shared_expert.down_proj.weight.zero_()
        assert (ours(x) - ref).abs().max() > 1e-2


def test_gpu_check_moe_section_on_cpu(monkeypatch) -> None:
    """`gpu_check`'s moe cases, shrunk and interpreted: they check the kernel against the twin
    and count the selected experts' weight bytes."""
    from tandem.gpu_checks import kernel_check as gpu_check

    monkeypatch.setitem(gpu_check.QWEN3_MOE, "experts", 8)
    monkeypatch.setitem(gpu_check.QWEN3_MOE, "top_k", 2)
    monkeypatch.setitem(gpu_check.QWEN3_MOE, "hidden", 64)
    monkeypatch.setitem(gpu_check.QWEN3_MOE, "inter", 32)
    cases = list(gpu_check._moe_cases(True, torch.device("cpu"), torch.Generator().manual_seed(0)))
    assert [c.params["tokens"] for c in cases] == [1, 256, 4096]
    for case in cases:
        case.prepare()
        case.run()
        ((_, out, ref),) = case.compare()
        assert not out.isnan().any() and gpu_check._rel_err(out, ref) <= gpu_check.TOLERANCE
        distinct = case.params["distinct_experts"]
        assert (distinct == 2) if case.params["tokens"] == 1 else (distinct == 8)
        assert case.bytes_moved > distinct * 3 * 64 * 32 * 2
