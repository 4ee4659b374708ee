"""MoE routing in one launch (`moe_routing.route_experts`) against its PyTorch twin, under the CPU
interpreter: the top-k weights and experts, their rounding, and the expert-sorted pair layout
(`align_pairs_by_expert`'s, entry for entry); then `fused_moe` fed that layout."""

import os

# Triton reads this when triton.language is first imported (kernels import it lazily, at launch).
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from tandem.kernels import moe_routing  # noqa: E402
from tandem.kernels.fused_moe import align_pairs_by_expert, fused_moe, fused_moe_reference, pair_block_m  # noqa: E402


def _logits(n: int, e: int, dtype: torch.dtype, seed: int, stride_pad: int = 3) -> torch.Tensor:
    """Random logits as a strided view (a router's rows of a merged projection)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, e + stride_pad, generator=gen) * 2).to(dtype)[:, :e]


def _assert_same_routing(logits, k, weights, ids, ref_w, ref_ids) -> None:
    """Slot by slot: equal weights, and experts of equal probability (ties at the k-th place may
    be broken either way; bfloat16 logits tie often). Every row's experts are distinct."""
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32 and ids.shape == (logits.shape[0], k)
    torch.testing.assert_close(weights, ref_w, rtol=1e-6, atol=1e-7)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    torch.testing.assert_close(probs.gather(1, ids.long()), probs.gather(1, ref_ids.long()), rtol=1e-6, atol=0)
    assert all(len(set(row)) == k for row in ids.tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "e", "k"), [(1, 128, 8), (3, 16, 2), (37, 16, 8), (5, 512, 10), (300, 64, 8)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_and_layout_match_twin(n: int, e: int, k: int, dtype: torch.dtype, renormalize: bool) -> None:
    logits = _logits(n, e, dtype, seed=n * 1000 + e + k)
    weights, ids, layout = moe_routing.route_experts(logits, k, renormalize, dtype)
    ref_w, ref_ids, ref_layout = moe_routing.reference(logits, k, renormalize, dtype)
    _assert_same_routing(logits, k, weights, ids, ref_w, ref_ids)
    assert torch.equal(weights, weights.to(dtype).float())  # rounded to the model dtype
    assert layout is not None and ref_layout is not None and layout.block_m == ref_layout.block_m
    pairs, blocks = align_pairs_by_expert(ids, e, layout.block_m)
    assert torch.equal(layout.sorted_pairs, pairs)
    assert torch.equal(layout.block_expert, blocks)


def test_distinct_float32_logits_give_torch_topk_ids_exactly() -> None:
    """Without ties the experts and their order are exactly torch.topk's."""
    n, e, k = 9, 64, 6
    logits = torch.randn(n, e, generator=torch.Generator().manual_seed(5), dtype=torch.float64).float()
    _, ids, _ = moe_routing.route_experts(logits, k, True, torch.float32)
    _, ref_ids, _ = moe_routing.reference(logits, k, True, torch.float32)
    assert torch.equal(ids, ref_ids)


def test_tie_goes_to_the_lowest_expert() -> None:
    logits = torch.zeros(2, 8)
    logits[0, [2, 5, 7]] = 1.0
    logits[1, [6, 1]] = 3.0
    _, ids, _ = moe_routing.route_experts(logits, 2, True, torch.float32)
    assert ids.tolist() == [[2, 5], [1, 6]]


def test_skewed_routing_and_one_expert_over_several_blocks() -> None:
    """Most pairs on one expert (its run spans several row blocks), most experts empty."""
    n, e, k = 50, 16, 2
    logits = _logits(n, e, torch.float32, seed=11)
    logits[:, 3] += 20.0
    weights, ids, layout = moe_routing.route_experts(logits, k, True, torch.float32)
    assert layout is not None and int((layout.block_expert == 3).sum()) > 1
    pairs, blocks = align_pairs_by_expert(ids, e, layout.block_m)
    assert torch.equal(layout.sorted_pairs, pairs) and torch.equal(layout.block_expert, blocks)


def test_large_batches_route_without_layout(monkeypatch) -> None:
    """Past ALIGN_MAX_PAIRS the launch routes with several programs and leaves the layout to fused_moe."""
    monkeypatch.setattr(moe_routing, "ALIGN_MAX_PAIRS", 16)
    logits = _logits(40, 16, torch.bfloat16, seed=3)
    weights, ids, layout = moe_routing.route_experts(logits, 4, True, torch.bfloat16)
    ref_w, ref_ids, ref_layout = moe_routing.reference(logits, 4, True, torch.bfloat16)
    assert layout is None and ref_layout is None
    _assert_same_routing(logits, 4, weights, ids, ref_w, ref_ids)


@pytest.mark.parametrize("n", [1, 6])
def test_fused_moe_with_the_kernels_layout(n: int) -> None:
    """The expert GEMMs fed the routing launch's layout give the twin's output."""
    e, k, hd, inter, dtype = 16, 4, 64, 48, torch.float32
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, hd, generator=gen)
    w_gate_up = torch.randn(e, 2 * inter, hd, generator=gen) * hd**-0.5
    w_down = torch.randn(e, hd, inter, generator=gen) * inter**-0.5
    weights, ids, layout = moe_routing.route_experts(_logits(n, e, dtype, seed=n), k, True, dtype)
    out = fused_moe(x, w_gate_up, w_down, weights, ids, layout=layout)
    torch.testing.assert_close(out, fused_moe_reference(x, w_gate_up, w_down, weights, ids), atol=1e-5, rtol=1e-5)
    wrong = type(layout)(layout.sorted_pairs, layout.block_expert, pair_block_m(n * k, e) * 2)
    with pytest.raises(ValueError, match="row blocks"):
        fused_moe(x, w_gate_up, w_down, weights, ids, layout=wrong)


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="top_k"):
        moe_routing.route_experts(torch.zeros(2, 4), 5, True, torch.float32)
    with pytest.raises(ValueError, match=r"\[N, E\]"):
        moe_routing.route_experts(torch.zeros(4), 1, True, torch.float32)
    w, ids, layout = moe_routing.route_experts(torch.zeros(0, 4), 2, True, torch.float32)
    assert w.shape == (0, 2) and ids.shape == (0, 2) and layout is None


