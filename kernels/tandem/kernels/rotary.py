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

``rope_and_store_kv`` can also apply Qwen3's per-head q/k RMSNorm before the rotation (each head
lives whole in the program's registers, so the statistics cost no extra pass): that replaces two
norm launches per layer, each of which read and wrote q or k once more (``2·(H + Hkv)·D·e``
bytes per token in all). The two ``[D]`` weights stay in L2; with partial rotary the
un-rotated dims are read, normalised and written back as well.
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
    triton_helper,
    triton_kernel,
)
from tandem.kernels.kv_store import check_kv_cache_args, store_kv_reference
from tandem.kernels.norm import rmsnorm_reference

__all__ = [
    "apply_rotary",
    "apply_rotary_reference",
    "rope_and_store_kv",
    "rope_and_store_kv_reference",
]


@triton_helper()
def _rms_scale(x, rstd, w_ptr, cols, col_mask, dtype: tl.constexpr):
    """RMSNorm's arithmetic on a ``[heads, cols]`` piece of each head, given the heads' ``rstd``:
    the normalised value is rounded to ``dtype`` before the weight multiplies it (as in
    :mod:`tandem.kernels.norm`); the product is rounded again and returned as float32."""
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    normed = cast(x * rstd[:, None], dtype).to(tl.float32)
    return cast(normed * w[None, :], dtype).to(tl.float32)


