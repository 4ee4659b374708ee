"""Rotary embedding (neox / rotate-half): Triton kernels (CPU interpreter) vs Hugging Face's
``apply_rotary_pos_emb``, a naive partial-rotary twin and the PyTorch references; the fused
variant's cache writes vs a naive scatter, and its Qwen3 q/k norm vs Hugging Face's
``Qwen3RMSNorm`` and vs the separate rmsnorm kernel."""

import os

# Triton reads this when triton.language is first imported (kernels import it lazily, at launch).
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm  # noqa: E402

from tandem.kernels.norm import rmsnorm  # noqa: E402
from tandem.kernels.rotary import (  # noqa: E402
    apply_rotary,
    apply_rotary_reference,
    rope_and_store_kv,
    rope_and_store_kv_reference,
)

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def cos_sin_table(max_pos: int, rot_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) as [max_pos, rot_dim / 2] float64."""
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)
    return freqs.cos(), freqs.sin()


def fused_qkv(tokens: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype,
              gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """q, k, v as strided views of one [T, (H + 2 Hkv) * D] projection output."""
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    return qkv, q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 64), (9, 3, 64), (2, 1, 128)])
def test_full_rotary_matches_hf(dtype: torch.dtype, heads: int, kv_heads: int, dim: int) -> None:
    gen = torch.Generator().manual_seed(heads * dim)
    tokens, max_pos = 11, 4096
    cos, sin = cos_sin_table(max_pos, dim)
    cache = torch.cat((cos, sin), dim=-1).float()
    positions = torch.randint(0, max_pos, (tokens,), generator=gen)
    _, q, k, _ = fused_qkv(tokens, heads, kv_heads, dim, dtype, gen)
    # HF wants [T, heads, D] with cos/sin [T, D] = cat(freqs, freqs), unsqueezed on the head dim.
    hf_cos = torch.cat((cos, cos), dim=-1)[positions]
    hf_sin = torch.cat((sin, sin), dim=-1)[positions]
    hf_q, hf_k = apply_rotary_pos_emb(q.double(), k.double(), hf_cos, hf_sin, unsqueeze_dim=1)
    out_q, out_k = apply_rotary(positions, q, k, cache)
    assert out_q is q and out_k is k  # rotated in place
    assert rel_err(q, hf_q) <= TOL[dtype]
    assert rel_err(k, hf_k) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_rotary_and_int32_positions(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(21)
    tokens, heads, kv_heads, dim, rot = 6, 3, 1, 64, 24
    cos, sin = cos_sin_table(512, rot)
    cache = torch.cat((cos, sin), dim=-1).to(dtype)  # a bf16 cache works too
    positions = torch.tensor([0, 1, 511, 7, 7, 300], dtype=torch.int32)
    _, q, k, _ = fused_qkv(tokens, heads, kv_heads, dim, dtype, gen)
    q0, k0 = q.clone(), k.clone()
    apply_rotary(positions, q, k, cache)

    def naive(x: torch.Tensor) -> torch.Tensor:
        out = x.double().clone()
        c = cache.double()[positions.long(), : rot // 2][:, None, :]
        s = cache.double()[positions.long(), rot // 2 :][:, None, :]
        x1, x2 = x.double()[..., : rot // 2], x.double()[..., rot // 2 : rot]
        out[..., : rot // 2] = x1 * c - x2 * s
        out[..., rot // 2 : rot] = x2 * c + x1 * s
        return out

    assert rel_err(q, naive(q0)) <= TOL[dtype]
    assert rel_err(k, naive(k0)) <= TOL[dtype]
    assert torch.equal(q[..., rot:], q0[..., rot:])  # the un-rotated tail is untouched
    ref_q, ref_k = apply_rotary_reference(positions, q0, k0, cache)
    assert rel_err(q, ref_q) <= TOL[dtype] and rel_err(k, ref_k) <= TOL[dtype]


def hf_qwen3_qk_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's Qwen3RMSNorm, per head, with its own module and roundings."""
    norm = Qwen3RMSNorm(x.shape[-1], eps).to(x.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        return norm(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads,kv_heads,dim,rot", [
    (7, 4, 2, 64, 64), (7, 4, 2, 64, 32), (5, 9, 3, 128, 128), (5, 9, 3, 128, 96)])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "qk_norm+rope"])
