"""Rotary position embedding (neox / rotate-half style, as Llama and Qwen in Hugging Face).

The cos/sin cache is built by the model code (default, llama3 or yarn scaling all reduce to a
table): ``cos_sin_cache[max_pos, rot_dim]`` holds ``cos(pos·θ_i)`` in columns ``0 .. rot_dim/2``
and ``sin(pos·θ_i)`` in columns ``rot_dim/2 .. rot_dim`` (vLLM's layout). For each head the first
``rot_dim`` dims are rotated as two halves ``x1, x2``:
``(x1·cos − x2·sin, x2·cos + x1·sin)``; dims ``rot_dim .. head_dim`` pass through (partial
rotary). This equals HF's ``x·cat(cos, cos) + rotate_half(x)·cat(sin, sin)``.

``apply_rotary`` rotates q and k in place. ``rope_and_store_kv`` also writes the rotated K and V
into the paged cache in the same pass, which saves re-reading k (``T·Hkv·D·e`` bytes) and one
launch. Bytes moved per token: read and write ``(H + Hkv)·rot_dim·e`` for q/k, plus the cos/sin
row (``rot_dim·4``), plus ``2·Hkv·D·e`` of cache writes (and the V read) when fused. One program
per token handles all heads so the cos/sin row is loaded once.
"""

from __future__ import annotations

import torch

from tandem.kernels._utils import (
    FLOAT_DTYPES,
    cast,
    check_contiguous_last_dim,
    check_dtype,
    check_same_device,
    check_shape,
    next_power_of_2,
    tl,
    triton_kernel,
)
from tandem.kernels.kv_store import check_kv_cache_args, store_kv_reference

__all__ = [
    "apply_rotary",
    "apply_rotary_reference",
    "rope_and_store_kv",
    "rope_and_store_kv_reference",
]


