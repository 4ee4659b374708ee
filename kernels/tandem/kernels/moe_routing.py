"""MoE routing in one launch: router softmax, top-k, renormalisation, and the expert-sorted pair
layout that ``fused_moe``'s expert GEMMs read.

``route_experts(router_logits [N, E], top_k, renormalize, weight_dtype)`` returns
``(topk_weights [N, k] float32, topk_ids [N, k] int32, layout)`` with the arithmetic of
``select_experts`` followed by the MoE block's rounding of the weights to ``weight_dtype``
(transformers scales the experts' outputs by weights in the model dtype), and ``layout`` the
:class:`PairLayout` that ``align_pairs_by_expert`` builds, entry for entry.

Why one kernel: in a decode step the same work done by PyTorch ops is about 40 launches per MoE
layer (softmax, topk, a division, two casts, then a scatter, cumsums, a stable sort, index ops
and a searchsorted to order a handful of (token, slot) pairs), each a microsecond or two of GPU
time plus a gap. Here:

1. Routing, per token row (``BLOCK_T`` rows a step): float32 softmax over the ``E`` logits
   (``exp(x - max) / sum``), then ``k`` rounds of "largest probability, lowest expert index among
   equals" (the descending order ``torch.topk`` returns), the chosen weights divided by their sum
   when ``renormalize``, rounded to ``weight_dtype`` and back.
2. Layout, when ``N·k`` is at most ``ALIGN_MAX_PAIRS`` (decode steps): a single program that,
   after every token is routed, counts the pairs per expert (a histogram), pads each
   expert's run to ``block_m`` rows, writes ``block_expert`` (the expert of each row block, -1
   past the last run) and places each pair at its expert's next free row in pair order (a stable
   sort, as ``align_pairs_by_expert``'s ``argsort(stable=True)``). Its state (the next free row of
   each expert) lives in a small scratch buffer that the program's threads share through global
   memory between barriers. No host sync, static shapes: a CUDA graph captures it. When every
   token fits one routing tile (``N·E`` up to ``_TILE_ELEMENTS``: batch 1 to 32 at 128 experts,
   1 to 8 at 512) that program also routes them: one launch in all. A larger decode batch routes
   with one program per tile first and lays out in a second launch (one program routing 256
   tokens over 512 experts took 400 µs on an H200, against 132 µs for the PyTorch ops).
   Larger batches still (prefill) route with one program per tile and leave the layout to
   ``align_pairs_by_expert``, whose sort is then cheap next to the expert GEMMs.

``reference`` is the PyTorch twin (``select_experts``, the rounding, ``align_pairs_by_expert``).
"""

from __future__ import annotations

import torch

from tandem.kernels._utils import (
    FLOAT_DTYPES,
    cast,
    cdiv,
    check_dtype,
    next_power_of_2,
    tl,
    triton_kernel,
)
from tandem.kernels.fused_moe import PairLayout, align_pairs_by_expert, pair_block_m, select_experts

__all__ = ["ALIGN_MAX_PAIRS", "reference", "route_experts"]

# Up to this many (token, slot) pairs the single-program launch also builds the layout: a batch
# of 256 decode tokens at top-10 is 2,560 pairs. Past it one program would be the step's bottleneck.
ALIGN_MAX_PAIRS = 4096
_TILE_ELEMENTS = 4096  # logits a routing step holds in registers: BLOCK_T rows of BLOCK_E


def _check(router_logits: torch.Tensor, top_k: int) -> tuple[int, int]:
    check_dtype("router_logits", router_logits, FLOAT_DTYPES)
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [N, E], got {list(router_logits.shape)}")
    n, e = router_logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={e}]")
    if router_logits.stride(1) != 1:
        raise ValueError("router_logits must be contiguous in its last dim")
    return n, e


