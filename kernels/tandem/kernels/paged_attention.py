"""Paged attention over the block-table KV cache: decode (one query per sequence) and prefill.

Cache layout per layer: ``kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]`` (0 = K,
1 = V); token position p of a sequence lives in block ``block_table[p // block_size]`` at row
``p % block_size``. Every kernel gathers K/V rows through the block table, one ``head_dim`` row
(contiguous, 256 B for bf16 × 128) per token and KV head.

Decode — bytes moved and why it is laid out so. One query token per sequence makes decode pure
bandwidth: per layer it reads ``sum(seq_lens) * num_kv_heads * head_dim * 2 (K and V) * elt``
bytes (Qwen3-8B, 8k context, bf16: 32 MiB per sequence per layer) while the queries and outputs
are ``B * H * D * elt`` (KiB). One program handles all query heads of one KV head (grouped-query
attention), so each K/V row is read from HBM exactly once; the group is padded to 16 rows so
``q·Kᵀ`` and ``p·V`` run on the tensor cores via ``tl.dot`` (the wasted rows cost FLOPs, which
decode has to spare, not bytes). When ``B * num_kv_heads`` programs cannot fill the GPU, the
context is split (flash-decoding): each split writes fp32 partials (max, sum, unnormalised acc:
``B * H * splits * (D + 2) * 4`` bytes, a few % of the K/V bytes at most, since every split
covers at least one 64-token tile) and a small second kernel merges them. Measured on an H200
(bf16, Qwen3-8B heads, 8k context): 92–99 % of device-to-device copy bandwidth from batch 16
up; batch 1 takes 12–15 µs per layer.

Prefill — variable-length causal attention with online softmax, one program per (query tile,
sequence, query head). K/V come from the paged pool only (the caller has already written this
step's K/V), so prefix-cache hits and earlier chunks need no special path. Tiles entirely below the
diagonal skip the causal mask. Each K/V tile is read once per query tile and head; the
``group_size`` heads sharing it hit in L2, so HBM traffic is about ``q_tiles * ctx * Hkv * D * 2 *
elt`` — prefill is compute-bound for query tiles of 64 rows (H200, bf16, Qwen3-8B heads:
200–365 TFLOP/s, from a 1k prompt to an 8k one).

Sliding window (``sliding_window=W``, a per-layer constant, so CUDA graphs capture it): the
query at position p sees keys ``p - W + 1 .. p``. Decode starts its tiles at ``seq_len - W``, so
it reads only the window's blocks (KV bytes ``B * min(seq_len, W) * ...``) and the split count is
chosen from the window; prefill starts each query tile at its first row's window and masks per
row. Entries of the block table before the window are never read (the block manager gives those
blocks back). The references apply the same mask.

No autotuning: tile sizes and warps are fixed per head_dim, so the kernels can be captured in
CUDA graphs without a tuning run at capture time.
"""

from __future__ import annotations

import math

import torch

from tandem.kernels._utils import (
    FLOAT_DTYPES,
    cast,
    check_contiguous_last_dim,
    check_dtype,
    check_same_device,
    check_shape,
    dot,
    dot_precision,
    next_power_of_2,
    num_compute_units,
    tl,
    triton_kernel,
)

__all__ = [
    "choose_num_splits",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "paged_prefill_attention",
    "paged_prefill_attention_reference",
]

_LOG2E = 1.4426950408889634
_MIN_DOT_ROWS = 16  # tl.dot needs M, N, K >= 16
_MAX_SPLITS = 64


# --------------------------------------------------------------------------- Triton kernels


