"""RMSNorm / fused residual-add + RMSNorm: Triton kernels (CPU interpreter) vs the PyTorch
references and vs Hugging Face's LlamaRMSNorm."""

import os

# Triton reads this when triton.language is first imported (kernels import it lazily, at launch).
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402

from tandem.kernels.norm import (  # noqa: E402
    fused_add_rmsnorm,
    fused_add_rmsnorm_reference,
    rmsnorm,
    rmsnorm_reference,
)

TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def hf_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    module = LlamaRMSNorm(x.shape[-1], eps=eps).to(x.dtype)
    with torch.no_grad():
        module.weight.copy_(weight)
        return module(x)


def randn(*shape: int, dtype: torch.dtype, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale + 0.1).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 64), (7, 300), (33, 128), (3, 4096)])
def test_rmsnorm_matches_hf(dtype: torch.dtype, rows: int, n: int) -> None:
    gen = torch.Generator().manual_seed(rows * n)
    x = randn(rows, n, dtype=dtype, gen=gen, scale=3.0)
    w = randn(n, dtype=dtype, gen=gen)
    out = torch.full_like(x, float("nan"))
    rmsnorm(x, w, 1e-6, out=out)
    hf = hf_rmsnorm(x, w, 1e-6)
    assert not out.isnan().any()
    assert rel_err(out, hf) <= TOL[dtype]
    assert rel_err(rmsnorm_reference(x, w, 1e-6), hf) <= TOL[dtype]
    if dtype != torch.float32:
        # Same roundings as HF: only rare last-bit flips (from a different summation order).
        assert (out == hf).float().mean() >= 0.98


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rmsnorm(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    x = randn(13, 520, dtype=dtype, gen=gen, scale=2.0)
    residual = randn(13, 520, dtype=dtype, gen=gen, scale=5.0)
    w = randn(520, dtype=dtype, gen=gen)
    out = torch.full_like(x, float("nan"))
    res_out = torch.full_like(x, float("nan"))
    fused_add_rmsnorm(x, residual, w, 1e-5, out=out, residual_out=res_out)
    # As the model does it: residual stream summed in the activation dtype, then normalised.
    summed = x + residual
    assert torch.equal(res_out, summed)
    assert rel_err(out, hf_rmsnorm(summed, w, 1e-5)) <= TOL[dtype]
    ref_out, ref_res = fused_add_rmsnorm_reference(x, residual, w, 1e-5)
    assert torch.equal(ref_res, summed)
    assert rel_err(out, ref_out) <= TOL[dtype]


def test_fused_add_rmsnorm_in_place() -> None:
    gen = torch.Generator().manual_seed(12)
    x = randn(9, 256, dtype=torch.bfloat16, gen=gen)
    residual = randn(9, 256, dtype=torch.bfloat16, gen=gen)
    w = randn(256, dtype=torch.bfloat16, gen=gen)
    expected_out, expected_res = fused_add_rmsnorm_reference(x, residual, w, 1e-6)
    out, new_res = fused_add_rmsnorm(x, residual, w, 1e-6, out=x, residual_out=residual)
    assert out.data_ptr() == x.data_ptr() and new_res.data_ptr() == residual.data_ptr()
    assert torch.equal(new_res, expected_res)
    assert rel_err(out, expected_out) <= 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_head_norm_on_strided_qkv_view(dtype: torch.dtype) -> None:
    """Qwen3's q/k norm: RMSNorm over head_dim of the q slice of a fused qkv output."""
    gen = torch.Generator().manual_seed(13)
    tokens, heads, kv_heads, dim = 5, 4, 2, 64
    qkv = randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype, gen=gen, scale=2.0)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    assert not k.is_contiguous()
    w = randn(dim, dtype=dtype, gen=gen)
    out = rmsnorm(k, w, 1e-6)
    expected = hf_rmsnorm(k.reshape(tokens * kv_heads, dim), w, 1e-6).view(tokens, kv_heads, dim)
    assert out.shape == k.shape
    assert rel_err(out, expected) <= TOL[dtype]


def test_empty_and_invalid_inputs() -> None:
    w = torch.ones(8)
    assert rmsnorm(torch.empty(0, 8), w, 1e-6).shape == (0, 8)
    with pytest.raises(ValueError):
        rmsnorm(torch.randn(2, 8), torch.ones(9), 1e-6)
    with pytest.raises(ValueError):
        rmsnorm(torch.randn(8, 2).t(), w[:2], 1e-6)  # last dim not contiguous
    with pytest.raises(TypeError):
        fused_add_rmsnorm(torch.randn(2, 8), torch.randn(2, 8).half(), w, 1e-6)
