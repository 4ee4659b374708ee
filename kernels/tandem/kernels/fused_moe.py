"""Mixture-of-experts feed-forward: top-k routing and the routed experts' SwiGLU MLPs.

``select_experts`` turns router logits into per-token (weight, expert) pairs (softmax in float32,
top-k, optional renormalisation: Qwen3-MoE's ``norm_topk_prob``). ``fused_moe`` runs every
selected expert on its tokens and sums the weighted outputs:

    out[t] = sum_j  w[t, j] * down_e( silu(gate_e(x[t])) * up_e(x[t]) ),   e = ids[t, j]

with the experts' weights stacked as ``w_gate_up [E, 2I, Hd]`` (gate rows first) and
``w_down [E, Hd, I]`` (the layout transformers 5 keeps in memory).

How the Triton path works (two GEMM launches plus cheap torch bookkeeping):

1. Alignment (torch, no host sync, static shapes, so a decode step can be captured in a CUDA
   graph): the ``P = N·k`` (token, slot) pairs are sorted by expert and each expert's run is
   padded to a multiple of ``BLOCK_M`` rows; ``sorted_pairs`` lists the pair index per row
   (``P`` marks padding) and ``block_expert`` the expert of each ``BLOCK_M``-row block (-1 for
   blocks past the end). The buffer is sized for the worst case, ``P + min(E, P)·(BLOCK_M-1)``.
   A decode step passes the same layout already built by the routing launch
   (``moe_routing.route_experts``, ``layout=``): then no torch op runs here at all.
2. ``_moe_gate_up_kernel``: per (row block, column tile of I), gathers the block's token rows
   of ``x``, multiplies them by the expert's gate and up tiles (float32 accumulators), applies
   SiLU·mul in registers and writes the ``[P, I]`` activation once, rounded to the model dtype
   (the ``[P, 2I]`` gate/up product never reaches memory).
3. ``_moe_down_kernel``: per (row block, column tile of Hd), the activation times the expert's
   down tile, scaled by the pair's routing weight, rounded to the model dtype into ``[P, Hd]``.
4. Combine: the ``k`` rows of each token summed in float32 (no atomics: deterministic, and
   portable to ROCm), rounded once.

Bytes moved: each expert's weights are read once per row block that routes to it, so a decode
step of B tokens reads about ``distinct_experts · 3·Hd·I·e`` of weights (with BLOCK_M ≥ the
tokens an expert gets); activations are small next to that.

``fused_moe_reference`` is the PyTorch twin (a loop over the experts that have tokens) with the
same roundings: float32 GEMM accumulation, the activation rounded to the model dtype, each
weighted pair output rounded to the model dtype, the k pairs summed in float32.

FP8 experts (W8A16): pass ``scales=MoeFp8Scales(gate_up, down, block)`` with the weights stored
as ``float8_e4m3fn`` and block scales ``[E, ceil(rows/bn), ceil(cols/bk)]`` (``fp8_gemm``'s
layout). Both kernels then multiply each loaded weight tile by its block's scale in float32 and
round it to the model dtype before the dot; the twin dequantizes each used expert the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.kernels._utils import (
    FLOAT_DTYPES,
    cast,
    cdiv,
    check_contiguous_last_dim,
    check_dtype,
    check_same_device,
    check_shape,
    dot,
    dot_precision,
    num_compute_units,
    tl,
    triton_kernel,
)
from tandem.kernels.fp8_gemm import FP8_DTYPE, check_scale, dequantize

__all__ = [
    "align_pairs_by_expert",
    "fused_moe",
    "fused_moe_ref",
    "fused_moe_reference",
    "MoeFp8Scales",
    "PairLayout",
    "pair_block_m",
    "select_experts",
]


@dataclass(frozen=True)
class MoeFp8Scales:
    """Block scales of FP8 expert weights: ``gate_up [E, ceil(2I/bn), ceil(Hd/bk)]``,
    ``down [E, ceil(Hd/bn), ceil(I/bk)]``, float32, for blocks ``block = (bn, bk)``."""

    gate_up: torch.Tensor
    down: torch.Tensor
    block: tuple[int, int]


@dataclass(frozen=True)
class PairLayout:
    """The (token, slot) pairs sorted by expert, as ``align_pairs_by_expert`` returns them:
    ``sorted_pairs [R]`` int32 and ``block_expert [R // block_m]`` int32, for row blocks of
    ``block_m = pair_block_m(N·k, E)`` rows. ``moe_routing.route_experts`` builds it in its
    routing launch; ``fused_moe`` takes it instead of aligning the pairs itself."""

    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    block_m: int


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, E]`` logits -> ``(topk_weights [N, k] float32, topk_ids [N, k] int32)``.

    Softmax in float32 over all experts, the ``top_k`` largest probabilities (ties broken as
    ``torch.topk`` does, as transformers does), divided by their sum when ``renormalize``.
    """
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [N, E], got {list(router_logits.shape)}")
    num_experts = router_logits.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def _check_inputs(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    scales: MoeFp8Scales | None = None,
) -> tuple[int, int, int, int, int]:
    check_dtype("hidden", hidden, FLOAT_DTYPES)
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [N, Hd], got {list(hidden.shape)}")
    n, hd = hidden.shape
    if w_gate_up.dim() != 3 or w_gate_up.shape[1] % 2:
        raise ValueError(f"w_gate_up must be [E, 2I, Hd], got {list(w_gate_up.shape)}")
    e, inter = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    check_shape("w_gate_up", w_gate_up, (e, 2 * inter, hd))
    check_shape("w_down", w_down, (e, hd, inter))
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        want = FP8_DTYPE if scales is not None else hidden.dtype
        if w.dtype != want:
            raise TypeError(f"{name} has dtype {w.dtype}; expected {want}")
    if scales is not None:
        check_scale(w_gate_up, scales.gate_up, scales.block)
        check_scale(w_down, scales.down, scales.block)
    if topk_ids.dim() != 2 or topk_ids.shape[0] != n:
        raise ValueError(f"topk_ids must be [N={n}, k], got {list(topk_ids.shape)}")
    k = topk_ids.shape[1]
    check_shape("topk_weights", topk_weights, (n, k))
    check_dtype("topk_weights", topk_weights, (torch.float32,))
    check_dtype("topk_ids", topk_ids, (torch.int32, torch.int64))
    check_same_device(hidden=hidden, w_gate_up=w_gate_up, w_down=w_down, topk_weights=topk_weights,
                      topk_ids=topk_ids)
    return n, hd, e, inter, k


# --------------------------------------------------------------------------- PyTorch twin


def fused_moe_reference(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    scales: MoeFp8Scales | None = None,
) -> torch.Tensor:
    """PyTorch twin of :func:`fused_moe`: a loop over the experts that received tokens."""
    n, hd, _, _, _ = _check_inputs(hidden, w_gate_up, w_down, topk_weights, topk_ids, scales)
    dtype = hidden.dtype
    out = torch.zeros(n, hd, dtype=torch.float32, device=hidden.device)
    ids = topk_ids.long()
    for expert in torch.unique(ids).tolist():  # sorted; experts with no tokens never appear
        tokens, slots = torch.where(ids == expert)
        x = hidden[tokens].float()
        w1, w2 = w_gate_up[expert], w_down[expert]
        if scales is not None:  # rounded to the model dtype, as the kernels round each tile
            w1 = dequantize(w1, scales.gate_up[expert], scales.block, dtype)
            w2 = dequantize(w2, scales.down[expert], scales.block, dtype)
        gate, up = F.linear(x, w1.float()).chunk(2, dim=-1)
        act = (F.silu(gate) * up).to(dtype)
        y = F.linear(act.float(), w2.float())
        pair = (y * topk_weights[tokens, slots, None]).to(dtype)
        out.index_add_(0, tokens, pair.float())
    return out.to(dtype)


fused_moe_ref = fused_moe_reference  # the short name docs/interfaces.md also lists


# --------------------------------------------------------------------------- Triton path


def align_pairs_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the ``P = N·k`` (token, slot) pairs by expert, each expert's run padded to ``block_m``.

    Returns ``(sorted_pairs [R] int32, block_expert [R // block_m] int32)`` with ``R`` the
    worst-case padded length (a function of N, k, E and block_m only). ``sorted_pairs`` holds
    flat pair indices (``token * k + slot``), ``P`` in padding rows; ``block_expert`` is the
    expert of each block, -1 for blocks past the last expert's run. Device-side only.
    """
    flat = topk_ids.reshape(-1).long()
    p = flat.numel()
    device = flat.device
    rows = cdiv(p + min(num_experts, p) * (block_m - 1), block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # not bincount: that syncs on CUDA
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    count_start = counts.cumsum(0) - counts
    order = torch.argsort(flat, stable=True)
    experts_sorted = flat[order]
    rank = torch.arange(p, device=device) - count_start[experts_sorted]
    sorted_pairs = torch.full((rows,), p, dtype=torch.int32, device=device)
    sorted_pairs[padded_start[experts_sorted] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, rows, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_start < padded_end[-1], block_expert, -1).to(torch.int32)
    return sorted_pairs, block_expert


@triton_kernel(do_not_specialize=("num_pairs",))
def _moe_gate_up_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    act_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    num_pairs,
    hidden,
    inter,
    top_k,
    stride_xm,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_am,
    HAS_SCALE: tl.constexpr,
    SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_pairs
    tokens = (pairs // top_k).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(x_ptr + tokens[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w_gate = tl.load(w_base + cols[None, :].to(tl.int64) * stride_wn + ks[:, None], mask=w_mask, other=0.0)
        w_up = tl.load(w_base + (cols[None, :] + inter).to(tl.int64) * stride_wn + ks[:, None], mask=w_mask,
                       other=0.0)
        if HAS_SCALE:  # FP8 tiles times their block scales, rounded to the activation dtype
            s_base = ws_ptr + expert.to(tl.int64) * stride_wse + k0 // SCALE_BK
            s_gate = tl.load(s_base + (cols // SCALE_BN).to(tl.int64) * stride_wsn, mask=col_ok, other=0.0)
            s_up = tl.load(s_base + ((cols + inter) // SCALE_BN).to(tl.int64) * stride_wsn, mask=col_ok, other=0.0)
            w_gate = cast(w_gate.to(tl.float32) * s_gate[None, :], x_ptr.dtype.element_ty)
            w_up = cast(w_up.to(tl.float32) * s_up[None, :], x_ptr.dtype.element_ty)
        acc_gate += dot(a, w_gate, PRECISION)
        acc_up += dot(a, w_up, PRECISION)
    y = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    out = act_ptr + pairs[:, None].to(tl.int64) * stride_am + cols[None, :]
    tl.store(out, cast(y, act_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton_kernel(do_not_specialize=("num_pairs",))
def _moe_down_kernel(
    act_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    weights_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    num_pairs,
    hidden,
    inter,
    stride_am,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_om,
    HAS_SCALE: tl.constexpr,
    SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_pairs
    rows = pairs.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(act_ptr + rows[:, None] * stride_am + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w = tl.load(w_base + cols[None, :].to(tl.int64) * stride_wn + ks[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if HAS_SCALE:
            s = tl.load(ws_ptr + expert.to(tl.int64) * stride_wse + k0 // SCALE_BK
                        + (cols // SCALE_BN).to(tl.int64) * stride_wsn, mask=col_ok, other=0.0)
            w = cast(w.to(tl.float32) * s[None, :], act_ptr.dtype.element_ty)
        acc += dot(a, w, PRECISION)
    weight = tl.load(weights_ptr + rows, mask=row_ok, other=0.0)
    acc = acc * weight[:, None]
    out = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(out, cast(acc, out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def pair_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per block: about the tokens an expert gets (tl.dot needs at least 16)."""
    per_expert = num_pairs / num_experts
    if per_expert <= 16:
        return 16
    return 32 if per_expert <= 64 else 64


def _block_n(busy_blocks: int, cols: int, device: torch.device) -> int:
    """Column tile width: 64, narrowed (to 32, 16) while fewer than two programs per compute unit
    would run — a small decode batch has few busy row blocks, and each program streams its
    weight tile through a long K loop."""
    target = 2 * num_compute_units(device)
    for width in (64, 32):
        if busy_blocks * cdiv(cols, width) >= target:
            return width
    return 16


def _scale_args(scales: MoeFp8Scales | None, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> dict:
    """The kernels' scale arguments; without scales, placeholders (the weights) never read."""
    if scales is None:
        return {"gate_up": w_gate_up, "down": w_down, "gate_up_strides": (0, 0), "down_strides": (0, 0),
                "consts": {"HAS_SCALE": False, "SCALE_BN": 1, "SCALE_BK": 1}}
    for s in (scales.gate_up, scales.down):
        if s.stride(-1) != 1:
            raise ValueError("expert scales must be contiguous in their last dim")
    return {"gate_up": scales.gate_up, "down": scales.down,
            "gate_up_strides": (scales.gate_up.stride(0), scales.gate_up.stride(1)),
            "down_strides": (scales.down.stride(0), scales.down.stride(1)),
            "consts": {"HAS_SCALE": True, "SCALE_BN": scales.block[0], "SCALE_BK": scales.block[1]}}


def fused_moe(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    scales: MoeFp8Scales | None = None,
    layout: PairLayout | None = None,
) -> torch.Tensor:
    """``[N, Hd]`` -> ``[N, Hd]``: the weighted sum of each token's ``k`` experts' SwiGLU MLPs.

    ``w_gate_up [E, 2I, Hd]`` (gate rows first), ``w_down [E, Hd, I]``, both contiguous and in
    ``hidden``'s dtype; ``topk_weights [N, k]`` float32; ``topk_ids [N, k]`` int32/int64 in
    ``[0, E)``. Runs on CUDA (ROCm) and on CPU under ``TRITON_INTERPRET=1``. With ``scales`` the
    weights are FP8 (see the module docstring). ``layout``: the pairs already aligned for these
    ``topk_ids`` (``moe_routing.route_experts``); without it the pairs are aligned here.
    """
    n, hd, e, inter, k = _check_inputs(hidden, w_gate_up, w_down, topk_weights, topk_ids, scales)
    check_contiguous_last_dim("hidden", hidden)
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if not w.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    dtype, device = hidden.dtype, hidden.device
    if n == 0:
        return torch.empty(0, hd, dtype=dtype, device=device)
    p = n * k
    block_m = pair_block_m(p, e)
    if layout is None:
        sorted_pairs, block_expert = align_pairs_by_expert(topk_ids, e, block_m)
    elif layout.block_m != block_m:
        raise ValueError(f"layout has {layout.block_m}-row blocks; {p} pairs over {e} experts need {block_m}")
    else:
        sorted_pairs, block_expert = layout.sorted_pairs, layout.block_expert
    num_blocks = block_expert.shape[0]
    act = torch.empty(p, inter, dtype=dtype, device=device)
    pair_out = torch.empty(p, hd, dtype=dtype, device=device)
    weights = topk_weights.reshape(-1).contiguous()
    precision = dot_precision(dtype)
    block_k = 64
    # A K tile must not straddle a scale block: blocks a multiple of the tile wide, or spanning K.
    if scales is not None and scales.block[1] % block_k and scales.block[1] < max(hd, inter):
        raise ValueError(f"FP8 expert scale blocks must be a multiple of {block_k} wide, got {scales.block}")
    fp8 = _scale_args(scales, w_gate_up, w_down)
    busy = min(e, p)  # row blocks with work, at least (one per expert that has tokens)
    block_n = _block_n(busy, inter, device)
    _moe_gate_up_kernel.on(device)[(num_blocks, cdiv(inter, block_n))](
        hidden, w_gate_up, fp8["gate_up"], act, sorted_pairs, block_expert, p, hd, inter, k,
        hidden.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), *fp8["gate_up_strides"], act.stride(0),
        **fp8["consts"], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision, num_warps=4, num_stages=3,
    )
    block_n = _block_n(busy, hd, device)
    _moe_down_kernel.on(device)[(num_blocks, cdiv(hd, block_n))](
        act, w_down, fp8["down"], pair_out, weights, sorted_pairs, block_expert, p, hd, inter,
        act.stride(0), w_down.stride(0), w_down.stride(1), *fp8["down_strides"], pair_out.stride(0),
        **fp8["consts"], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision, num_warps=4, num_stages=3,
    )
    if k == 1:
        return pair_out
    return pair_out.view(n, k, hd).sum(dim=1, dtype=torch.float32).to(dtype)
