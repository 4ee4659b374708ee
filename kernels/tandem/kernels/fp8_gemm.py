"""FP8 (e4m3) weights with block scales: quantize, dequantize, and the W8A16 GEMM.

Layout (the one DeepSeek-V3 and Qwen publish, ``quant_method: fp8``): a weight ``[..., N, K]``
stored as ``float8_e4m3fn`` and a float32 ``scale [..., ceil(N/bn), ceil(K/bk)]`` for blocks of
``block = (bn, bk)`` (``weight_block_size``, usually ``(128, 128)``); the last block of a row or
column may be partial. The real weight is ``fp8 · scale`` broadcast over each block (the scale
is what checkpoints call ``weight_scale_inv``). Per-channel FP8 is the block ``(1, K)`` (one
scale per output row), per-tensor the block ``(N, K)``.

``fp8_linear`` is ``x @ dequantize(w).T (+ bias)`` with the weight kept FP8 in memory: the
Triton kernel loads an FP8 tile, multiplies it by its block's scale in float32, rounds it to the
activation dtype and accumulates the product in float32 (W8A16). ``fp8_linear_reference`` is its
torch twin (dequantize, round to the activation dtype, matmul in float32), and the path CPUs run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels._utils import (
    FLOAT_DTYPES,
    cast,
    cdiv,
    check_dtype,
    check_same_device,
    dot,
    dot_precision,
    tl,
    triton_available,
    triton_kernel,
)

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "check_scale",
    "dequantize",
    "expand_scale_rows",
    "fp8_linear",
    "fp8_linear_reference",
    "quantize",
    "scale_shape",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
_MIN_SCALE = 1e-12  # an all-zero block gets this scale instead of zero (no division by zero)


def scale_shape(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    """Shape of the scales of a ``[rows, cols]`` weight in ``block`` blocks (ceil division)."""
    return cdiv(rows, block[0]), cdiv(cols, block[1])


def check_scale(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> None:
    """Raise unless ``scale`` has the shape and dtype the blocks of ``weight`` need."""
    check_dtype("weight", weight, (FP8_DTYPE,))
    check_dtype("scale", scale, (torch.float32,))
    want = (*weight.shape[:-2], *scale_shape(weight.shape[-2], weight.shape[-1], block))
    if tuple(scale.shape) != want:
        raise ValueError(f"scale must be {list(want)} for weight {list(weight.shape)} in blocks {block}, "
                         f"got {list(scale.shape)}")


def _expand_dim(scale: torch.Tensor, dim: int, size: int, width: int) -> torch.Tensor:
    if scale.shape[dim] == 1:  # one block spans the dimension (per-channel or per-tensor)
        shape = list(scale.shape)
        shape[dim] = size
        return scale.expand(shape)
    return scale.repeat_interleave(width, dim=dim).narrow(dim, 0, size)


def _expand(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """``[..., sn, sk]`` block scales broadcast to one per weight element, ``[..., rows, cols]``."""
    return _expand_dim(_expand_dim(scale, -2, rows, block[0]), -1, cols, block[1])


def expand_scale_rows(scale: torch.Tensor, rows: int, block_rows: int) -> torch.Tensor:
    """Scales of blocks ``(block_rows, bk)`` rewritten for blocks ``(1, bk)``: one row per weight row."""
    return _expand_dim(scale, -2, rows, block_rows).contiguous()


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[..., N, K]`` FP8 weight times its block scales, computed in float32, returned in ``dtype``."""
    check_scale(weight, scale, block)
    return (weight.float() * _expand(scale, weight.shape[-2], weight.shape[-1], block)).to(dtype)


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., N, K]`` float weight -> ``(fp8 weight, float32 scales)`` in ``block`` blocks.

    Each block's scale is its largest magnitude over ``FP8_MAX``, so the block's largest value
    maps to ±448 and none saturates; values are rounded to nearest by the cast."""
    check_dtype("weight", weight, FLOAT_DTYPES)
    *lead, rows, cols = weight.shape
    bn, bk = min(block[0], rows), min(block[1], cols)  # a block may span a whole dimension
    sn, sk = scale_shape(rows, cols, block)
    padded = F.pad(weight.float(), (0, sk * bk - cols, 0, sn * bn - rows))
    blocks = padded.reshape(*lead, sn, bn, sk, bk)
    amax = blocks.abs().amax(dim=(-3, -1))
    scale = (amax / FP8_MAX).clamp_min(_MIN_SCALE)
    q = (weight.float() / _expand(scale, rows, cols, block)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.contiguous()


def _check_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                  bias: torch.Tensor | None) -> None:
    check_dtype("x", x, FLOAT_DTYPES)
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"weight must be [N, K={x.shape[-1]}], got {list(weight.shape)}")
    check_scale(weight, scale, block)
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {list(bias.shape)}")
    check_same_device(x=x, weight=weight, scale=scale)


# --------------------------------------------------------------------------- PyTorch twin


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch twin of :func:`fp8_linear`: the weight dequantized and rounded to ``x``'s dtype,
    the product accumulated in float32 and rounded once to ``x``'s dtype."""
    _check_linear(x, weight, scale, block, bias)
    w = dequantize(weight, scale, block, x.dtype)
    out = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    return out.to(x.dtype)


