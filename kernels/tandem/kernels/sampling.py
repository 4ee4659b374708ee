"""Top-k / top-p / min-p filtering of logits without sorting the vocabulary.

Semantics (applied in the order top-k → top-p → min-p; each row has its own parameters):

* top-k (``0 < k < V``; otherwise off): keep tokens whose logit is ≥ the k-th largest logit
  (ties with it are kept, so more than k tokens can survive).
* top-p (``p < 1``; otherwise off): over the distribution left by top-k, keep the smallest set of
  most likely tokens whose probability reaches ``p``: token i stays iff the mass of tokens strictly
  more likely than i is < p (ties at the boundary all stay).
* min-p (``min_p > 0``; otherwise off): keep tokens with ``exp(logit − max_logit) ≥ min_p``, i.e.
  probability ≥ ``min_p`` × the top probability (renormalisation does not change that ratio).

Every rule keeps the tokens at or above a threshold logit, so the kernel only has to find two
thresholds per row and never sorts. It searches them over the order-preserving integer image
of the float32 logits ("key": the bit pattern, magnitude bits flipped for negatives), for the
largest key ``t`` with ``count(key ≥ t) ≥ k`` and then ``mass(key ≥ t) ≥ p · Z_k``. Each pass
over the row tests ``NUM_PIVOTS`` evenly spaced keys of the current interval at once and keeps
the sub-interval holding the answer; the search stops as soon as a single logit is left inside
(usually after 3–6 passes, not the 11 a 32-bit range would need). The top-p search starts at
``max + log((1 − p)/V) − 1``, below which tokens cannot matter. The result is exact: the same
kept set as sorting, ties included.

Bytes moved per row of V float32 logits: ``(3 + passes_k + passes_p) · 4V`` read (range pass,
the two searches, the Z_k pass, the output pass; the row mostly stays in L2 between passes) and
``4V`` written. Per-lane accumulators keep each pass at one reduction instead of one per chunk.
Rows run one program each, so the batch supplies the parallelism. Measured on an H200 with
V = 151936 and a mix of filters per row: batch 256 in 1.1 ms against 4.6 ms for the sort-based
reference, batch 32 0.67 ms against 0.90 ms; at batch 1 a single program's passes are
latency-bound (0.23 ms against 0.19 ms for ``torch.sort`` spread over the whole GPU).
"""

from __future__ import annotations

import torch

from tandem.kernels._utils import (
    check_contiguous_last_dim,
    check_dtype,
    check_same_device,
    check_shape,
    tl,
    triton_kernel,
)

__all__ = ["apply_top_k_top_p_min_p", "apply_top_k_top_p_min_p_reference"]

_BLOCK = 2048
_NUM_PIVOTS = 8
_NUM_WARPS = 16