def reference(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, weight_dtype: torch.dtype, build_layout: bool = True
) -> tuple[torch.Tensor, torch.Tensor, PairLayout | None]:
    """PyTorch twin of :func:`route_experts` (same outputs; the layout when ``build_layout`` and
    the batch is small enough for the kernel to build it)."""
    n, e = _check(router_logits, top_k)
    weights, ids = select_experts(router_logits, top_k, renormalize)
    weights = weights.to(weight_dtype).float()
    layout = None
    if build_layout and 0 < n * top_k <= ALIGN_MAX_PAIRS:
        block_m = pair_block_m(n * top_k, e)
        sorted_pairs, block_expert = align_pairs_by_expert(ids, e, block_m)
        layout = PairLayout(sorted_pairs, block_expert, block_m)
    return weights, ids, layout


@triton_kernel(do_not_specialize=("n_tokens", "num_blocks"))
def _route_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    pairs_ptr,
    block_expert_ptr,
    cursor_ptr,
    n_tokens,
    num_experts,
    num_blocks,
    stride_l,
    TOP_K: tl.constexpr,
    RENORM: tl.constexpr,
    WEIGHT_DTYPE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROUTE: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    experts = tl.arange(0, BLOCK_E)
    expert_ok = experts < num_experts
    slots = tl.arange(0, BLOCK_K)
    # ---- 1. routing: rows pid*BLOCK_T, then every num_programs*BLOCK_T further
    for t0 in range(tl.program_id(0) * BLOCK_T, n_tokens if ROUTE else 0, tl.num_programs(0) * BLOCK_T):
        rows = t0 + tl.arange(0, BLOCK_T)
        row_ok = rows < n_tokens
        x = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_l + experts[None, :],
                    mask=row_ok[:, None] & expert_ok[None, :], other=0.0).to(tl.float32)
        x = tl.where(expert_ok[None, :], x, float("-inf"))
        p = tl.exp(x - tl.max(x, 1)[:, None])
        probs = p / tl.sum(p, 1)[:, None]
        chosen_w = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
        chosen_e = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
        for j in tl.static_range(TOP_K):
            best = tl.max(probs, 1)
            # The lowest expert index among equal probabilities (torch.topk's order).
            idx = tl.min(tl.where(probs == best[:, None], experts[None, :], BLOCK_E), 1)
            chosen_w = tl.where(slots[None, :] == j, best[:, None], chosen_w)
            chosen_e = tl.where(slots[None, :] == j, idx[:, None], chosen_e)
            probs = tl.where(experts[None, :] == idx[:, None], -1.0, probs)  # probabilities are >= 0
        if RENORM:
            chosen_w = chosen_w / tl.sum(chosen_w, 1)[:, None]
        chosen_w = cast(chosen_w, WEIGHT_DTYPE).to(tl.float32)
        out = rows.to(tl.int64)[:, None] * TOP_K + slots[None, :]
        out_ok = row_ok[:, None] & (slots < TOP_K)[None, :]
        tl.store(weights_ptr + out, chosen_w, mask=out_ok)
        tl.store(ids_ptr + out, chosen_e, mask=out_ok)
    if ALIGN:  # a single program: every token's ids were stored above, or by the previous launch
        num_pairs = n_tokens * TOP_K
        tl.debug_barrier()
        # ---- 2. pairs per expert, each run padded to BLOCK_M rows
        counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
        for p0 in range(0, num_pairs, BLOCK_P):
            pairs = p0 + tl.arange(0, BLOCK_P)
            pair_ok = pairs < num_pairs
            e = tl.load(ids_ptr + pairs, mask=pair_ok, other=0)
            counts += tl.histogram(e, BLOCK_E, mask=pair_ok)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        padded_end = tl.cumsum(padded, 0)
        padded_start = padded_end - padded
        used = tl.sum(padded, 0)
        # ---- 3. the expert of each row block (searchsorted(padded_end, start, right)), -1 past the runs
        for b0 in range(0, num_blocks, BLOCK_B):
            blocks = b0 + tl.arange(0, BLOCK_B)
            start = blocks * BLOCK_M
            owner = tl.sum((padded_end[None, :] <= start[:, None]).to(tl.int32), 1)
            owner = tl.where(start < used, owner, -1)
            tl.store(block_expert_ptr + blocks, owner, mask=blocks < num_blocks)
        # ---- 4. every row padding (num_pairs), then each pair at its expert's next free row
        for r0 in range(0, num_blocks * BLOCK_M, BLOCK_B * BLOCK_M):
            r = r0 + tl.arange(0, BLOCK_B * BLOCK_M)
            tl.store(pairs_ptr + r, tl.zeros_like(r) + num_pairs, mask=r < num_blocks * BLOCK_M)
        cursor = padded_start
        tl.store(cursor_ptr + experts, cursor)
        lane = tl.arange(0, BLOCK_P)
        for p0 in range(0, num_pairs, BLOCK_P):
            tl.debug_barrier()  # the padding and the cursor stores are visible to every thread
            pairs = p0 + lane
            pair_ok = pairs < num_pairs
            e = tl.load(ids_ptr + pairs, mask=pair_ok, other=BLOCK_E)
            # Earlier pairs of this chunk with the same expert come first (a stable order).
            rank = tl.sum(((e[:, None] == e[None, :]) & (lane[None, :] < lane[:, None])).to(tl.int32), 1)
            row = tl.load(cursor_ptr + e, mask=pair_ok, other=0) + rank
            tl.store(pairs_ptr + row, pairs, mask=pair_ok)
            cursor += tl.histogram(e, BLOCK_E, mask=pair_ok)
            tl.debug_barrier()  # every thread read the cursor before it moves on
            tl.store(cursor_ptr + experts, cursor)


