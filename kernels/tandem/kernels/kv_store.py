"""Write this step's K and V rows into the paged KV cache by slot mapping.

``kv_cache[2, num_blocks, block_size, Hkv, D]``; token t goes to block ``slot // block_size``,
row ``slot % block_size``. Negative slots (padding tokens of a CUDA-graph batch) are skipped.
Bytes moved: reads and writes ``2·T·Hkv·D·e`` each (Qwen3-8B bf16: 4 KiB per token) — one
program per token copies all its heads at once, contiguous runs of ``D`` elements.
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

__all__ = ["check_kv_cache_args", "store_kv", "store_kv_reference"]


@triton_kernel
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ct,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, DIM_PAD)
    mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct
    dst_off = dst + heads[:, None] * stride_ch + dims[None, :]
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    tl.store(k_cache_ptr + dst_off, cast(k, k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    tl.store(v_cache_ptr + dst_off, cast(v, v_cache_ptr.dtype.element_ty), mask=mask)


def check_kv_cache_args(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> torch.device:
    """Validate ``key``/``value`` ``[T, Hkv, D]`` against the cache and the ``[T]`` slot map."""
    for name, t in (("key", key), ("value", value), ("kv_cache", kv_cache)):
        check_dtype(name, t, FLOAT_DTYPES)
        check_contiguous_last_dim(name, t)
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must be [2, blocks, block_size, Hkv, D], got {list(kv_cache.shape)}")
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    tokens = slot_mapping.shape[0] if slot_mapping.dim() == 1 else -1
    check_shape("slot_mapping", slot_mapping, (tokens,))
    check_dtype("slot_mapping", slot_mapping, (torch.int64, torch.int32))
    check_shape("key", key, (tokens, num_kv_heads, head_dim))
    check_shape("value", value, (tokens, num_kv_heads, head_dim))
    return check_same_device(key=key, value=value, kv_cache=kv_cache, slot_mapping=slot_mapping)


def store_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Copy ``key``/``value`` ``[T, Hkv, D]`` into ``kv_cache`` at ``slot_mapping`` (in place;
    values are cast to the cache dtype)."""
    device = check_kv_cache_args(key, value, kv_cache, slot_mapping)
    tokens = key.shape[0]
    if tokens == 0:
        return
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _store_kv_kernel.on(device)[(tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=next_power_of_2(num_kv_heads),
        DIM_PAD=next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        num_warps=4,
    )


def store_kv_reference(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """PyTorch twin of :func:`store_kv`."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = kv_cache.shape[2]
    blocks, rows = slots // block_size, slots % block_size
    kv_cache[0, blocks, rows] = key[keep].to(kv_cache.dtype)
    kv_cache[1, blocks, rows] = value[keep].to(kv_cache.dtype)