def test_gpu_check_routing_section_on_cpu(monkeypatch) -> None:
    """`kernel_check`'s routing cases, interpreted: each passes its own comparison."""
    from tandem.gpu_checks import kernel_check as gpu_check

    monkeypatch.setitem(gpu_check.QWEN3_MOE, "experts", 16)
    monkeypatch.setitem(gpu_check.QWEN3_MOE, "top_k", 4)
    monkeypatch.setattr(gpu_check, "DTYPE", torch.bfloat16)
    cases = [c for c in gpu_check._routing_cases(True, torch.device("cpu"), torch.Generator().manual_seed(0))
             if c.params.get("tokens", 0) <= 64 and c.params.get("experts", 16) == 16]
    assert {c.kernel for c in cases} == {"route_experts", "gdn_gates"}
    for case in cases:
        case.prepare()
        case.run()
        for label, out, ref in case.compare():
            assert not out.float().isnan().any(), (case.name, label)
            assert gpu_check._rel_err(out, ref) <= gpu_check.TOLERANCE, (case.name, label)


def test_batches_past_one_tile_route_then_lay_out(monkeypatch) -> None:
    """More tokens than one routing tile holds: a routing launch over several programs, then the
    layout launch; same results as the twin."""
    monkeypatch.setattr(moe_routing, "_TILE_ELEMENTS", 64)  # 4 rows of 16 experts a tile
    n, e, k = 23, 16, 3
    logits = _logits(n, e, torch.bfloat16, seed=17)
    weights, ids, layout = moe_routing.route_experts(logits, k, True, torch.bfloat16)
    ref_w, ref_ids, _ = moe_routing.reference(logits, k, True, torch.bfloat16)
    _assert_same_routing(logits, k, weights, ids, ref_w, ref_ids)
    assert layout is not None
    pairs, blocks = align_pairs_by_expert(ids, e, layout.block_m)
    assert torch.equal(layout.sorted_pairs, pairs) and torch.equal(layout.block_expert, blocks)