@triton_helper()
def _rope_heads(
    row_ptr,
    stride_h,
    heads,
    heads_mask,
    half,
    half_mask,
    dims,
    tail_cols,
    cos,
    sin,
    w_ptr,
    eps,
    HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NORM: tl.constexpr,
    PARTIAL: tl.constexpr,
    LOAD_TAIL: tl.constexpr,
):
    """All heads of one token (``row_ptr``, heads ``stride_h`` apart), in place: RMS-normalise
    each head over ``HEAD_DIM`` with the weight at ``w_ptr`` when ``NORM``, then rotate its first
    ``2·HALF`` dims. Returns the two rotated halves and, when ``LOAD_TAIL``, the dims past the
    rotation (normalised when ``NORM``), all in the tensor's dtype, for the cache write."""
    dtype = row_ptr.dtype.element_ty
    mask = heads_mask[:, None] & half_mask[None, :]
    lo = row_ptr + heads[:, None] * stride_h + half[None, :]
    x1 = tl.load(lo, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(lo + HALF, mask=mask, other=0.0).to(tl.float32)
    tail_ptr = row_ptr + heads[:, None] * stride_h + dims[None, :]
    tail_mask = heads_mask[:, None] & tail_cols[None, :]
    tail = x1  # placeholder: only read when LOAD_TAIL
    if LOAD_TAIL:
        tail = tl.load(tail_ptr, mask=tail_mask, other=0.0)
    if NORM:
        sum_sq = tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)
        if PARTIAL:  # the un-rotated dims count towards the head's RMS and are normalised too
            tail_f = tail.to(tl.float32)
            sum_sq += tl.sum(tail_f * tail_f, 1)
        rstd = 1.0 / tl.sqrt(sum_sq / HEAD_DIM + eps)
        x1 = _rms_scale(x1, rstd, w_ptr, half, half_mask, dtype)
        x2 = _rms_scale(x2, rstd, w_ptr + HALF, half, half_mask, dtype)
        if PARTIAL:
            tail = cast(_rms_scale(tail_f, rstd, w_ptr, dims, tail_cols, dtype), dtype)
            tl.store(tail_ptr, tail, mask=tail_mask)
    r1 = cast(x1 * cos[None, :] - x2 * sin[None, :], dtype)
    r2 = cast(x2 * cos[None, :] + x1 * sin[None, :], dtype)
    tl.store(lo, r1, mask=mask)
    tl.store(lo + HALF, r2, mask=mask)
    return r1, r2, tail


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
    q_w_ptr,
    k_w_ptr,
    eps,
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
    NORM: tl.constexpr,
    PARTIAL: tl.constexpr,
    Q_TAIL: tl.constexpr,
    K_TAIL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    half = tl.arange(0, HALF_PAD)
    half_mask = half < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cos + half, mask=half_mask, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cos + HALF + half, mask=half_mask, other=0.0)
    sin = sin.to(tl.float32)
    dims = tl.arange(0, DIM_PAD)
    tail_cols = (dims >= 2 * HALF) & (dims < HEAD_DIM)

    qh = tl.arange(0, Q_HEADS_PAD)
    _rope_heads(
        q_ptr + token * stride_qt, stride_qh, qh, qh < NUM_Q_HEADS, half, half_mask, dims, tail_cols,
        cos, sin, q_w_ptr, eps, HALF, HEAD_DIM, NORM, PARTIAL, Q_TAIL,
    )
    kh = tl.arange(0, KV_HEADS_PAD)
    kh_mask = kh < NUM_KV_HEADS
    k1_rot, k2_rot, k_tail = _rope_heads(
        k_ptr + token * stride_kt, stride_kh, kh, kh_mask, half, half_mask, dims, tail_cols,
        cos, sin, k_w_ptr, eps, HALF, HEAD_DIM, NORM, PARTIAL, K_TAIL,
    )

    if STORE_KV:
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot >= 0:
            dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct
            k_mask = kh_mask[:, None] & half_mask[None, :]
            dst_lo = dst + kh[:, None] * stride_ch + half[None, :]
            tl.store(k_cache_ptr + dst_lo, cast(k1_rot, k_cache_ptr.dtype.element_ty), mask=k_mask)
            tl.store(
                k_cache_ptr + dst_lo + HALF, cast(k2_rot, k_cache_ptr.dtype.element_ty), mask=k_mask
            )
            if PARTIAL:  # the un-rotated tail goes to the cache too
                tl.store(
                    k_cache_ptr + dst + kh[:, None] * stride_ch + dims[None, :],
                    cast(k_tail, k_cache_ptr.dtype.element_ty),
                    mask=kh_mask[:, None] & tail_cols[None, :],
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


def _check_norm_weights(
    q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None, head_dim: int,
    device: torch.device,
) -> bool:
    """Whether the per-head q/k norm is on; both weights or neither."""
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight and k_norm_weight go together: give both or neither")
    if q_norm_weight is None or k_norm_weight is None:
        return False
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        check_dtype(name, w, FLOAT_DTYPES)
        check_shape(name, w, (head_dim,))
        if w.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous")
        if w.device != device:
            raise ValueError(f"{name} is on another device than q")
    return True


def _launch(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    v: torch.Tensor | None,
    kv_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor | None,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> None:
    device, rot_dim = _check_rotary_args(positions, q, k, cos_sin_cache)
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    norm = _check_norm_weights(q_norm_weight, k_norm_weight, head_dim, device)
    if not norm:  # placeholders: the NORM=False specialisation never touches them
        q_norm_weight = k_norm_weight = q
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
    partial = rot_dim < head_dim
    _rope_kernel.on(device)[(tokens,)](
        positions,
        q,
        k,
        cos_sin_cache,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        q_norm_weight,
        k_norm_weight,
        float(eps),
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
        NORM=norm,
        PARTIAL=partial,
        # The dims past the rotation are read when they are normalised or copied to the cache.
        Q_TAIL=partial and norm,
        K_TAIL=partial and (norm or store),
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
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply_rotary` plus :func:`~tandem.kernels.kv_store.store_kv` of the rotated k and
    of v in one pass (negative slots skip the cache write). Returns ``(q, k)``.

    With ``q_norm_weight``/``k_norm_weight`` ``[D]`` (both or neither), every q and k head is
    first RMS-normalised over its ``D`` dims with that weight and ``eps`` (Qwen3's per-head q/k
    norm, with :func:`~tandem.kernels.norm.rmsnorm`'s roundings), all in the same kernel: q is
    left normalised and rotated in place, k likewise in place and in the cache."""
    _launch(positions, q, k, cos_sin_cache, v, kv_cache, slot_mapping, q_norm_weight, k_norm_weight, eps)
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
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch twin of :func:`rope_and_store_kv`: returns new ``(q, k)``, writes ``kv_cache``."""
    if _check_norm_weights(q_norm_weight, k_norm_weight, q.shape[-1], q.device):
        assert q_norm_weight is not None and k_norm_weight is not None
        q, k = rmsnorm_reference(q, q_norm_weight, eps), rmsnorm_reference(k, k_norm_weight, eps)
    q_rot, k_rot = apply_rotary_reference(positions, q, k, cos_sin_cache)
    store_kv_reference(k_rot, v, kv_cache, slot_mapping)
    return q_rot, k_rot
