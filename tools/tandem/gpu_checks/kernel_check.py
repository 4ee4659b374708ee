"""Check every Triton kernel against its PyTorch reference on a GPU at real shapes, then time it.

Usage: ``python -m tandem.gpu_checks.kernel_check --out DIR [--quick] [--only SUBSTRING]``.

Shapes are Qwen3-8B's (32 query heads, 8 KV heads, head_dim 128, hidden 4096, intermediate 12288,
vocab 151936; block size 16; bfloat16), plus SmolLM2's grouped-query shape (9 heads over 3 KV
heads, head_dim 64) for the non-power-of-two group, and Qwen3-Next's Gated DeltaNet layer (16 q/k
heads, 32 value heads, K = V = 128, conv width 4 over 8192 channels) for the ``gdn_*`` kernels
(``--only gdn``; the recurrent decode update's GB/s counts its float32 state read + written), and
Qwen3-30B-A3B's MoE layer (128 experts, 8 per token, hidden 2048, expert intermediate 768) for
``fused_moe``, whose GB/s counts the weights of the experts the batch's routing actually selected
(plus activations). For every case the script

* pre-fills outputs with NaN (so an element the kernel never wrote shows up), runs the kernel and
  its reference, and requires no NaN and a relative error ``max|out − ref| / max|ref|`` ≤ 1e-2;
* times the kernel with CUDA events: several calls captured in one CUDA graph (which also proves
  the launch is capturable), replayed many times after warm-up, median per call; eager launches
  are the fallback when capture fails;
* reports achieved bandwidth from the bytes the kernel must move (and TFLOP/s for prefill).

One failing case never stops the others: its error and traceback go into the JSON. Outputs:
``DIR/gpu_check.json`` and ``DIR/gpu_check.md`` (the table, also printed).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tandem.kernels import (
    activation,
    causal_conv1d,
    fp8_gemm,
    fused_moe,
    gated_delta_rule,
    gated_norm,
    gdn_gates,
    moe_routing,
    kv_store,
    norm,
    paged_attention,
    rotary,
    sampling,
)

TOLERANCE = 1e-2
QWEN3 = {"heads": 32, "kv_heads": 8, "head_dim": 128, "hidden": 4096, "inter": 12288,
         "vocab": 151936}
# Qwen3-30B-A3B's MoE layer: 128 experts of intermediate 768 over hidden 2048, 8 per token.
QWEN3_MOE = {"experts": 128, "top_k": 8, "hidden": 2048, "inter": 768}
# Qwen3-Next's Gated DeltaNet layer: 16 q/k heads, 32 value heads, head dims 128, conv width 4;
# the conv runs over q, k and v together (2·H·K + HV·V channels).
GDN = {"heads": 16, "vheads": 32, "kdim": 128, "vdim": 128, "conv_width": 4}
GDN_CONV_DIM = 2 * GDN["heads"] * GDN["kdim"] + GDN["vheads"] * GDN["vdim"]
GDN_PREFILL_LENGTHS = ([4096], [1024] * 4, [3000, 1, 700, 395])  # 4k-token prefill steps
GDN_DECODE_BATCHES = (1, 64, 256)
BLOCK_SIZE = 16
DTYPE = torch.bfloat16


@dataclass
class Case:
    """One kernel invocation to check and time."""

    kernel: str
    name: str
    params: dict[str, Any]
    # Runs the kernel once; must write into buffers prepared by `prepare` (pre-filled with NaN).
    run: Callable[[], None]
    # Returns [(label, kernel_output, reference_output)] after `prepare` + `run`.
    compare: Callable[[], list[tuple[str, torch.Tensor, torch.Tensor]]]
    prepare: Callable[[], None] = lambda: None
    bytes_moved: int = 0
    flops: int = 0
    extra_timings: dict[str, Callable[[], None]] = field(default_factory=dict)
    # Elementwise agreement check instead of the relative error (sampling masks).
    exact_fraction: bool = False


# --------------------------------------------------------------------------- helpers


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    finite = torch.isfinite(ref)
    denom = ref[finite].abs().max().item() if finite.any() else 0.0
    diff = (out[finite] - ref[finite]).abs().max().item() if finite.any() else 0.0
    return diff / denom if denom > 0 else diff


def _paged_cache(
    seq_lens: list[int], kv_heads: int, head_dim: int, device: torch.device, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random cache holding every sequence, blocks scattered by a random permutation."""
    blocks_per_seq = [math.ceil(n / BLOCK_SIZE) for n in seq_lens]
    max_blocks = max(blocks_per_seq)
    num_blocks = sum(blocks_per_seq) + 1
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, kv_heads, head_dim, device=device,
                        dtype=DTYPE, generator=gen)
    perm = torch.randperm(num_blocks, device=device, generator=gen).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32, device=device)
    used = 0
    for b, n in enumerate(blocks_per_seq):
        tables[b, :n] = perm[used : used + n]
        used += n
    return cache, tables


def _nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


# --------------------------------------------------------------------------- cases


def _decode_cases(quick: bool, device: torch.device, gen: torch.Generator) -> Iterator[Case]:
    batches = (1, 16, 64, 256) if quick else (1, 4, 16, 32, 64, 128, 256)
    for ctx in (1024, 8192):
        for batch in batches:
            yield _decode_case(device, gen, "qwen3", 32, 8, 128, [ctx] * batch, None)
    yield _decode_case(device, gen, "qwen3", 32, 8, 128, [8192], 1)  # split-KV off, for contrast
    yield _decode_case(device, gen, "qwen3", 32, 8, 128, [8192] * 16, 1)
    ragged = torch.randint(1, 8193, (32,), generator=gen, device=device).tolist()
    yield _decode_case(device, gen, "qwen3-ragged", 32, 8, 128, ragged, None)
    yield _decode_case(device, gen, "smollm2", 9, 3, 64, [1000, 37, 2049, 16] * 2, None)
    # Sliding window of 1k at 8k context: only the window's K/V count as bytes moved, so the
    # bandwidth column shows whether the kernel skips the blocks before the window.
    for batch in (1, 64) if quick else (1, 16, 64, 256):
        yield _decode_case(device, gen, "qwen3-sw1k", 32, 8, 128, [8192] * batch, None, window=1024)