@triton_kernel
def _rope_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cos_sin_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ct,
    stride_ch,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    STORE_KV: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    half = tl.arange(0, HALF_PAD)
    half_mask = half < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cos + half, mask=half_mask, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cos + HALF + half, mask=half_mask, other=0.0)
    sin = sin.to(tl.float32)

    qh = tl.arange(0, Q_HEADS_PAD)
    q_mask = (qh < NUM_Q_HEADS)[:, None] & half_mask[None, :]
    q_lo = q_ptr + token * stride_qt + qh[:, None] * stride_qh + half[None, :]
    q1 = tl.load(q_lo, mask=q_mask, other=0.0).to(tl.float32)
    q2 = tl.load(q_lo + HALF, mask=q_mask, other=0.0).to(tl.float32)
    tl.store(q_lo, cast(q1 * cos[None, :] - q2 * sin[None, :], q_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q_lo + HALF, cast(q2 * cos[None, :] + q1 * sin[None, :], q_ptr.dtype.element_ty), mask=q_mask)

    kh = tl.arange(0, KV_HEADS_PAD)
    kh_mask = kh < NUM_KV_HEADS
    k_mask = kh_mask[:, None] & half_mask[None, :]
    k_lo = k_ptr + token * stride_kt + kh[:, None] * stride_kh + half[None, :]
    k1 = tl.load(k_lo, mask=k_mask, other=0.0).to(tl.float32)
    k2 = tl.load(k_lo + HALF, mask=k_mask, other=0.0).to(tl.float32)
    k1_rot = cast(k1 * cos[None, :] - k2 * sin[None, :], k_ptr.dtype.element_ty)
    k2_rot = cast(k2 * cos[None, :] + k1 * sin[None, :], k_ptr.dtype.element_ty)
    tl.store(k_lo, k1_rot, mask=k_mask)
    tl.store(k_lo + HALF, k2_rot, mask=k_mask)

    if STORE_KV:
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot >= 0:
            dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct
            dst_lo = dst + kh[:, None] * stride_ch + half[None, :]
            tl.store(k_cache_ptr + dst_lo, cast(k1_rot, k_cache_ptr.dtype.element_ty), mask=k_mask)
            tl.store(
                k_cache_ptr + dst_lo + HALF, cast(k2_rot, k_cache_ptr.dtype.element_ty), mask=k_mask
            )
            dims = tl.arange(0, DIM_PAD)
            if 2 * HALF < HEAD_DIM:  # partial rotary: the un-rotated tail goes to the cache too
                tail_mask = kh_mask[:, None] & ((dims >= 2 * HALF) & (dims < HEAD_DIM))[None, :]
                tail = tl.load(
                    k_ptr + token * stride_kt + kh[:, None] * stride_kh + dims[None, :],
                    mask=tail_mask,
                )
                tl.store(
                    k_cache_ptr + dst + kh[:, None] * stride_ch + dims[None, :],
                    cast(tail, k_cache_ptr.dtype.element_ty),
                    mask=tail_mask,
                )
            v_mask = kh_mask[:, None] & (dims < HEAD_DIM)[None, :]
            v = tl.load(
                v_ptr + token * stride_vt + kh[:, None] * stride_vh + dims[None, :], mask=v_mask
            )
            tl.store(
                v_cache_ptr + dst + kh[:, None] * stride_ch + dims[None, :],
                cast(v, v_cache_ptr.dtype.element_ty),
                mask=v_mask,
            )


def _check_rotary_args(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.device, int]:
    for name, t in (("q", q), ("k", k), ("cos_sin_cache", cos_sin_cache)):
        check_dtype(name, t, FLOAT_DTYPES)
        check_contiguous_last_dim(name, t)
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q and k must be [T, heads, D], got {list(q.shape)} and {list(k.shape)}")
    tokens, _, head_dim = q.shape
    check_shape("k", k, (tokens, None, head_dim))
    check_shape("positions", positions, (tokens,))
    check_dtype("positions", positions, (torch.int64, torch.int32))
    if cos_sin_cache.dim() != 2:
        raise ValueError(f"cos_sin_cache must be [max_pos, rot_dim], got {list(cos_sin_cache.shape)}")
    rot_dim = cos_sin_cache.shape[1]
    if rot_dim % 2 or rot_dim > head_dim or rot_dim == 0:
        raise ValueError(f"rot_dim {rot_dim} must be even, positive and <= head_dim {head_dim}")
    device = check_same_device(positions=positions, q=q, k=k, cos_sin_cache=cos_sin_cache)
    return device, rot_dim


def _launch(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    v: torch.Tensor | None,
    kv_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor | None,
) -> None:
    device, rot_dim = _check_rotary_args(positions, q, k, cos_sin_cache)
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    store = kv_cache is not None
    if store:
        assert v is not None and slot_mapping is not None
        check_kv_cache_args(k, v, kv_cache, slot_mapping)
        if kv_cache.device != device:
            raise ValueError("kv_cache is on another device than q")
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
        block_size = kv_cache.shape[2]
        v_strides = (v.stride(0), v.stride(1))
    else:  # placeholders: the STORE_KV=False specialisation never touches them
        v, k_cache, v_cache, slot_mapping = k, k, k, positions
        cache_strides, v_strides, block_size = (0, 0, 0), (0, 0), 1
    if tokens == 0:
        return
    _rope_kernel.on(device)[(tokens,)](
        positions,
        q,
        k,
        cos_sin_cache,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        *v_strides,
        *cache_strides,
        NUM_Q_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HALF=rot_dim // 2,
        Q_HEADS_PAD=next_power_of_2(num_heads),
        KV_HEADS_PAD=next_power_of_2(num_kv_heads),
        HALF_PAD=next_power_of_2(rot_dim // 2),
        DIM_PAD=next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        STORE_KV=store,
        num_warps=4,
    )


def apply_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q [T, H, D]`` and ``k [T, Hkv, D]`` in place at ``positions [T]`` (each below
    ``cos_sin_cache.shape[0]``: not checked, that would need a device sync); strided views
    (slices of a fused qkv output) are fine. Returns ``(q, k)`` for chaining."""
    _launch(positions, q, k, cos_sin_cache, None, None, None)
    return q, k


def rope_and_store_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply_rotary` plus :func:`~tandem.kernels.kv_store.store_kv` of the rotated k and
    of v in one pass (negative slots skip the cache write). Returns ``(q, k)``."""
    _launch(positions, q, k, cos_sin_cache, v, kv_cache, slot_mapping)
    return q, k


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = cos.shape[-1]
    xf = x.float()
    x1, x2, rest = xf[..., :half], xf[..., half : 2 * half], xf[..., 2 * half :]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, rest), dim=-1).to(x.dtype)


def apply_rotary_reference(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch twin of :func:`apply_rotary` (float32 math); returns new tensors."""
    cos, sin = cos_sin_cache.float()[positions.long()].chunk(2, dim=-1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def rope_and_store_kv_reference(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch twin of :func:`rope_and_store_kv`: returns new ``(q, k)``, writes ``kv_cache``."""
    q_rot, k_rot = apply_rotary_reference(positions, q, k, cos_sin_cache)
    store_kv_reference(k_rot, v, kv_cache, slot_mapping)
    return q_rot, k_rot
