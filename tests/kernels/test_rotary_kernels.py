"""Rotary embedding (neox / rotate-half): Triton kernels (CPU interpreter) vs Hugging Face's
``apply_rotary_pos_emb``, a naive partial-rotary twin and the PyTorch references; the fused
variant's cache writes vs a naive scatter."""

import os

# Triton reads this when triton.language is first imported (kernels import it lazily, at launch).
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rot", [64, 32])
def test_rope_and_store_kv(dtype: torch.dtype, rot: int) -> None:
    gen = torch.Generator().manual_seed(22 + rot)
    tokens, heads, kv_heads, dim, block_size, num_blocks = 7, 4, 2, 64, 4, 6
    cos, sin = cos_sin_table(256, rot)
    cache = torch.cat((cos, sin), dim=-1).float()
    positions = torch.randint(0, 256, (tokens,), generator=gen)
    _, q, k, v = fused_qkv(tokens, heads, kv_heads, dim, dtype, gen)
    slots = torch.tensor([5, 0, -1, 23, 9, 12, -1])  # -1: padding tokens, not written
    kv_cache = torch.full((2, num_blocks, block_size, kv_heads, dim), float("nan"), dtype=dtype)
    q0, k0, v0 = q.clone(), k.clone(), v.clone()

    rope_and_store_kv(positions, q, k, v, cache, kv_cache, slots)

    exp_q, exp_k = apply_rotary_reference(positions, q0, k0, cache)
    assert rel_err(q, exp_q) <= TOL[dtype] and rel_err(k, exp_k) <= TOL[dtype]
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        written[slot] = True
        blk, row = divmod(slot, block_size)
        assert torch.equal(kv_cache[0, blk, row], k[t])  # the in-place rotated k, bit for bit
        assert torch.equal(kv_cache[1, blk, row], v0[t])
    assert kv_cache.flatten(1, 2)[:, ~written].isnan().all()

    ref_cache = torch.full_like(kv_cache, float("nan"))
    ref_q, ref_k = rope_and_store_kv_reference(positions, q0, k0, v0, cache, ref_cache, slots)
    assert rel_err(kv_cache.flatten(1, 2)[:, written], ref_cache.flatten(1, 2)[:, written]) <= TOL[dtype]


def test_rejects_bad_arguments() -> None:
    cache = torch.randn(16, 32)
    q, k = torch.randn(3, 2, 32), torch.randn(3, 1, 32)
    with pytest.raises(ValueError):
        apply_rotary(torch.arange(4), q, k, cache)  # positions length
    with pytest.raises(ValueError):
        apply_rotary(torch.arange(3), q, k, torch.randn(16, 40))  # rot_dim > head_dim
    with pytest.raises(TypeError):
        apply_rotary(torch.arange(3).float(), q, k, cache)