@triton_kernel
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    scale_log2,
    stride_qb,
    stride_qh,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_bt,
    stride_ob,
    stride_oh,
    window,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    SPLIT: tl.constexpr,
    SLIDING: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)  # a runtime value: one compiled variant serves every count
    num_heads = tl.num_programs(1) * GROUP

    seq_len = tl.load(seq_lens_ptr + seq)
    # The query (position seq_len - 1) sees keys from `lo` on: the window's first position, so
    # blocks before it are never read (they may have been given back to the pool).
    lo = 0
    if SLIDING:
        lo = tl.maximum(seq_len - window, 0)
    # Splits own whole tiles: balanced per sequence from its real length, so a padded block
    # table (CUDA graphs) does not leave all the work to the first split.
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len - lo, TILE_N), num_splits)
    start = lo + split * tiles_per_split * TILE_N
    end = tl.minimum(start + tiles_per_split * TILE_N, seq_len)

    rows = tl.arange(0, GROUP_PAD)
    row_mask = rows < GROUP
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    offs_n = tl.arange(0, TILE_N)
    table_row = block_tables_ptr + seq * stride_bt
    head_off = kv_head * stride_ch

    for n0 in range(start, end, TILE_N):
        pos = n0 + offs_n
        valid = pos < end
        block = tl.load(table_row + pos // BLOCK_SIZE, mask=valid, other=0)
        row_off = block.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_ct + head_off
        kv_mask = valid[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + row_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        s = dot(q, tl.trans(k), DOT_PRECISION) * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + row_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        p = p.to(v.dtype)
        acc = acc * alpha[:, None] + dot(p, v, DOT_PRECISION)
        m_i = m_new

    out_mask = row_mask[:, None] & dim_mask[None, :]
    if not SPLIT:
        # seq_len == 0 (padding entries of a captured batch) yields zeros, not NaN.
        denom = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / denom[:, None]
        tl.store(
            out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :],
            cast(o, out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        part = (seq * num_heads + heads) * num_splits + split
        tl.store(part_m_ptr + part, m_i, mask=row_mask)
        tl.store(part_l_ptr + part, l_i, mask=row_mask)
        tl.store(
            part_acc_ptr + part[:, None].to(tl.int64) * HEAD_DIM + dims[None, :],
            acc,
            mask=out_mask,
        )


@triton_kernel
def _decode_reduce_kernel(
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_mask = splits < num_splits
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    base = (seq * num_heads + head) * num_splits
    m = tl.load(part_m_ptr + base + splits, mask=split_mask, other=float("-inf"))
    l = tl.load(part_l_ptr + base + splits, mask=split_mask, other=0.0)
    acc = tl.load(
        part_acc_ptr + (base + splits[:, None]).to(tl.int64) * HEAD_DIM + dims[None, :],
        mask=split_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    m_max = tl.max(m, 0)
    # Empty splits carry m = -inf; if every split is empty (seq_len 0) avoid -inf - -inf.
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)
    total = tl.sum(l * w, 0)
    o = tl.sum(acc * w[:, None], 0)
    o = o / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + seq * stride_ob + head * stride_oh + dims,
        cast(o, out_ptr.dtype.element_ty),
        mask=dim_mask,
    )


@triton_kernel
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_bt,
    stride_ot,
    stride_oh,
    window,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    SLIDING: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    q_tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # tokens before this chunk (prefix hits, earlier chunks)

    rows = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    q_pos = context + rows
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    q_rows = (q_start + rows).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    offs_n = tl.arange(0, TILE_N)
    table_row = block_tables_ptr + seq * stride_bt
    head_off = (head // GROUP) * stride_ch

    first_pos = context + q_tile * BLOCK_M
    last_pos = tl.minimum(first_pos + BLOCK_M, seq_len) - 1
    # Tiles whose every key is <= first_pos are visible to all rows: no mask needed there.
    unmasked_end = ((first_pos + 1) // TILE_N) * TILE_N
    masked_start = unmasked_end
    if SLIDING:
        # Keys before the first row's window are never read; every tile is masked (each row's
        # window starts elsewhere).
        unmasked_end = 0
        masked_start = tl.maximum(first_pos - window + 1, 0)

    for n0 in range(0, unmasked_end, TILE_N):
        pos = n0 + offs_n
        block = tl.load(table_row + pos // BLOCK_SIZE)
        row_off = block.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_ct + head_off
        k = tl.load(k_cache_ptr + row_off[:, None] + dims[None, :], mask=dim_mask[None, :], other=0.0)
        s = dot(q, tl.trans(k), DOT_PRECISION) * scale_log2
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + row_off[:, None] + dims[None, :], mask=dim_mask[None, :], other=0.0)
        p = p.to(v.dtype)
        acc = acc * alpha[:, None] + dot(p, v, DOT_PRECISION)
        m_i = m_new

    for n0 in range(masked_start, last_pos + 1, TILE_N):
        pos = n0 + offs_n
        valid = pos <= last_pos
        block = tl.load(table_row + pos // BLOCK_SIZE, mask=valid, other=0)
        row_off = block.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_ct + head_off
        kv_mask = valid[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + row_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        s = dot(q, tl.trans(k), DOT_PRECISION) * scale_log2
        # Rows past q_len have q_pos > last_pos, so they see every loaded key (unless windowed).
        visible = pos[None, :] <= q_pos[:, None]
        if SLIDING:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible key yet (its window starts later) keeps m = -inf:
        # subtract 0 instead, so it stays at p = 0, alpha = 0 rather than NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + row_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        p = p.to(v.dtype)
        acc = acc * alpha[:, None] + dot(p, v, DOT_PRECISION)
        m_i = m_new

    o = acc / l_i[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + dims[None, :],
        cast(o, out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )


# --------------------------------------------------------------------------- launch helpers


def _check_cache(kv_cache: torch.Tensor, num_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    check_shape("kv_cache", kv_cache, (2, None, None, None, head_dim))
    if kv_cache.dtype != dtype:
        raise TypeError(f"kv_cache dtype {kv_cache.dtype} differs from the query dtype {dtype}")
    check_contiguous_last_dim("kv_cache", kv_cache)
    num_kv_heads = kv_cache.shape[3]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")


def _check_window(sliding_window: int | None) -> None:
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")


def choose_num_splits(
    batch: int, num_kv_heads: int, max_context: int, num_units: int, tile_n: int = 64
) -> int:
    """Split-KV factor for decode: the largest power of two that keeps the grid within about
    four programs per SM (decode is bandwidth-bound, so it needs a few resident programs per SM
    to hide latency, and more only adds partials to merge), with at least one tile per split.

    Measured on an H200 (Qwen3-8B shapes, 8k context): B=1 64 splits 12 µs vs 219 µs unsplit;
    B=4 16 splits; B=8 8; B=32 2 — each the fastest count tried, powers of two beating the
    counts between them. ``max_context`` is an upper bound known on the host (block-table width ×
    block size), so choosing needs no device→host sync and works under CUDA-graph capture.
    """
    programs = batch * num_kv_heads
    target_programs = 4 * num_units
    limit = min(_MAX_SPLITS, max(1, max_context // tile_n))
    splits = 1
    while 2 * splits <= limit and 2 * splits * programs <= target_programs:
        splits *= 2
    return splits


def _decode_config(head_dim_pad: int) -> tuple[int, int, int]:
    """(TILE_N, num_warps, num_stages) per padded head_dim."""
    if head_dim_pad <= 64:
        return 64, 4, 3
    if head_dim_pad <= 128:
        return 64, 4, 2
    return 32, 4, 2


def _prefill_config(head_dim_pad: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, TILE_N, num_warps, num_stages) per padded head_dim."""
    if head_dim_pad <= 64:
        return 64, 64, 4, 3
    if head_dim_pad <= 128:
        return 64, 64, 4, 2
    return 32, 32, 4, 2


# --------------------------------------------------------------------------- public API


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context.

    With ``sliding_window`` W the query (position ``seq_len - 1``) sees only the last W keys,
    and only the blocks holding them are read (entries before them may be stale or given back).

    q ``[B, H, D]``; kv_cache ``[2, num_blocks, block_size, Hkv, D]``; block_tables ``[B, M]``
    int32; seq_lens ``[B]`` int32 (context length including the query token, whose K/V must
    already be in the cache). ``num_splits=None`` picks a split-KV factor by
    :func:`choose_num_splits`. Sequences with ``seq_lens == 0`` get zeros. Returns ``out``
    (``[B, H, D]``, q's dtype), allocated when not given.
    """
    check_dtype("q", q, FLOAT_DTYPES)
    if q.dim() != 3:
        raise ValueError(f"q must be [B, H, D], got {list(q.shape)}")
    batch, num_heads, head_dim = q.shape
    check_contiguous_last_dim("q", q)
    _check_cache(kv_cache, num_heads, head_dim, q.dtype)
    check_shape("block_tables", block_tables, (batch, None))
    check_shape("seq_lens", seq_lens, (batch,))
    check_dtype("block_tables", block_tables, (torch.int32,))
    check_dtype("seq_lens", seq_lens, (torch.int32,))
    device = check_same_device(q=q, kv_cache=kv_cache, block_tables=block_tables, seq_lens=seq_lens)
    if out is None:
        out = torch.empty_like(q)
    else:
        check_shape("out", out, tuple(q.shape))
        check_contiguous_last_dim("out", out)
        if out.dtype != q.dtype:
            raise TypeError(f"out dtype {out.dtype} differs from q dtype {q.dtype}")
    _check_window(sliding_window)
    if batch == 0:
        return out

    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    group_pad = max(_MIN_DOT_ROWS, next_power_of_2(group))
    head_dim_pad = max(_MIN_DOT_ROWS, next_power_of_2(head_dim))
    tile_n, num_warps, num_stages = _decode_config(head_dim_pad)
    if num_splits is None:
        max_context = block_tables.shape[1] * block_size
        if sliding_window is not None:
            max_context = min(max_context, sliding_window)
        num_splits = choose_num_splits(
            batch, num_kv_heads, max_context, num_compute_units(device), tile_n
        )
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")

    if num_splits > 1:
        part_m = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(
            batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=device
        )
    else:  # unused by the kernel; any valid pointer will do
        part_m = part_l = part_acc = out

    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _decode_kernel.on(device)[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_m,
        part_l,
        part_acc,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        sliding_window or 0,
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        SPLIT=num_splits > 1,
        SLIDING=sliding_window is not None,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if num_splits > 1:
        _decode_reduce_kernel.on(device)[(batch, num_heads)](
            part_m,
            part_l,
            part_acc,
            out,
            out.stride(0),
            out.stride(1),
            num_splits,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=next_power_of_2(head_dim),
            SPLITS_PAD=next_power_of_2(num_splits),
            num_warps=4 if head_dim > 64 else 2,
        )
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Variable-length causal attention for a flat batch of query chunks over the paged cache.

    With ``sliding_window`` W the row at position p sees keys ``p - W + 1 .. p`` only; blocks
    before the chunk's first window are not read.

    q ``[T, H, D]`` with sequence b's rows at ``query_start_loc[b]:query_start_loc[b+1]`` (int32,
    ``[B+1]``); they are positions ``seq_lens[b]-q_len_b .. seq_lens[b]-1``, and the K/V of every
    position up to ``seq_lens[b]-1`` (this chunk's included) must already be in the cache.
    ``max_query_len`` (a host int, >= every q_len) sizes the grid without a device sync. Rows of
    q outside ``[0, query_start_loc[B])`` are left untouched in ``out``.
    """
    check_dtype("q", q, FLOAT_DTYPES)
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, D], got {list(q.shape)}")
    _, num_heads, head_dim = q.shape
    check_contiguous_last_dim("q", q)
    _check_cache(kv_cache, num_heads, head_dim, q.dtype)
    if query_start_loc.dim() != 1 or query_start_loc.shape[0] < 1:
        raise ValueError("query_start_loc must be [B+1]")
    batch = query_start_loc.shape[0] - 1
    check_shape("seq_lens", seq_lens, (batch,))
    check_shape("block_tables", block_tables, (batch, None))
    for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens),
                    ("block_tables", block_tables)):
        check_dtype(name, t, (torch.int32,))
    device = check_same_device(
        q=q, kv_cache=kv_cache, query_start_loc=query_start_loc, seq_lens=seq_lens,
        block_tables=block_tables,
    )
    if out is None:
        out = torch.empty_like(q)
    else:
        check_shape("out", out, tuple(q.shape))
        check_contiguous_last_dim("out", out)
        if out.dtype != q.dtype:
            raise TypeError(f"out dtype {out.dtype} differs from q dtype {q.dtype}")
    _check_window(sliding_window)
    if batch == 0 or max_query_len <= 0:
        return out

    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    head_dim_pad = max(_MIN_DOT_ROWS, next_power_of_2(head_dim))
    block_m, tile_n, num_warps, num_stages = _prefill_config(head_dim_pad)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    grid = (math.ceil(max_query_len / block_m), batch, num_heads)
    _prefill_kernel.on(device)[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        sliding_window or 0,
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        TILE_N=tile_n,
        SLIDING=sliding_window is not None,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


# --------------------------------------------------------------------------- references


def _gather_context(
    kv_cache: torch.Tensor, block_table: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of positions ``0..length-1`` as float32 ``[length, Hkv, D]``."""
    block_size = kv_cache.shape[2]
    pos = torch.arange(length, device=kv_cache.device)
    slots = block_table.long()[pos // block_size] * block_size + pos % block_size
    flat = kv_cache.flatten(1, 2)
    return flat[0, slots].float(), flat[1, slots].float()


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """q ``[n, H, D]`` fp32 at positions q_pos; k/v ``[L, Hkv, D]`` fp32; causal by position,
    and within ``sliding_window`` keys of each query when given."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) * scale
    key_pos = torch.arange(k.shape[0], device=q.device)
    scores = scores.masked_fill(key_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    if sliding_window is not None:
        hidden = key_pos[None, None, :] <= q_pos[None, :, None] - sliding_window
        scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(scores, dim=-1), v)


def paged_decode_attention_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Float32 PyTorch twin of :func:`paged_decode_attention` (defines its semantics)."""
    out = torch.zeros_like(q)
    for b, length in enumerate(seq_lens.tolist()):
        if length == 0:
            continue
        k, v = _gather_context(kv_cache, block_tables[b], length)
        q_pos = torch.tensor([length - 1], device=q.device)
        out[b] = _attend(q[b : b + 1].float(), k, v, q_pos, scale, sliding_window)[0].to(q.dtype)
    return out


def paged_prefill_attention_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Float32 PyTorch twin of :func:`paged_prefill_attention` (``max_query_len`` is unused)."""
    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    for b, length in enumerate(seq_lens.tolist()):
        lo, hi = starts[b], starts[b + 1]
        if hi == lo:
            continue
        k, v = _gather_context(kv_cache, block_tables[b], length)
        q_pos = torch.arange(length - (hi - lo), length, device=q.device)
        out[lo:hi] = _attend(q[lo:hi].float(), k, v, q_pos, scale, sliding_window).to(q.dtype)
    return out