# --------------------------------------------------------------------------- Triton path


@triton_kernel(do_not_specialize=("m",))
def _fp8_linear_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    bias_ptr,
    out_ptr,
    m,
    n,
    k,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    BLOCK_SN: tl.constexpr,
    BLOCK_SK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < m
    col_ok = cols < n
    # One scale per column and K tile: a K tile never straddles a scale block (BLOCK_K divides
    # BLOCK_SK, or one scale block spans all of K).
    s_rows = s_ptr + (cols // BLOCK_SN).to(tl.int64) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        s = tl.load(s_rows + k0 // BLOCK_SK, mask=col_ok, other=0.0)
        w = cast(w.to(tl.float32) * s[None, :], x_ptr.dtype.element_ty)
        acc += dot(a, w, PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out, cast(acc, out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _block_k(k: int, block_k: int) -> int:
    """The K tile: the widest of 128/64/32/16 that divides the scale block's width (or any, 64,
    when one scale block covers all of K)."""
    if block_k >= k:
        return 64
    for width in (128, 64, 32, 16):
        if block_k % width == 0:
            return width
    raise ValueError(f"scale block width {block_k} must be a multiple of 16 (or cover all of K={k})")


def fp8_linear_triton(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton W8A16 GEMM (CUDA, or CPU under ``TRITON_INTERPRET=1``); see :func:`fp8_linear`."""
    _check_linear(x, weight, scale, block, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if not (weight.is_contiguous() and scale.stride(-1) == 1):
        raise ValueError("weight must be contiguous and scale contiguous in its last dim")
    m, k = x2.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*lead, n)
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = 64
    block_k = _block_k(k, block[1])
    _fp8_linear_kernel.on(x.device)[(cdiv(m, block_m), cdiv(n, block_n))](
        x2, weight, scale, bias if bias is not None else scale, out, m, n, k,
        x2.stride(0), weight.stride(0), scale.stride(0), out.stride(0),
        BLOCK_SN=block[0], BLOCK_SK=block[1], HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=dot_precision(x.dtype),
        num_warps=4, num_stages=3,
    )
    return out.reshape(*lead, n)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``[..., K] -> [..., N]``: ``x @ (weight · scale).T + bias`` with ``weight [N, K]`` FP8 and
    ``scale [ceil(N/bn), ceil(K/bk)]`` float32; the Triton kernel on CUDA, its twin elsewhere."""
    if x.is_cuda and triton_available():
        return fp8_linear_triton(x, weight, scale, block, bias)
    return fp8_linear_reference(x, weight, scale, block, bias)