def _decode_case(
    device: torch.device,
    gen: torch.Generator,
    model: str,
    heads: int,
    kv_heads: int,
    head_dim: int,
    seq_lens_list: list[int],
    num_splits: int | None,
    window: int | None = None,
) -> Case:
    batch = len(seq_lens_list)
    cache, tables = _paged_cache(seq_lens_list, kv_heads, head_dim, device, gen)
    seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32, device=device)
    q = torch.randn(batch, heads, head_dim, device=device, dtype=DTYPE, generator=gen)
    out = _nan_like(q)
    scale = head_dim**-0.5
    splits = num_splits
    if splits is None:
        max_context = tables.shape[1] * BLOCK_SIZE
        splits = paged_attention.choose_num_splits(
            batch, kv_heads, min(max_context, window or max_context),
            torch.cuda.get_device_properties(device).multi_processor_count,
        )

    def run() -> None:
        paged_attention.paged_decode_attention(q, cache, tables, seq_lens, scale, num_splits, out=out,
                                               sliding_window=window)

    def compare() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        ref = paged_attention.paged_decode_attention_reference(q, cache, tables, seq_lens, scale,
                                                               sliding_window=window)
        return [("out", out, ref)]

    elt = cache.element_size()
    total = sum(min(n, window or n) for n in seq_lens_list)  # keys the query actually sees
    return Case(
        kernel="paged_decode_attention",
        name=f"{model} B={batch} ctx={'ragged' if 'ragged' in model else max(seq_lens_list)}"
             + (f" window={window}" if window else ""),
        params={"batch": batch, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
                "total_context": total, "num_splits": splits, "sliding_window": window},
        run=run,
        compare=compare,
        prepare=lambda: out.fill_(float("nan")),
        bytes_moved=total * kv_heads * head_dim * 2 * elt + 2 * q.numel() * elt,
        flops=4 * total * heads * head_dim,
    )


def _prefill_cases(quick: bool, device: torch.device, gen: torch.Generator) -> Iterator[Case]:
    # (query lengths, context lengths): fresh prompts, long prompt, chunks after a cached prefix,
    # and a ragged mixed batch.
    yield _prefill_case(device, gen, "qwen3 fresh", [1024], [1024])
    yield _prefill_case(device, gen, "qwen3 fresh", [1024] * 4, [1024] * 4)
    if not quick:
        yield _prefill_case(device, gen, "qwen3 fresh", [8192], [8192])
    yield _prefill_case(device, gen, "qwen3 chunk-after-prefix", [512] * 4, [8192] * 4)
    q_lens = [1, 300, 17, 2048, 64, 1]
    ctxs = [4000, 300, 1000, 2048, 8192, 1]
    yield _prefill_case(device, gen, "qwen3 ragged", q_lens, ctxs)
    yield _prefill_case(device, gen, "qwen3-sw1k chunk-after-prefix", [512] * 4, [8192] * 4, window=1024)


def _prefill_case(
    device: torch.device, gen: torch.Generator, label: str, q_lens: list[int], ctxs: list[int],
    window: int | None = None,
) -> Case:
    heads, kv_heads, head_dim = QWEN3["heads"], QWEN3["kv_heads"], QWEN3["head_dim"]
    cache, tables = _paged_cache(ctxs, kv_heads, head_dim, device, gen)
    tokens = sum(q_lens)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    qsl = torch.tensor(starts, dtype=torch.int32, device=device)
    seq_lens = torch.tensor(ctxs, dtype=torch.int32, device=device)
    q = torch.randn(tokens, heads, head_dim, device=device, dtype=DTYPE, generator=gen)
    out = _nan_like(q)
    scale = head_dim**-0.5
    max_q = max(q_lens)

    def run() -> None:
        paged_attention.paged_prefill_attention(q, cache, qsl, seq_lens, tables, scale, max_q,
                                                out=out, sliding_window=window)

    def compare() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        ref = paged_attention.paged_prefill_attention_reference(q, cache, qsl, seq_lens, tables,
                                                                scale, sliding_window=window)
        return [("out", out, ref)]

    # Causal work: row i of a chunk sees (ctx - q_len + i + 1) keys (at most the window).
    if window is None:
        visible = sum(n * (c - n) + n * (n + 1) // 2 for n, c in zip(q_lens, ctxs))
    else:
        visible = sum(min(c - n + i + 1, window) for n, c in zip(q_lens, ctxs) for i in range(n))
    read = sum(c if window is None else min(c, n - 1 + window) for n, c in zip(q_lens, ctxs))
    elt = q.element_size()
    return Case(
        kernel="paged_prefill_attention",
        name=f"{label} B={len(q_lens)} q={max_q} ctx={max(ctxs)}" + (f" window={window}" if window else ""),
        params={"q_lens": q_lens, "context_lens": ctxs, "sliding_window": window},
        run=run,
        compare=compare,
        prepare=lambda: out.fill_(float("nan")),
        bytes_moved=read * kv_heads * head_dim * 2 * elt + 2 * q.numel() * elt,
        flops=4 * visible * heads * head_dim,
    )


def _norm_cases(quick: bool, device: torch.device, gen: torch.Generator) -> Iterator[Case]:
    hidden = QWEN3["hidden"]
    weight = torch.randn(hidden, device=device, dtype=DTYPE, generator=gen)
    for tokens in (1, 256, 8192) if quick else (1, 32, 256, 2048, 8192):
        x = torch.randn(tokens, hidden, device=device, dtype=DTYPE, generator=gen)
        res = torch.randn(tokens, hidden, device=device, dtype=DTYPE, generator=gen)
        out, res_out = _nan_like(x), _nan_like(x)
        elt = x.element_size()

        def run_add(x=x, res=res, out=out, res_out=res_out) -> None:
            norm.fused_add_rmsnorm(x, res, weight, 1e-6, out=out, residual_out=res_out)

        def cmp_add(x=x, res=res, out=out, res_out=res_out):
            ref, ref_res = norm.fused_add_rmsnorm_reference(x, res, weight, 1e-6)
            return [("out", out, ref), ("residual", res_out, ref_res)]

        def prep_add(out=out, res_out=res_out) -> None:
            out.fill_(float("nan"))
            res_out.fill_(float("nan"))

        yield Case("fused_add_rmsnorm", f"T={tokens} N={hidden}", {"tokens": tokens, "n": hidden},
                   run_add, cmp_add, prep_add, bytes_moved=4 * x.numel() * elt)

        def run_norm(x=x, out=out) -> None:
            norm.rmsnorm(x, weight, 1e-6, out=out)

        def cmp_norm(x=x, out=out):
            return [("out", out, norm.rmsnorm_reference(x, weight, 1e-6))]

        def run_zc(x=x, res=res, out=out, res_out=res_out) -> None:
            norm.fused_add_rmsnorm(x, res, weight, 1e-6, out=out, residual_out=res_out, zero_centered=True)

        def cmp_zc(x=x, res=res, out=out, res_out=res_out):
            ref, ref_res = norm.fused_add_rmsnorm_reference(x, res, weight, 1e-6, zero_centered=True)
            return [("out", out, ref), ("residual", res_out, ref_res)]

        yield Case("fused_add_rmsnorm_zero_centered", f"T={tokens} N={hidden}", {"tokens": tokens, "n": hidden},
                   run_zc, cmp_zc, prep_add, bytes_moved=4 * x.numel() * elt)

        yield Case("rmsnorm", f"T={tokens} N={hidden}", {"tokens": tokens, "n": hidden},
                   run_norm, cmp_norm, lambda out=out: out.fill_(float("nan")),
                   bytes_moved=2 * x.numel() * elt)

    # Qwen3 per-head q norm on the q slice of a fused qkv projection (a strided 3-D view).
    heads, kv_heads, head_dim = QWEN3["heads"], QWEN3["kv_heads"], QWEN3["head_dim"]
    head_weight = torch.randn(head_dim, device=device, dtype=DTYPE, generator=gen)
    for tokens in (1, 256, 8192):
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=device, dtype=DTYPE,
                          generator=gen)
        q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
        out = torch.full((tokens, heads, head_dim), float("nan"), device=device, dtype=DTYPE)

        def run_qk(q=q, out=out) -> None:
            norm.rmsnorm(q, head_weight, 1e-6, out=out)

        def cmp_qk(q=q, out=out):
            return [("out", out, norm.rmsnorm_reference(q, head_weight, 1e-6))]

        yield Case("rmsnorm", f"per-head q T={tokens} {heads}x{head_dim} (strided)",
                   {"tokens": tokens, "heads": heads, "n": head_dim}, run_qk, cmp_qk,
                   lambda out=out: out.fill_(float("nan")),
                   bytes_moved=2 * out.numel() * out.element_size())


