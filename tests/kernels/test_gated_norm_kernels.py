"""Gated RMSNorm: the PyTorch twin bit for bit against Hugging Face's Qwen3NextRMSNormGated, the
Triton kernel (CPU interpreter) against both."""

import os

# Triton reads this when triton.language is first imported (kernels import it lazily, at launch).
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated  # noqa: E402

from tandem.kernels.gated_norm import rms_norm_gated, rms_norm_gated_ref  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread is faster than several fighting over a shared box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def hf_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    module = Qwen3NextRMSNormGated(x.shape[-1], eps=eps).to(weight.dtype)
    with torch.no_grad():
        module.weight.copy_(weight)
        return module(x, z)


def inputs(rows: int, n: int, dtype: torch.dtype, seed: int, weight_dtype=None):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, n, generator=gen) * 3 + 0.2).to(dtype)
    z = (torch.randn(rows, n, generator=gen) * 2).to(dtype)
    w = (1 + 0.3 * torch.randn(n, generator=gen)).to(weight_dtype or dtype)
    return x, z, w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 128), (37, 128), (5, 96), (3, 1000)])
def test_twin_is_bitwise_hf_and_triton_close(dtype: torch.dtype, rows: int, n: int) -> None:
    x, z, w = inputs(rows, n, dtype, rows * n)
    hf = hf_norm(x, z, w, 1e-6)
    ref = rms_norm_gated_ref(x, z, w, 1e-6)
    assert ref.dtype == dtype and torch.equal(ref, hf)
    out = rms_norm_gated(x, z, w, 1e-6)
    assert out.dtype == dtype and not out.isnan().any()
    assert rel_err(out, hf) <= TOL[dtype]
    if dtype != torch.float32:
        # Same roundings as HF: only rare last-bit flips (summation order, exp).
        assert (out == hf).float().mean() >= 0.97


def test_float32_weight_with_bf16_activations() -> None:
    """A float32 weight promotes the product to float32 (no intermediate bf16 rounding)."""
    x, z, w = inputs(16, 128, torch.bfloat16, 3, weight_dtype=torch.float32)
    hf = hf_norm(x, z, w, 1e-5)
    assert torch.equal(rms_norm_gated_ref(x, z, w, 1e-5), hf)
    out = rms_norm_gated(x, z, w, 1e-5)
    assert (out == hf).float().mean() >= 0.97


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_3d_views(dtype: torch.dtype) -> None:
    """x [T, HV, D] from the attention core, z a slice of the input projection."""
    gen = torch.Generator().manual_seed(4)
    tokens, heads, dim = 6, 4, 64
    x = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    proj = torch.randn(tokens, 3 * heads * dim, generator=gen).to(dtype)
    z = proj[:, heads * dim : 2 * heads * dim].view(tokens, heads, dim)
    assert not z.is_contiguous()
    w = (1 + 0.3 * torch.randn(dim, generator=gen)).to(dtype)
    out = rms_norm_gated(x, z, w, 1e-6)
    expected = hf_norm(x.reshape(-1, dim), z.reshape(-1, dim), w, 1e-6).view(tokens, heads, dim)
    assert out.shape == x.shape
    assert rel_err(out, expected) <= TOL[dtype]
    assert torch.equal(rms_norm_gated_ref(x, z, w, 1e-6), expected)


def test_empty_and_invalid_inputs() -> None:
    w = torch.ones(8)
    assert rms_norm_gated(torch.empty(0, 8), torch.empty(0, 8), w, 1e-6).shape == (0, 8)
    with pytest.raises(ValueError):
        rms_norm_gated(torch.randn(2, 8), torch.randn(2, 9), w, 1e-6)
    with pytest.raises(ValueError):
        rms_norm_gated(torch.randn(2, 8), torch.randn(2, 8), torch.ones(9), 1e-6)
    with pytest.raises(ValueError):
        rms_norm_gated(torch.randn(8, 2).t(), torch.randn(2, 8), w, 1e-6)  # strided last dim
    with pytest.raises(TypeError):
        rms_norm_gated(torch.randn(2, 8).int(), torch.randn(2, 8), w, 1e-6)