def test_rope_and_store_kv(
    dtype: torch.dtype, tokens: int, heads: int, kv_heads: int, dim: int, rot: int, qk_norm: bool
) -> None:
    gen = torch.Generator().manual_seed(22 + rot + dim + qk_norm)
    block_size, num_blocks, eps = 4, 6, 1e-6
    cos, sin = cos_sin_table(256, rot)
    cache = torch.cat((cos, sin), dim=-1).float()
    positions = torch.randint(0, 256, (tokens,), generator=gen)
    qkv, q, k, v = fused_qkv(tokens, heads, kv_heads, dim, dtype, gen)
    qkv.mul_(4.0)  # an RMS far from 1, so a head the norm skipped cannot pass
    slots = torch.tensor([5, 0, -1, 23, 9, 12, -1][:tokens])  # -1: padding tokens, not written
    kv_cache = torch.full((2, num_blocks, block_size, kv_heads, dim), float("nan"), dtype=dtype)
    q0, k0, v0 = q.clone(), k.clone(), v.clone()
    weights: dict[str, torch.Tensor] = {}
    if qk_norm:  # weights in the model dtype, as loaded from a checkpoint
        weights = {name: (1.0 + 0.3 * torch.randn(dim, generator=gen)).to(dtype)
                   for name in ("q_norm_weight", "k_norm_weight")}

    out_q, out_k = rope_and_store_kv(positions, q, k, v, cache, kv_cache, slots, eps=eps, **weights)

    assert out_q is q and out_k is k  # normalised and rotated in place, in the strided views
    assert not q.isnan().any() and not k.isnan().any()
    assert torch.equal(v, v0)  # the v slice of the shared qkv buffer is only read
    q_in, k_in = q0, k0
    if qk_norm:  # against Hugging Face's module, independently of our references
        q_in = hf_qwen3_qk_norm(q0, weights["q_norm_weight"], eps)
        k_in = hf_qwen3_qk_norm(k0, weights["k_norm_weight"], eps)
    exp_q, exp_k = apply_rotary_reference(positions, q_in, k_in, cache)
    assert rel_err(q, exp_q) <= TOL[dtype] and rel_err(k, exp_k) <= TOL[dtype]
    if not qk_norm:
        assert torch.equal(q[..., rot:], q0[..., rot:])  # partial rotary: the tail passes through
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        written[slot] = True
        blk, row = divmod(slot, block_size)
        assert torch.equal(kv_cache[0, blk, row], k[t])  # the in-place k, bit for bit
        assert torch.equal(kv_cache[1, blk, row], v0[t])
    assert kv_cache.flatten(1, 2)[:, ~written].isnan().all()
    assert not kv_cache.flatten(1, 2)[:, written].isnan().any()

    ref_cache = torch.full_like(kv_cache, float("nan"))
    ref_q, ref_k = rope_and_store_kv_reference(positions, q0, k0, v0, cache, ref_cache, slots, eps=eps,
                                               **weights)
    assert rel_err(q, ref_q) <= TOL[dtype] and rel_err(k, ref_k) <= TOL[dtype]
    assert rel_err(kv_cache.flatten(1, 2)[:, written], ref_cache.flatten(1, 2)[:, written]) <= TOL[dtype]
    assert ref_cache.flatten(1, 2)[:, ~written].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_qk_norm_rounds_like_the_separate_kernels(dtype: torch.dtype) -> None:
    """One fused launch gives what the rmsnorm kernel on q and k, then RoPE + store, gave: the
    same roundings (bit for bit in bf16; float32 may differ in the last bit of the rstd)."""
    gen = torch.Generator().manual_seed(31)
    tokens, heads, kv_heads, dim, eps = 6, 4, 2, 64, 1e-6
    cos, sin = cos_sin_table(128, dim)
    cache = torch.cat((cos, sin), dim=-1).float()
    positions = torch.randint(0, 128, (tokens,), generator=gen)
    slots = torch.randperm(24, generator=gen)[:tokens]
    qkv, q, k, v = fused_qkv(tokens, heads, kv_heads, dim, dtype, gen)
    qw, kw = ((1.0 + 0.3 * torch.randn(dim, generator=gen)).to(dtype) for _ in range(2))
    qkv_sep = qkv.clone()
    q_sep = rmsnorm(qkv_sep[:, : heads * dim].view(tokens, heads, dim), qw, eps)
    k_sep = rmsnorm(qkv_sep[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim), kw, eps)
    sep_cache = torch.zeros(2, 6, 4, kv_heads, dim, dtype=dtype)
    rope_and_store_kv(positions, q_sep, k_sep, v, cache, sep_cache, slots)
    fused_cache = torch.zeros_like(sep_cache)
    rope_and_store_kv(positions, q, k, v, cache, fused_cache, slots, qw, kw, eps)
    exact = dtype == torch.bfloat16
    for got, want in ((q, q_sep), (k, k_sep), (fused_cache, sep_cache)):
        if exact:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_rejects_bad_arguments() -> None:
    cache = torch.randn(16, 32)
    q, k = torch.randn(3, 2, 32), torch.randn(3, 1, 32)
    with pytest.raises(ValueError):
        apply_rotary(torch.arange(4), q, k, cache)  # positions length
    with pytest.raises(ValueError):
        apply_rotary(torch.arange(3), q, k, torch.randn(16, 40))  # rot_dim > head_dim
    with pytest.raises(TypeError):
        apply_rotary(torch.arange(3).float(), q, k, cache)
    v, kv_cache, slots = torch.randn(3, 1, 32), torch.zeros(2, 2, 4, 1, 32), torch.arange(3)
    args = (torch.arange(3), q, k, v, cache, kv_cache, slots)
    with pytest.raises(ValueError, match="both or neither"):
        rope_and_store_kv(*args, q_norm_weight=torch.ones(32))
    with pytest.raises(ValueError, match="both or neither"):
        rope_and_store_kv_reference(*args, k_norm_weight=torch.ones(32))
    with pytest.raises(ValueError):
        rope_and_store_kv(*args, q_norm_weight=torch.ones(16), k_norm_weight=torch.ones(32))
    with pytest.raises(ValueError, match="contiguous"):
        rope_and_store_kv(*args, q_norm_weight=torch.ones(64)[::2], k_norm_weight=torch.ones(32))
