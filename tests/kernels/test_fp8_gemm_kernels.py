"""FP8 weights: block quantization round trips, the W8A16 GEMM (Triton, interpreted on CPU) against
its torch twin, the FP8 MoE kernels against theirs, and the twins against a float64 definition
on the dequantized weights."""

import os

# Triton reads this when triton.language is first imported (kernels import it lazily, at launch).
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from tandem.engine_service.layers.fp8 import PER_CHANNEL, load_scale_rows  # noqa: E402
from tandem.kernels.fp8_gemm import (  # noqa: E402
    FP8_DTYPE,
    FP8_MAX,
    dequantize,
    fp8_linear_reference,
    fp8_linear_triton,
    quantize,
)
from tandem.kernels.fused_moe import MoeFp8Scales, fused_moe, fused_moe_reference, select_experts  # noqa: E402

BLOCKS = [(128, 128), (32, 64), (1, 64), PER_CHANNEL]


@pytest.mark.parametrize("block", BLOCKS)
def test_quantize_round_trip_within_e4m3_precision(block) -> None:
    """Every element comes back within half an e4m3 step (3 mantissa bits: 2^-4 relative to the
    element's binade) of its block's scale; each block's largest value maps to ±448."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(200, 300, generator=gen) * torch.linspace(0.01, 3.0, 300)  # columns of different ranges
    q, s = quantize(w, block)
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32
    rows, cols = 200, 300
    bn, bk = min(block[0], rows), min(block[1], cols)
    assert s.shape == (-(-rows // bn), -(-cols // bk))
    back = dequantize(q, s, block)
    assert ((back - w).abs() <= w.abs() * 2**-4 + s.max() * 2**-9).all()
    assert q.float().abs().amax() == FP8_MAX


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("m", [1, 19])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_kernel_matches_twin(dtype, block, m, bias) -> None:
    """Partial blocks on both axes (N=200, K=300 with 128-blocks), odd token counts, bias."""
    gen = torch.Generator().manual_seed(m)
    q, s = quantize(torch.randn(200, 300, generator=gen) * 0.05, block)
    x = torch.randn(m, 300, generator=gen).to(dtype)
    b = torch.randn(200, generator=gen).to(dtype) if bias else None
    out = fp8_linear_triton(x, q, s, block, b)
    ref = fp8_linear_reference(x, q, s, block, b)
    assert out.dtype == dtype and out.shape == (m, 200)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    assert (out.float() - ref.float()).abs().max() <= tol * ref.float().abs().max()
    exact = x.double() @ dequantize(q, s, block).to(dtype).double().T + (0 if b is None else b.double())
    assert (ref.double() - exact).abs().max() <= tol * exact.abs().max()


def test_fp8_linear_rejects_mismatched_scales() -> None:
    q, s = quantize(torch.randn(64, 256), (128, 128))
    with pytest.raises(ValueError, match="scale must be"):
        fp8_linear_reference(torch.randn(2, 256), q, s[:, :1], (128, 128))
    with pytest.raises(TypeError):
        fp8_linear_reference(torch.randn(2, 256), q.float(), s, (128, 128))


@pytest.mark.parametrize("block", [(64, 64), (32, 64), PER_CHANNEL])
@pytest.mark.parametrize("n", [1, 23])
def test_fp8_fused_moe_matches_twin(block, n) -> None:
    """The FP8 expert kernels against the twin; the twin against the bf16 twin on the
    dequantized weights (the same numbers, reached by another path)."""
    e, hd, inter, k = 6, 128, 96, 2
    gen = torch.Generator().manual_seed(n)
    w1 = torch.randn(e, 2 * inter, hd, generator=gen) * hd**-0.5
    w2 = torch.randn(e, hd, inter, generator=gen) * inter**-0.5
    q1, s1 = quantize(w1, block)
    q2, s2 = quantize(w2, block)
    scales = MoeFp8Scales(s1, s2, block)
    x = torch.randn(n, hd, generator=gen).to(torch.bfloat16)
    weights, ids = select_experts(torch.randn(n, e, generator=gen), k, renormalize=True)
    out = fused_moe(x, q1, q2, weights, ids, scales)
    ref = fused_moe_reference(x, q1, q2, weights, ids, scales)
    assert (out.float() - ref.float()).abs().max() <= 2e-2 * ref.float().abs().max()
    plain = fused_moe_reference(x, dequantize(q1, s1, block, torch.bfloat16),
                                dequantize(q2, s2, block, torch.bfloat16), weights, ids)
    assert torch.equal(ref, plain)


def test_scale_conversion_to_one_row_blocks() -> None:
    """Checkpoint scales of 128x128 blocks written into one-row blocks (a merged projection that
    is not a whole block high), per-channel and per-tensor scales into per-channel."""
    w = torch.randn(200, 256)
    q, s = quantize(w, (128, 128))
    target = torch.empty(200, 2)
    load_scale_rows(target, (1, 128), 0, 200, 256, s, (128, 128))
    assert torch.equal(dequantize(q, target, (1, 128)), dequantize(q, s, (128, 128)))
    per_channel = torch.empty(200, 1)
    load_scale_rows(per_channel, PER_CHANNEL, 0, 200, 256, torch.full((200,), 0.5), PER_CHANNEL)
    assert (per_channel == 0.5).all()
    load_scale_rows(per_channel, PER_CHANNEL, 0, 200, 256, torch.tensor(0.25), (200, 256))
    assert (per_channel == 0.25).all()
    with pytest.raises(ValueError, match="do not convert"):
        load_scale_rows(torch.empty(2, 2), (128, 128), 0, 200, 256, torch.ones(200, 1), PER_CHANNEL)


def test_gpu_check_fp8_section_on_cpu(monkeypatch) -> None:
    """`kernel_check`'s FP8 cases, shrunk and interpreted: each kernel against its twin, and the
    bytes count FP8 weights (one byte each) plus their float32 scales."""
    from tandem.gpu_checks import kernel_check

    monkeypatch.setitem(kernel_check.QWEN3, "hidden", 64)
    monkeypatch.setitem(kernel_check.QWEN3, "inter", 48)
    for key, value in (("experts", 4), ("top_k", 2), ("hidden", 64), ("inter", 32)):
        monkeypatch.setitem(kernel_check.QWEN3_MOE, key, value)
    cases = list(kernel_check._fp8_cases(True, torch.device("cpu"), torch.Generator().manual_seed(0)))
    assert [c.kernel for c in cases] == ["fp8_linear"] * 3 + ["fused_moe_fp8"] * 3
    for case in cases:
        case.prepare()
        case.run()
        ((_, out, ref),) = case.compare()
        assert not out.isnan().any() and kernel_check._rel_err(out, ref) <= kernel_check.TOLERANCE
    linear = cases[0]
    assert linear.bytes_moved == 96 * 64 + 1 * 1 * 4 + 2 * 1 * (64 + 96) * 2  # weight, one scale block, x and y