@triton_kernel
def _top_k_top_p_min_p_kernel(
    logits_ptr,
    out_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    vocab,
    stride_l,
    stride_o,
    BLOCK: tl.constexpr,
    NUM_PIVOTS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    src = logits_ptr + row * stride_l
    dst = out_ptr + row * stride_o
    top_k = tl.load(top_k_ptr + row).to(tl.int32)
    top_p = tl.load(top_p_ptr + row).to(tl.float32)
    min_p = tl.maximum(tl.load(min_p_ptr + row).to(tl.float32), 0.0)  # 0: every ratio passes
    offs = tl.arange(0, BLOCK)
    int_min: tl.constexpr = -2147483648
    int_max: tl.constexpr = 2147483647
    # Accumulators stay per lane ([BLOCK] or [BLOCK, NUM_PIVOTS]) inside the chunk loops and are
    # reduced once per pass: a cross-warp reduction per chunk would dominate the pass.

    # Pass 1: the key range of the row (its max key is also the max logit).
    lane_lo = tl.full([BLOCK], int_max, tl.int32)
    lane_hi = tl.full([BLOCK], int_min, tl.int32)
    for start in range(0, vocab, BLOCK):
        cols = start + offs
        valid = cols < vocab
        bits = tl.load(src + cols, mask=valid, other=0.0).to(tl.int32, bitcast=True)
        key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        lane_lo = tl.minimum(lane_lo, tl.where(valid, key, int_max))
        lane_hi = tl.maximum(lane_hi, tl.where(valid, key, int_min))
    key_lo = tl.min(lane_lo, 0)
    key_hi = tl.max(lane_hi, 0)
    m = (key_hi ^ ((key_hi >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    m_safe = tl.where(m == float("-inf"), 0.0, m)

    pivot_idx = tl.arange(0, NUM_PIVOTS).to(tl.int64) + 1

    # Top-k threshold: the largest key t with count(key >= t) >= k. Besides [lo, hi] the search
    # tracks how many elements lie in it (count(>= lo) - count(> hi)) and stops once one is left.
    thr = key_lo
    if (top_k > 0) & (top_k < vocab):
        lo = key_lo
        hi = key_hi
        if top_k <= BLOCK:
            # The lane maxima are distinct elements, so the k-th largest of them is a lower bound
            # for the answer; finding it touches registers only and skips the passes that would
            # otherwise narrow the full 32-bit range (count(>= lo) is then only bounded by V).
            while lo < hi:
                span = hi.to(tl.int64) - lo.to(tl.int64)
                pivots = (lo.to(tl.int64) + (span * pivot_idx) // NUM_PIVOTS).to(tl.int32)
                counts = tl.sum((lane_hi[:, None] >= pivots[None, :]).to(tl.int32), 0)
                ok = counts >= top_k
                lo = tl.max(tl.where(ok, pivots, lo), 0)
                hi = tl.min(tl.where(ok, hi, pivots - 1), 0)
            hi = key_hi
        count_lo = vocab
        count_above_hi = 0
        while (lo < hi) & (count_lo - count_above_hi > 1):
            span = hi.to(tl.int64) - lo.to(tl.int64)
            pivots = (lo.to(tl.int64) + (span * pivot_idx) // NUM_PIVOTS).to(tl.int32)
            lane_counts = tl.zeros([BLOCK, NUM_PIVOTS], tl.int32)
            for start in range(0, vocab, BLOCK):
                cols = start + offs
                valid = cols < vocab
                bits = tl.load(src + cols, mask=valid, other=0.0).to(tl.int32, bitcast=True)
                key = tl.where(valid, bits ^ ((bits >> 31) & 0x7FFFFFFF), int_min)
                lane_counts += (key[:, None] >= pivots[None, :]).to(tl.int32)
            counts = tl.sum(lane_counts, 0)
            ok = counts >= top_k
            lo = tl.max(tl.where(ok, pivots, lo), 0)
            count_lo = tl.min(tl.where(ok, counts, count_lo), 0)
            hi = tl.min(tl.where(ok, hi, pivots - 1), 0)
            count_above_hi = tl.max(tl.where(ok, count_above_hi, counts), 0)
        thr = lo

    # Top-p threshold over the top-k survivors: the largest key t >= thr with
    # mass(key >= t) >= p * Z_k, masses in units of exp(x - max).
    if top_p < 1.0:
        # Tokens below c = max + log((1 - p) / V) - 1 together weigh < (1 - p) / e <= (1 - p) Z_k
        # (Z_k >= 1: the max token weighs 1), so the threshold is >= c: start the search there.
        c = m_safe + tl.log(tl.maximum(1.0 - top_p, 1e-30) / vocab) - 1.0
        c_bits = c.to(tl.int32, bitcast=True)
        lo = tl.maximum(thr, c_bits ^ ((c_bits >> 31) & 0x7FFFFFFF))
        hi = key_hi
        lane_z = tl.zeros([BLOCK], tl.float32)
        lane_n = tl.zeros([BLOCK], tl.int32)
        for start in range(0, vocab, BLOCK):
            cols = start + offs
            x = tl.load(src + cols, mask=cols < vocab, other=float("-inf"))
            bits = x.to(tl.int32, bitcast=True)
            key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
            lane_z += tl.where(key >= thr, tl.exp(x - m_safe), 0.0)
            lane_n += (key >= lo).to(tl.int32)
        target = top_p * tl.sum(lane_z, 0)
        count_lo = tl.sum(lane_n, 0)
        count_above_hi = 0
        while (lo < hi) & (count_lo - count_above_hi > 1):
            span = hi.to(tl.int64) - lo.to(tl.int64)
            pivots = (lo.to(tl.int64) + (span * pivot_idx) // NUM_PIVOTS).to(tl.int32)
            lane_mass = tl.zeros([BLOCK, NUM_PIVOTS], tl.float32)
            lane_counts = tl.zeros([BLOCK, NUM_PIVOTS], tl.int32)
            for start in range(0, vocab, BLOCK):
                cols = start + offs
                x = tl.load(src + cols, mask=cols < vocab, other=float("-inf"))
                bits = x.to(tl.int32, bitcast=True)
                key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
                above = key[:, None] >= pivots[None, :]
                lane_mass += tl.where(above, tl.exp(x - m_safe)[:, None], 0.0)
                lane_counts += above.to(tl.int32)
            counts = tl.sum(lane_counts, 0)
            ok = tl.sum(lane_mass, 0) >= target
            lo = tl.max(tl.where(ok, pivots, lo), 0)
            count_lo = tl.min(tl.where(ok, counts, count_lo), 0)
            hi = tl.min(tl.where(ok, hi, pivots - 1), 0)
            count_above_hi = tl.max(tl.where(ok, count_above_hi, counts), 0)
        thr = lo

    # Output pass: keep key >= thr and (min-p) exp(x - max) >= min_p.
    for start in range(0, vocab, BLOCK):
        cols = start + offs
        valid = cols < vocab
        x = tl.load(src + cols, mask=valid, other=float("-inf"))
        bits = x.to(tl.int32, bitcast=True)
        key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        keep = (key >= thr) & (tl.exp(x - m_safe) >= min_p)
        tl.store(dst + cols, tl.where(keep, x, float("-inf")), mask=valid)


def _per_row(
    name: str,
    value: torch.Tensor | None,
    rows: int,
    dtype: torch.dtype,
    neutral: float,
    device: torch.device,
) -> torch.Tensor:
    if value is None:
        return torch.full((rows,), neutral, dtype=dtype, device=device)
    check_shape(name, value, (rows,))
    return value.to(device=device, dtype=dtype)


def apply_top_k_top_p_min_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Return ``logits [B, V]`` (float32) with filtered tokens set to ``-inf``.

    ``top_k [B]`` (int; ``<= 0`` or ``>= V`` = off), ``top_p [B]`` (float in ``(0, 1]``; 1 = off),
    ``min_p [B]`` (float; 0 = off); None turns a filter off for every row. ``out`` may be
    ``logits`` itself (in place). No device→host synchronisation.
    """
    check_dtype("logits", logits, (torch.float32,))
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got {list(logits.shape)}")
    check_contiguous_last_dim("logits", logits)
    rows, vocab = logits.shape
    device = logits.device
    top_k = _per_row("top_k", top_k, rows, torch.int32, 0, device)
    top_p = _per_row("top_p", top_p, rows, torch.float32, 1.0, device)
    min_p = _per_row("min_p", min_p, rows, torch.float32, 0.0, device)
    check_same_device(logits=logits, top_k=top_k, top_p=top_p, min_p=min_p)
    if out is None:
        out = torch.empty_like(logits)
    else:
        check_shape("out", out, (rows, vocab))
        check_dtype("out", out, (torch.float32,))
        check_contiguous_last_dim("out", out)
    if rows == 0 or vocab == 0:
        return out
    _top_k_top_p_min_p_kernel.on(device)[(rows,)](
        logits,
        out,
        top_k,
        top_p,
        min_p,
        vocab,
        logits.stride(0),
        out.stride(0),
        BLOCK=_BLOCK,
        NUM_PIVOTS=_NUM_PIVOTS,
        num_warps=_NUM_WARPS,
    )
    return out


def apply_top_k_top_p_min_p_reference(
    logits: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sort-based PyTorch twin of :func:`apply_top_k_top_p_min_p`."""
    x = logits.float()
    rows, vocab = x.shape
    device = x.device
    top_k = _per_row("top_k", top_k, rows, torch.int64, 0, device)
    top_p = _per_row("top_p", top_p, rows, torch.float32, 1.0, device)
    min_p = _per_row("min_p", min_p, rows, torch.float32, 0.0, device)
    ninf = torch.full((rows,), float("-inf"), device=device)

    sorted_x = x.sort(dim=-1, descending=True).values
    kth = sorted_x.gather(1, (top_k.clamp(1, vocab) - 1)[:, None])[:, 0]
    thr_k = torch.where((top_k > 0) & (top_k < vocab), kth, ninf)

    survivors = sorted_x.masked_fill(sorted_x < thr_k[:, None], float("-inf"))
    probs = torch.softmax(survivors, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    last_kept = ((mass_before < top_p[:, None]).sum(dim=-1) - 1).clamp(min=0)
    thr_p = sorted_x.gather(1, last_kept[:, None])[:, 0]
    thr = torch.maximum(thr_k, torch.where(top_p < 1.0, thr_p, ninf))

    keep = x >= thr[:, None]
    ratio = torch.exp(x - x.max(dim=-1, keepdim=True).values)
    keep &= ratio >= min_p.clamp(min=0.0)[:, None]
    return x.masked_fill(~keep, float("-inf"))