def _rotary_cases(quick: bool, device: torch.device, gen: torch.Generator) -> Iterator[Case]:
    heads, kv_heads, head_dim = QWEN3["heads"], QWEN3["kv_heads"], QWEN3["head_dim"]
    max_pos = 40960
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    freqs = torch.outer(torch.arange(max_pos, device=device).float(), inv_freq)
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    qk_weights = {name: 1.0 + 0.3 * torch.randn(head_dim, device=device, dtype=DTYPE, generator=gen)
                  for name in ("q_norm_weight", "k_norm_weight")}
    for tokens in (1, 256, 8192):
        qkv0 = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=device, dtype=DTYPE,
                           generator=gen)
        qkv = qkv0.clone()
        q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
        k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
        v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
        pos = torch.randint(0, max_pos, (tokens,), device=device, generator=gen)
        elt = qkv.element_size()

        def prep(qkv=qkv, qkv0=qkv0) -> None:
            qkv.copy_(qkv0)

        def run_rope(pos=pos, q=q, k=k) -> None:
            rotary.apply_rotary(pos, q, k, cos_sin)

        def cmp_rope(pos=pos, q=q, k=k, qkv0=qkv0, tokens=tokens):
            q0 = qkv0[:, : heads * head_dim].view(tokens, heads, head_dim)
            k0 = qkv0[:, heads * head_dim : (heads + kv_heads) * head_dim].view(
                tokens, kv_heads, head_dim)
            rq, rk = rotary.apply_rotary_reference(pos, q0, k0, cos_sin)
            return [("q", q, rq), ("k", k, rk)]

        rope_bytes = 2 * (heads + kv_heads) * head_dim * tokens * elt + tokens * head_dim * 4
        yield Case("apply_rotary", f"T={tokens}", {"tokens": tokens}, run_rope, cmp_rope, prep,
                   bytes_moved=rope_bytes)

        num_blocks = math.ceil(tokens / BLOCK_SIZE) + 4
        cache = torch.full((2, num_blocks, BLOCK_SIZE, kv_heads, head_dim), float("nan"),
                           device=device, dtype=DTYPE)
        slots = torch.randperm(num_blocks * BLOCK_SIZE, device=device, generator=gen)[:tokens]

        def prep_store(qkv=qkv, qkv0=qkv0, cache=cache) -> None:
            qkv.copy_(qkv0)
            cache.fill_(float("nan"))

        # Plain RoPE + store (Llama), then with Qwen3's per-head q/k norm fused in at decode
        # batch sizes; "unfused" times what the norm cost before: two rmsnorm launches + RoPE.
        for qk_norm in (False, True) if tokens <= 256 else (False,):
            weights = qk_weights if qk_norm else {}

            def run_store(pos=pos, q=q, k=k, v=v, cache=cache, slots=slots, weights=weights) -> None:
                rotary.rope_and_store_kv(pos, q, k, v, cos_sin, cache, slots, **weights)

            def cmp_store(pos=pos, q=q, k=k, qkv0=qkv0, cache=cache, slots=slots, tokens=tokens,
                          weights=weights):
                q0 = qkv0[:, : heads * head_dim].view(tokens, heads, head_dim)
                k0 = qkv0[:, heads * head_dim : (heads + kv_heads) * head_dim].view(
                    tokens, kv_heads, head_dim)
                v0 = qkv0[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
                ref_cache = torch.full_like(cache, float("nan"))
                rq, rk = rotary.rope_and_store_kv_reference(pos, q0, k0, v0, cos_sin, ref_cache, slots,
                                                            **weights)
                flat, ref_flat = cache.flatten(1, 2), ref_cache.flatten(1, 2)
                return [("q", q, rq), ("k", k, rk), ("cache_slots", flat[:, slots], ref_flat[:, slots]),
                        ("cache_untouched_nan", torch.isnan(cache).float(),
                         torch.isnan(ref_cache).float())]

            extra = {}
            if qk_norm:
                q_normed = torch.empty(tokens, heads, head_dim, device=device, dtype=DTYPE)
                k_normed = torch.empty(tokens, kv_heads, head_dim, device=device, dtype=DTYPE)

                def run_unfused(pos=pos, q=q, k=k, v=v, cache=cache, slots=slots, qn=q_normed,
                                kn=k_normed) -> None:
                    norm.rmsnorm(q, qk_weights["q_norm_weight"], 1e-6, out=qn)
                    norm.rmsnorm(k, qk_weights["k_norm_weight"], 1e-6, out=kn)
                    rotary.rope_and_store_kv(pos, qn, kn, v, cos_sin, cache, slots)

                extra = {"unfused": run_unfused}
            name = f"{'qk-norm ' if qk_norm else ''}T={tokens}"
            params = {"tokens": tokens, **({"qk_norm": True} if qk_norm else {})}
            yield Case("rope_and_store_kv", name, params, run_store,
                       cmp_store, prep_store,
                       bytes_moved=rope_bytes + 3 * kv_heads * head_dim * tokens * elt,
                       extra_timings=extra)

        kv_cache = torch.full_like(cache, float("nan"))

        def run_kv(k=k, v=v, kv_cache=kv_cache, slots=slots) -> None:
            kv_store.store_kv(k, v, kv_cache, slots)

        def cmp_kv(k=k, v=v, kv_cache=kv_cache, slots=slots):
            ref_cache = torch.full_like(kv_cache, float("nan"))
            kv_store.store_kv_reference(k, v, ref_cache, slots)
            flat, ref_flat = kv_cache.flatten(1, 2), ref_cache.flatten(1, 2)
            return [("cache_slots", flat[:, slots], ref_flat[:, slots]),
                    ("cache_untouched_nan", torch.isnan(kv_cache).float(),
                     torch.isnan(ref_cache).float())]

        yield Case("store_kv", f"T={tokens}", {"tokens": tokens}, run_kv, cmp_kv,
                   lambda kv_cache=kv_cache: kv_cache.fill_(float("nan")),
                   bytes_moved=4 * kv_heads * head_dim * tokens * elt)


def _activation_cases(quick: bool, device: torch.device, gen: torch.Generator) -> Iterator[Case]:
    inter = QWEN3["inter"]
    for tokens in (1, 256, 8192) if quick else (1, 32, 256, 2048, 8192):
        x = torch.randn(tokens, 2 * inter, device=device, dtype=DTYPE, generator=gen)
        out = torch.full((tokens, inter), float("nan"), device=device, dtype=DTYPE)

        def run(x=x, out=out) -> None:
            activation.silu_and_mul(x, out=out)

        def cmp(x=x, out=out):
            return [("out", out, activation.silu_and_mul_reference(x))]

        yield Case("silu_and_mul", f"T={tokens} I={inter}", {"tokens": tokens, "inter": inter},
                   run, cmp, lambda out=out: out.fill_(float("nan")),
                   bytes_moved=3 * out.numel() * out.element_size())


def _moe_cases(quick: bool, device: torch.device, gen: torch.Generator) -> Iterator[Case]:
    e, k, hd, inter = (QWEN3_MOE[key] for key in ("experts", "top_k", "hidden", "inter"))
    w_gate_up = torch.randn(e, 2 * inter, hd, device=device, dtype=DTYPE, generator=gen) * hd**-0.5
    w_down = torch.randn(e, hd, inter, device=device, dtype=DTYPE, generator=gen) * inter**-0.5
    expert_bytes = 3 * hd * inter * w_down.element_size()
    for tokens in (1, 256, 4096) if quick else (1, 64, 256, 4096):
        x = torch.randn(tokens, hd, device=device, dtype=DTYPE, generator=gen)
        logits = torch.randn(tokens, e, device=device, generator=gen)
        weights, ids = fused_moe.select_experts(logits, k, renormalize=True)
        distinct = int(torch.unique(ids).numel())
        out = torch.full((tokens, hd), float("nan"), device=device, dtype=DTYPE)

        def run(x=x, weights=weights, ids=ids, out=out) -> None:
            out.copy_(fused_moe.fused_moe(x, w_gate_up, w_down, weights, ids))

        def align(ids=ids, p=tokens * k) -> None:
            fused_moe.align_pairs_by_expert(ids, e, fused_moe.pair_block_m(p, e))

        def cmp(x=x, weights=weights, ids=ids, out=out):
            return [("out", out, fused_moe.fused_moe_reference(x, w_gate_up, w_down, weights, ids))]

        activations = (2 * tokens * hd + tokens * k * (2 * inter + hd)) * x.element_size()
        yield Case("fused_moe", f"N={tokens} E={e} k={k} Hd={hd} I={inter}",
                   {"tokens": tokens, "experts": e, "top_k": k, "distinct_experts": distinct},
                   run, cmp, lambda out=out: out.fill_(float("nan")),
                   bytes_moved=distinct * expert_bytes + activations,
                   flops=2 * tokens * k * 3 * hd * inter, extra_timings={"align": align})


def _routing_cases(quick: bool, device: torch.device, gen: torch.Generator) -> Iterator[Case]:
    """`moe_routing.route_experts` (top-k and, up to ALIGN_MAX_PAIRS pairs, the pair layout in one
    launch) against its twin, timed beside the PyTorch routing it replaces (`torch_routing`).
    Slot by slot, the weights and the chosen experts' probabilities must match the twin's (so an
    expert may differ only where two experts' probabilities tie, which bfloat16 logits make
    common at the k-th place); the layout must equal `align_pairs_by_expert` of the kernel's ids."""
    for e, k in ((QWEN3_MOE["experts"], QWEN3_MOE["top_k"]), (512, 10)):
        for tokens in (1, 64, 256, 4096):
            logits = torch.randn(tokens, e, device=device, generator=gen).to(DTYPE)
            got: dict[str, Any] = {}

            def run(logits=logits, k=k, got=got) -> None:
                got["out"] = moe_routing.route_experts(logits, k, True, DTYPE)

            def cmp(logits=logits, e=e, k=k, got=got):
                weights, ids, layout = got["out"]
                ref_w, ref_ids, _ = moe_routing.reference(logits, k, True, DTYPE)
                probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
                checks = [("weights", weights, ref_w),
                          ("chosen_probs", probs.gather(1, ids.long()), probs.gather(1, ref_ids.long()))]
                if layout is not None:
                    pairs, blocks = fused_moe.align_pairs_by_expert(ids, e, layout.block_m)
                    checks += [("sorted_pairs", layout.sorted_pairs.float(), pairs.float()),
                               ("block_expert", layout.block_expert.float(), blocks.float())]
                return checks

            def torch_routing(logits=logits, e=e, k=k) -> None:
                w, ids = fused_moe.select_experts(logits, k, True)
                w.to(DTYPE).float()
                fused_moe.align_pairs_by_expert(ids, e, fused_moe.pair_block_m(ids.numel(), e))

            yield Case("route_experts", f"N={tokens} E={e} k={k}", {"tokens": tokens, "experts": e, "top_k": k},
                       run, cmp, got.clear, bytes_moved=logits.numel() * logits.element_size(),
                       extra_timings={"torch_routing": torch_routing})
    # The GDN gates of Qwen3-Next (32 value heads, packed as 16 key heads x (2 b | 2 a)).
    for tokens in (1, 256):
        ba = torch.randn(tokens, 16, 4, device=device, dtype=DTYPE, generator=gen) * 4
        a_log = torch.randn(32, device=device, generator=gen).to(DTYPE)
        dt_bias = torch.randn(32, device=device, generator=gen).to(DTYPE)
        gates: dict[str, Any] = {}

        def run_gates(ba=ba, a_log=a_log, dt_bias=dt_bias, gates=gates) -> None:
            gates["out"] = gdn_gates.gdn_gates(ba[:, :, :2], ba[:, :, 2:], a_log, dt_bias)

        def cmp_gates(ba=ba, a_log=a_log, dt_bias=dt_bias, gates=gates):
            beta, g = gates["out"]
            ref_beta, ref_g = gdn_gates.gdn_gates_ref(ba[:, :, :2], ba[:, :, 2:], a_log, dt_bias)
            return [("beta", beta, ref_beta), ("g", g, ref_g)]

        yield Case("gdn_gates", f"T={tokens} HV=32", {"tokens": tokens}, run_gates, cmp_gates, gates.clear,
                   bytes_moved=ba.numel() * ba.element_size() + tokens * 32 * 6)


def _fp8_cases(quick: bool, device: torch.device, gen: torch.Generator) -> Iterator[Case]:
    """W8A16 with 128x128 block scales: `fp8_gemm.fp8_linear` on Qwen3-8B's gate_up projection,
    and the fused MoE with `MoeFp8Scales` on Qwen3-30B-A3B's experts, each against its twin
    (weights dequantized, then the bf16 product). Bytes count the FP8 weights and their scales."""
    block = (128, 128)
    hd, inter = QWEN3["hidden"], QWEN3["inter"]
    weight, scale = fp8_gemm.quantize(torch.randn(2 * inter, hd, device=device, generator=gen) * hd**-0.5, block)
    w_bytes = weight.numel() + scale.numel() * 4
    for tokens in (1, 64, 4096) if quick else (1, 16, 64, 256, 4096):
        x = torch.randn(tokens, hd, device=device, dtype=DTYPE, generator=gen)
        out: dict[str, torch.Tensor] = {}

        def run(x=x, out=out) -> None:
            out["y"] = fp8_gemm.fp8_linear_triton(x, weight, scale, block)

        def cmp(x=x, out=out):
            return [("out", out["y"], fp8_gemm.fp8_linear_reference(x, weight, scale, block))]

        yield Case("fp8_linear", f"M={tokens} N={2 * inter} K={hd}", {"tokens": tokens}, run, cmp, out.clear,
                   bytes_moved=w_bytes + 2 * tokens * (hd + 2 * inter) * x.element_size(),
                   flops=2 * tokens * hd * 2 * inter)
    e, k, mhd, minter = (QWEN3_MOE[key] for key in ("experts", "top_k", "hidden", "inter"))
    w_gate_up, s_gate_up = fp8_gemm.quantize(torch.randn(e, 2 * minter, mhd, device=device, generator=gen) * mhd**-0.5,
                                             block)
    w_down, s_down = fp8_gemm.quantize(torch.randn(e, mhd, minter, device=device, generator=gen) * minter**-0.5, block)
    scales = fused_moe.MoeFp8Scales(s_gate_up, s_down, block)
    expert_bytes = 3 * mhd * minter + (s_gate_up[0].numel() + s_down[0].numel()) * 4
    for tokens in (1, 64, 4096) if quick else (1, 64, 256, 4096):
        x = torch.randn(tokens, mhd, device=device, dtype=DTYPE, generator=gen)
        weights, ids = fused_moe.select_experts(torch.randn(tokens, e, device=device, generator=gen), k,
                                                renormalize=True)
        distinct = int(torch.unique(ids).numel())
        moe_out: dict[str, torch.Tensor] = {}

        def run_moe(x=x, weights=weights, ids=ids, moe_out=moe_out) -> None:
            moe_out["y"] = fused_moe.fused_moe(x, w_gate_up, w_down, weights, ids, scales=scales)

        def cmp_moe(x=x, weights=weights, ids=ids, moe_out=moe_out):
            ref = fused_moe.fused_moe_reference(x, w_gate_up, w_down, weights, ids, scales=scales)
            return [("out", moe_out["y"], ref)]

        yield Case("fused_moe_fp8", f"N={tokens} E={e} k={k} Hd={mhd} I={minter}",
                   {"tokens": tokens, "distinct_experts": distinct}, run_moe, cmp_moe, moe_out.clear,
                   bytes_moved=distinct * expert_bytes + 2 * tokens * mhd * x.element_size(),
                   flops=2 * tokens * k * 3 * mhd * minter)


def _sampling_cases(quick: bool, device: torch.device, gen: torch.Generator) -> Iterator[Case]:
    vocab = QWEN3["vocab"]
    for rows in (1, 32, 256):
        logits = torch.randn(rows, vocab, device=device, generator=gen) * 4
        # A mix per row: every filter alone, all together, and off.
        choice = torch.arange(rows, device=device) % 5
        top_k = torch.where((choice == 0) | (choice == 3), 50, 0).to(torch.int32)
        top_p = torch.where((choice == 1) | (choice == 3), 0.9, 1.0).float()
        min_p = torch.where((choice == 2) | (choice == 3), 0.05, 0.0).float()
        out = torch.full_like(logits, float("nan"))

        def run(logits=logits, top_k=top_k, top_p=top_p, min_p=min_p, out=out) -> None:
            sampling.apply_top_k_top_p_min_p(logits, top_k, top_p, min_p, out=out)

        def ref_only(logits=logits, top_k=top_k, top_p=top_p, min_p=min_p) -> None:
            sampling.apply_top_k_top_p_min_p_reference(logits, top_k, top_p, min_p)

        def cmp(logits=logits, top_k=top_k, top_p=top_p, min_p=min_p, out=out):
            ref = sampling.apply_top_k_top_p_min_p_reference(logits, top_k, top_p, min_p)
            return [("kept_mask", torch.isfinite(out).float(), torch.isfinite(ref).float()),
                    ("kept_values", torch.where(torch.isfinite(ref), out, 0.0),
                     torch.where(torch.isfinite(ref), ref, 0.0))]

        yield Case("apply_top_k_top_p_min_p", f"B={rows} V={vocab}", {"rows": rows, "vocab": vocab},
                   run, cmp, lambda out=out: out.fill_(float("nan")),
                   bytes_moved=2 * logits.numel() * 4,
                   extra_timings={"sort_reference": ref_only}, exact_fraction=True)


def _gdn_qkv(tokens: int, device: torch.device, gen: torch.Generator):
    """q, k, v as the layer sees them: strided views into one conv output [T, conv_dim]; g, beta
    as Qwen3-Next computes them (g = -exp(A)·softplus(a) in float32, beta = sigmoid(b))."""
    h, hv, kd, vd = GDN["heads"], GDN["vheads"], GDN["kdim"], GDN["vdim"]
    mixed = torch.randn(tokens, GDN_CONV_DIM, device=device, dtype=DTYPE, generator=gen)
    q = mixed[:, : h * kd].view(tokens, h, kd)
    k = mixed[:, h * kd : 2 * h * kd].view(tokens, h, kd)
    v = mixed[:, 2 * h * kd :].view(tokens, hv, vd)
    a = torch.randn(tokens, hv, device=device, generator=gen)
    decay_rate = torch.rand(hv, device=device, generator=gen) * 4 + 0.1
    g = -decay_rate * torch.nn.functional.softplus(a)
    beta = torch.sigmoid(torch.randn(tokens, hv, device=device, generator=gen)).to(DTYPE)
    return q, k, v, g, beta


def _gdn_pool(num_slots: int, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """A float32 state pool [num_slots + 1, HV, K, V] (last slot = scratch), NaN everywhere:
    the cases fill the slots they use, so a read of any other slot shows up."""
    shape = (num_slots + 1, GDN["vheads"], GDN["kdim"], GDN["vdim"])
    return torch.full(shape, float("nan"), device=device, dtype=torch.float32)


def _gdn_cases(quick: bool, device: torch.device, gen: torch.Generator) -> Iterator[Case]:
    """Gated DeltaNet kernels at Qwen3-Next's shapes: recurrent decode update (GB/s of state
    read + written), chunked prefill of 4k tokens, conv1d prefill/update, gated RMSNorm."""
    hv, kd, vd, width = GDN["vheads"], GDN["kdim"], GDN["vdim"], GDN["conv_width"]
    scale = kd**-0.5
    for batch in GDN_DECODE_BATCHES if quick else sorted({*GDN_DECODE_BATCHES, 16, 128}):
        yield _gdn_decode_case(device, gen, batch, scale)
    for lengths in GDN_PREFILL_LENGTHS:
        yield _gdn_prefill_case(device, gen, lengths, scale)
    # Conv1d over q, k, v (8192 channels): decode update and a 4k-token prefill.
    weight = torch.randn(GDN_CONV_DIM, width, device=device, dtype=DTYPE, generator=gen) * 0.5
    for batch in GDN_DECODE_BATCHES:
        yield _gdn_conv_update_case(device, gen, weight, batch)
    for lengths in GDN_PREFILL_LENGTHS[:2]:
        yield _gdn_conv_prefill_case(device, gen, weight, lengths)
    norm_weight = 1 + 0.1 * torch.randn(vd, device=device, dtype=DTYPE, generator=gen)
    for tokens in (1, 256, sum(GDN_PREFILL_LENGTHS[0])):
        x = torch.randn(tokens * hv, vd, device=device, dtype=DTYPE, generator=gen)
        z = torch.randn(tokens * hv, vd, device=device, dtype=DTYPE, generator=gen)
        holder: dict[str, torch.Tensor] = {}

        def run_norm(x=x, z=z, holder=holder) -> None:
            holder["out"] = gated_norm.rms_norm_gated(x, z, norm_weight, 1e-6)

        def cmp_norm(x=x, z=z, holder=holder):
            return [("out", holder["out"], gated_norm.rms_norm_gated_ref(x, z, norm_weight, 1e-6))]

        yield Case("gdn_rms_norm_gated", f"T={tokens} {hv}x{vd}", {"tokens": tokens}, run_norm,
                   cmp_norm, bytes_moved=3 * x.numel() * x.element_size())


_gdn_cases.kernels = (  # type: ignore[attr-defined]
    "gdn_recurrent_update", "gdn_chunk_prefill", "gdn_conv1d_update", "gdn_conv1d_prefill",
    "gdn_rms_norm_gated",
)


def _gdn_decode_case(device: torch.device, gen: torch.Generator, batch: int, scale: float) -> Case:
    q, k, v, g, beta = _gdn_qkv(batch, device, gen)
    num_slots = 2 * batch + 1
    pool = _gdn_pool(num_slots, device, gen)
    slots = torch.randperm(num_slots, device=device, generator=gen)[:batch].to(torch.int32)
    initial = torch.randn(batch, *pool.shape[1:], device=device, generator=gen) * 0.1
    holder: dict[str, torch.Tensor] = {}

    def prepare() -> None:
        pool.fill_(float("nan"))
        pool[slots.long()] = initial

    def run() -> None:
        holder["out"] = gated_delta_rule.fused_recurrent_gated_delta_rule_update(
            q, k, v, g, beta, scale, pool, slots)

    def compare():
        ref_pool = _gdn_pool(num_slots, device, gen)
        ref_pool[slots.long()] = initial
        ref = gated_delta_rule.fused_recurrent_gated_delta_rule_update_ref(
            q, k, v, g, beta, scale, ref_pool, slots)
        return [("out", holder["out"], ref),
                ("state", pool[slots.long()], ref_pool[slots.long()]),
                ("unused_slots_nan", torch.isnan(pool).float(), torch.isnan(ref_pool).float())]

    def run_torch() -> None:  # the PyTorch twin (gather, einsum, scatter), for contrast
        gated_delta_rule.fused_recurrent_gated_delta_rule_update_ref(q, k, v, g, beta, scale, pool,
                                                                     slots)

    state_bytes = 2 * batch * pool[0].numel() * 4  # read once + written once, float32
    io_bytes = (2 * q.numel() + 2 * v.numel()) * q.element_size() + batch * GDN["vheads"] * 6
    return Case("gdn_recurrent_update", f"B={batch} H={GDN['heads']} HV={GDN['vheads']} K=V=128",
                {"batch": batch, "state_bytes": state_bytes}, run, compare, prepare,
                bytes_moved=state_bytes + io_bytes,
                flops=batch * GDN["vheads"] * GDN["kdim"] * GDN["vdim"] * 8,
                extra_timings={"torch_twin": run_torch})


def _gdn_prefill_case(device: torch.device, gen: torch.Generator, lengths: list[int],
                      scale: float) -> Case:
    tokens = sum(lengths)
    q, k, v, g, beta = _gdn_qkv(tokens, device, gen)
    batch = len(lengths)
    pool = _gdn_pool(batch, device, gen)
    slots = torch.arange(batch, device=device, dtype=torch.int32).flip(0)
    initial = torch.randn(batch, *pool.shape[1:], device=device, generator=gen) * 0.1
    has_initial = torch.tensor([i % 2 == 1 for i in range(batch)], device=device)
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    cu_seqlens = torch.tensor(bounds, device=device, dtype=torch.int32)
    holder: dict[str, torch.Tensor] = {}

    def prepare() -> None:
        pool.fill_(float("nan"))
        pool[slots.long()] = initial

    def run() -> None:
        holder["out"] = gated_delta_rule.chunk_gated_delta_rule(
            q, k, v, g, beta, scale, pool, slots, cu_seqlens, has_initial)

    def compare():
        ref_pool = _gdn_pool(batch, device, gen)
        ref_pool[slots.long()] = initial
        ref = gated_delta_rule.chunk_gated_delta_rule_ref(
            q, k, v, g, beta, scale, ref_pool, slots, cu_seqlens, has_initial)
        return [("out", holder["out"], ref),
                ("final_state", pool[slots.long()], ref_pool[slots.long()]),
                ("unused_slots_nan", torch.isnan(pool).float(), torch.isnan(ref_pool).float())]

    hv, kd, vd = GDN["vheads"], GDN["kdim"], GDN["vdim"]
    c = gated_delta_rule.DEFAULT_CHUNK_SIZE
    chunks = sum(-(-n // c) for n in lengths)
    # Multiply-adds per (chunk, value head): K Kᵀ, W, U (C²K + C²K + C²V); W S and Kᵀ V' (2CKV);
    # Q Kᵀ, Q S, attn V' (C²K + CKV + C²V). The substitution's C³/3 is left out.
    macs = chunks * hv * (3 * c * c * kd + 2 * c * c * vd + 3 * c * kd * vd)
    elt = q.element_size()
    io_bytes = tokens * (2 * GDN["heads"] * kd + 2 * hv * vd) * elt + tokens * hv * (4 + elt)
    def run_chunk32() -> None:  # the other chunk size, so the default can be chosen by timing
        gated_delta_rule.chunk_gated_delta_rule(q, k, v, g, beta, scale, pool, slots, cu_seqlens,
                                                has_initial, chunk_size=32)

    return Case("gdn_chunk_prefill", f"T={tokens} B={batch} lens={lengths if batch <= 4 else '…'}",
                {"lengths": lengths, "chunk_size": c}, run, compare, prepare,
                bytes_moved=io_bytes + 2 * batch * pool[0].numel() * 4, flops=2 * macs,
                extra_timings={"chunk_size_32": run_chunk32})


def _gdn_conv_update_case(device: torch.device, gen: torch.Generator, weight: torch.Tensor,
                          batch: int) -> Case:
    width = weight.shape[1]
    x = torch.randn(batch, GDN_CONV_DIM, device=device, dtype=DTYPE, generator=gen)
    num_slots = 2 * batch + 1
    pool = torch.full((num_slots + 1, GDN_CONV_DIM, width - 1), float("nan"), device=device,
                      dtype=DTYPE)
    slots = torch.randperm(num_slots, device=device, generator=gen)[:batch].to(torch.int32)
    initial = torch.randn(batch, GDN_CONV_DIM, width - 1, device=device, dtype=DTYPE, generator=gen)
    holder: dict[str, torch.Tensor] = {}

    def prepare() -> None:
        pool.fill_(float("nan"))
        pool[slots.long()] = initial

    def run() -> None:
        holder["out"] = causal_conv1d.causal_conv1d_update(x, weight, None, pool, slots)

    def compare():
        ref_pool = torch.full_like(pool, float("nan"))
        ref_pool[slots.long()] = initial
        ref = causal_conv1d.causal_conv1d_update_ref(x, weight, None, ref_pool, slots)
        return [("out", holder["out"], ref),
                ("state", pool[slots.long()], ref_pool[slots.long()]),
                ("unused_slots_nan", torch.isnan(pool).float(), torch.isnan(ref_pool).float())]

    elt = x.element_size()
    return Case("gdn_conv1d_update", f"B={batch} D={GDN_CONV_DIM} W={width}", {"batch": batch},
                run, compare, prepare,
                bytes_moved=batch * GDN_CONV_DIM * (2 * (width - 1) + 2) * elt)


def _gdn_conv_prefill_case(device: torch.device, gen: torch.Generator, weight: torch.Tensor,
                           lengths: list[int]) -> Case:
    width = weight.shape[1]
    tokens = sum(lengths)
    batch = len(lengths)
    x = torch.randn(tokens, GDN_CONV_DIM, device=device, dtype=DTYPE, generator=gen)
    pool = torch.full((batch + 1, GDN_CONV_DIM, width - 1), float("nan"), device=device,
                      dtype=DTYPE)
    slots = torch.arange(batch, device=device, dtype=torch.int32)
    initial = torch.randn(batch, GDN_CONV_DIM, width - 1, device=device, dtype=DTYPE, generator=gen)
    has_initial = torch.tensor([i % 2 == 0 for i in range(batch)], device=device)
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    cu_seqlens = torch.tensor(bounds, device=device, dtype=torch.int32)
    holder: dict[str, torch.Tensor] = {}

    def prepare() -> None:
        pool.fill_(float("nan"))
        pool[slots.long()] = initial

    def run() -> None:
        holder["out"] = causal_conv1d.causal_conv1d_prefill(x, weight, None, pool, slots, cu_seqlens,
                                                            has_initial)

    def compare():
        ref_pool = torch.full_like(pool, float("nan"))
        ref_pool[slots.long()] = initial
        ref = causal_conv1d.causal_conv1d_prefill_ref(x, weight, None, ref_pool, slots, cu_seqlens,
                                                      has_initial)
        return [("out", holder["out"], ref),
                ("state", pool[slots.long()], ref_pool[slots.long()]),
                ("unused_slots_nan", torch.isnan(pool).float(), torch.isnan(ref_pool).float())]

    return Case("gdn_conv1d_prefill", f"T={tokens} B={batch} D={GDN_CONV_DIM} W={width}",
                {"lengths": lengths}, run, compare, prepare,
                bytes_moved=2 * x.numel() * x.element_size())


# --------------------------------------------------------------------------- running


def _time(fn: Callable[[], None], warmup: int, iters: int, calls_per_graph: int) -> dict[str, Any]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples: list[float] = []
    mode = "cuda_graph"
    graph_error = None
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls_per_graph):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        for _ in range(iters):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3 / calls_per_graph)
    except Exception as exc:  # noqa: BLE001 - capture failures are reported, then eager timing
        graph_error = f"{type(exc).__name__}: {exc}"
        mode = "eager"
        samples = []
        torch.cuda.synchronize()
        for _ in range(iters):
            start.record()
            for _ in range(calls_per_graph):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3 / calls_per_graph)
    samples.sort()
    return {
        "mode": mode,
        "graph_error": graph_error,
        "median_us": statistics.median(samples),
        "p10_us": samples[len(samples) // 10],
        "p90_us": samples[(len(samples) * 9) // 10],
        "iters": iters,
        "calls_per_sample": calls_per_graph,
    }


def _check(case: Case) -> dict[str, Any]:
    case.prepare()
    case.run()
    torch.cuda.synchronize()
    checks: dict[str, Any] = {}
    ok = True
    for label, out, ref in case.compare():
        if label.endswith("_nan") or case.exact_fraction:
            mismatched = (out != ref).sum().item()
            frac = mismatched / max(1, out.numel())
            # Sampling masks may differ only on float-rounding ties at a threshold.
            passed = frac <= (1e-5 if case.exact_fraction else 0.0)
            checks[label] = {"mismatched": mismatched, "fraction": frac, "ok": passed}
        else:
            nan = torch.isnan(out).sum().item()
            err = _rel_err(out, ref)
            passed = nan == 0 and err <= TOLERANCE and not math.isnan(err)
            checks[label] = {"nan": nan, "max_rel_err": err, "ok": passed}
        ok = ok and passed
    return {"ok": ok, "checks": checks}


def _run_case(case: Case, args: argparse.Namespace) -> dict[str, Any]:
    record: dict[str, Any] = {"kernel": case.kernel, "case": case.name, "params": case.params,
                              "bytes_moved": case.bytes_moved, "flops": case.flops}
    try:
        t0 = time.perf_counter()
        record.update(_check(case))
        record["check_seconds"] = time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001 - one failing kernel must not stop the others
        record.update(ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        return record
    try:
        calls = 1 if case.bytes_moved > 256 << 20 else 10
        timing = _time(case.run, args.warmup, args.iters, calls)
        record["timing"] = timing
        seconds = timing["median_us"] * 1e-6
        record["gbps"] = case.bytes_moved / seconds / 1e9 if seconds > 0 else None
        record["tflops"] = case.flops / seconds / 1e12 if case.flops and seconds > 0 else None
        for label, fn in case.extra_timings.items():
            record[f"{label}_timing"] = _time(fn, 3, max(5, args.iters // 4), 1)
    except Exception as exc:  # noqa: BLE001
        record.update(timing_error=f"{type(exc).__name__}: {exc}",
                      traceback=traceback.format_exc())
    return record


def _copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy bandwidth (GB/s, read + write), the practical ceiling here."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * 10 * src.numel() / (start.elapsed_time(end) * 1e-3) / 1e9


def _table(results: list[dict[str, Any]], copy_gbps: float | None) -> str:
    lines = [
        "| kernel | case | ok | max rel err | median µs | GB/s | % copy BW | TFLOP/s | notes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        errs = [c.get("max_rel_err", c.get("fraction")) for c in r.get("checks", {}).values()]
        err = max((e for e in errs if e is not None), default=float("nan"))
        t = r.get("timing", {})
        med = t.get("median_us")
        gbps = r.get("gbps")
        notes = []
        if r.get("error"):
            notes.append(r["error"][:80])
        if r.get("timing_error"):
            notes.append("timing: " + r["timing_error"][:60])
        if t.get("mode") == "eager":
            notes.append("eager (graph capture failed)")
        for key, extra in r.items():
            if key.endswith("_timing") and isinstance(extra, dict) and "median_us" in extra:
                notes.append(f"{key[: -len('_timing')].replace('_', ' ')} {extra['median_us']:.1f} µs")
        if "distinct_experts" in r.get("params", {}):
            notes.append(f"{r['params']['distinct_experts']} experts read")
        if "num_splits" in r.get("params", {}):
            notes.append(f"splits={r['params']['num_splits']}")
        lines.append(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |".format(
                r["kernel"], r["case"], "yes" if r.get("ok") else "**NO**",
                f"{err:.2e}" if not math.isnan(err) else "-",
                f"{med:.1f}" if med is not None else "-",
                f"{gbps:.0f}" if gbps else "-",
                f"{100 * gbps / copy_gbps:.0f}%" if gbps and copy_gbps else "-",
                f"{r['tflops']:.1f}" if r.get("tflops") else "-",
                "; ".join(notes),
            )
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for the JSON + table")
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--only", default="", help="run kernels whose name contains this")
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    meta: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "quick": args.quick, "tolerance": TOLERANCE}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError as exc:
        meta["triton"] = f"unavailable: {exc}"
    results: list[dict[str, Any]] = []
    copy_gbps = None
    if not torch.cuda.is_available():
        meta["error"] = "no CUDA/ROCm device visible to torch"
    else:
        device = torch.device("cuda")
        props = torch.cuda.get_device_properties(device)
        meta.update(device=props.name, sms=props.multi_processor_count,
                    memory_gib=props.total_memory / 2**30)
        try:
            copy_gbps = _copy_bandwidth(device)
            meta["copy_gbps"] = copy_gbps
        except Exception as exc:  # noqa: BLE001
            meta["copy_gbps_error"] = str(exc)
        gen = torch.Generator(device=device)
        gen.manual_seed(args.seed)
        families = [_decode_cases, _prefill_cases, _norm_cases, _rotary_cases, _activation_cases,
                    _moe_cases, _routing_cases, _fp8_cases, _sampling_cases, _gdn_cases]
        for family in families:
            # A family that lists its kernel names is skipped unbuilt when --only excludes them.
            names = getattr(family, "kernels", None)
            if args.only and names and not any(args.only in name for name in names):
                continue
            cases = family(args.quick, device, gen)
            while True:
                try:
                    case = next(cases)
                except StopIteration:
                    break
                except Exception as exc:  # noqa: BLE001 - building a case failed
                    results.append({"kernel": family.__name__, "case": "setup", "ok": False,
                                    "error": f"{type(exc).__name__}: {exc}",
                                    "traceback": traceback.format_exc()})
                    break
                if args.only and args.only not in case.kernel:
                    continue
                record = _run_case(case, args)
                results.append(record)
                print(f"{record['kernel']:<26} {record['case']:<44} ok={record.get('ok')} "
                      f"{record.get('timing', {}).get('median_us', float('nan')):.1f} us",
                      file=sys.stderr, flush=True)
                del case
                torch.cuda.empty_cache()

    report = {"meta": meta, "results": results}
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    table = _table(results, copy_gbps)
    header = ", ".join(f"{k}={v}" for k, v in meta.items() if k in ("device", "torch", "triton",
                                                                      "copy_gbps"))
    (args.out / "gpu_check.md").write_text(f"# Kernel GPU check\n\n{header}\n\n{table}\n")
    print(table)
    failed = [r for r in results if not r.get("ok")]
    return 1 if failed or "error" in meta else 0


if __name__ == "__main__":
    sys.exit(main())