def route_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, weight_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, PairLayout | None]:
    """``[N, E]`` router logits -> ``(topk_weights [N, k] float32, topk_ids [N, k] int32, layout)``.

    ``router_logits`` may be a strided view (the router's rows of a merged projection) with a
    contiguous last dim. ``layout`` is the expert-sorted pair layout for ``fused_moe`` when
    ``N·k <= ALIGN_MAX_PAIRS`` (built in the same launch), else None (``fused_moe`` builds it).
    """
    n, e = _check(router_logits, top_k)
    device = router_logits.device
    weights = torch.empty(n, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(n, top_k, dtype=torch.int32, device=device)
    if n == 0:
        return weights, ids, None
    launcher = _route_kernel.on(device)  # binds triton.language (interpreter mode decided)
    import triton.language as language

    weight_tl = {torch.float32: language.float32, torch.float16: language.float16,
                 torch.bfloat16: language.bfloat16}[weight_dtype]
    p = n * top_k
    align = p <= ALIGN_MAX_PAIRS
    block_e = next_power_of_2(e)
    block_t = max(1, min(_TILE_ELEMENTS // block_e, next_power_of_2(n)))
    block_m = pair_block_m(p, e)
    if align:
        rows = cdiv(p + min(e, p) * (block_m - 1), block_m) * block_m  # align_pairs_by_expert's length
        sorted_pairs = torch.empty(rows, dtype=torch.int32, device=device)
        block_expert = torch.empty(rows // block_m, dtype=torch.int32, device=device)
        cursor = torch.empty(block_e, dtype=torch.int32, device=device)
    else:
        sorted_pairs = block_expert = cursor = ids  # placeholders, never touched
    one_launch = align and n <= block_t

    def launch(grid: tuple[int], route: bool, lay_out: bool) -> None:
        launcher[grid](
            router_logits, weights, ids, sorted_pairs, block_expert, cursor, n, e,
            block_expert.shape[0] if lay_out else 0, router_logits.stride(0),
            TOP_K=top_k, RENORM=renormalize, WEIGHT_DTYPE=weight_tl, BLOCK_T=block_t, BLOCK_E=block_e,
            BLOCK_K=next_power_of_2(top_k), ROUTE=route, ALIGN=lay_out, BLOCK_M=block_m, BLOCK_P=32, BLOCK_B=64,
            num_warps=8 if block_e >= 512 else 4,
        )

    if one_launch:
        launch((1,), True, True)
    else:
        launch((cdiv(n, block_t),), True, False)
        if align:
            launch((1,), False, True)
    return weights, ids, PairLayout(sorted_pairs, block_expert, block_m) if align else None
