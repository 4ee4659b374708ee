"""Gated RMSNorm (Qwen3-Next / Qwen3.5 Gated DeltaNet output norm): ``rmsnorm(x) * silu(z)``.

Matches Hugging Face's ``Qwen3NextRMSNormGated`` including its roundings:
``n = (x·rsqrt(mean(x²) + eps))`` in float32 rounded to ``x``'s dtype; ``p = weight · n`` in the
promoted dtype of ``weight`` and ``x`` (bfloat16 for a bfloat16 model: rounded again); ``y = p ·
silu(float32(z))`` in float32, rounded to ``x``'s dtype. The PyTorch twin performs the same torch
operations as Hugging Face, so it matches bit for bit.

Rows are the ``[T·HV]`` value-head outputs of a GDN layer, ``D = head_v_dim`` (128) wide; ``x`` and
``z`` may be strided 2-D ``[N, D]`` or 3-D ``[T, heads, D]`` views (``z`` is a slice of the input
projection). Bytes moved: reads ``2·N·D·e``, writes ``N·D·e``; several rows per program.

Dispatch: Triton on CUDA, or on CPU when ``TRITON_INTERPRET=1`` is set; else the PyTorch twin.
"""

from __future__ import annotations

import torch

from tandem.kernels._utils import (
    FLOAT_DTYPES,
    cast,
    cdiv,
    check_contiguous_last_dim,
    check_dtype,
    check_same_device,
    check_shape,
    next_power_of_2,
    tl,
    triton_kernel,
)
from tandem.kernels.causal_conv1d import use_triton

__all__ = ["rms_norm_gated", "rms_norm_gated_ref"]

_ELEMENTS_PER_PROGRAM = 4096


def rms_norm_gated_ref(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """PyTorch twin of :func:`rms_norm_gated`: Hugging Face's ``Qwen3NextRMSNormGated.forward``
    operation for operation. Returns a contiguous tensor of ``x``'s shape and dtype."""
    _check(x, z, weight)
    input_dtype = x.dtype
    xf = x.to(torch.float32)
    variance = xf.pow(2).mean(-1, keepdim=True)
    xf = xf * torch.rsqrt(variance + eps)
    y = weight * xf.to(input_dtype)
    y = y * torch.nn.functional.silu(z.to(torch.float32))
    return y.to(input_dtype).contiguous()


def _check(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor) -> None:
    check_dtype("x", x, FLOAT_DTYPES)
    check_dtype("z", z, FLOAT_DTYPES)
    check_dtype("weight", weight, FLOAT_DTYPES)
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be [N, D] or [T, heads, D], got {list(x.shape)}")
    check_shape("z", z, tuple(x.shape))
    check_shape("weight", weight, (x.shape[-1],))
    check_same_device(x=x, z=z, weight=weight)


def _row_view(name: str, t: torch.Tensor) -> tuple[int, int, int]:
    """(inner, stride_outer, stride_inner) addressing the rows of a 2-D or 3-D tensor."""
    check_contiguous_last_dim(name, t)
    if t.dim() == 2:
        return 1, t.stride(0), 0
    return t.shape[1], t.stride(0), t.stride(1)


@triton_kernel(do_not_specialize=("n_rows",))
def _rms_norm_gated_kernel(
    x_ptr,
    z_ptr,
    w_ptr,
    y_ptr,
    n_rows,
    inner,
    stride_x_outer,
    stride_x_inner,
    stride_z_outer,
    stride_z_inner,
    eps,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    PRODUCT_DTYPE: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    outer = (rows // inner).to(tl.int64)
    inn = (rows % inner).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = row_ok[:, None] & (cols < N)[None, :]
    x_off = (outer * stride_x_outer + inn * stride_x_inner)[:, None] + cols[None, :]
    z_off = (outer * stride_z_outer + inn * stride_z_inner)[:, None] + cols[None, :]
    x = tl.load(x_ptr + x_off, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + z_off, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / N + eps)
    normed = cast(x * rstd[:, None], y_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    product = cast(normed * w[None, :], PRODUCT_DTYPE).to(tl.float32)
    gate = z / (1.0 + tl.exp(-z))
    out_off = rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(y_ptr + out_off, cast(product * gate, y_ptr.dtype.element_ty), mask=mask)



def rms_norm_gated(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rmsnorm(x) · weight · silu(z)`` over the last dim; returns a new contiguous tensor of
    ``x``'s shape and dtype."""
    if not use_triton(x.device):
        return rms_norm_gated_ref(x, z, weight, eps)
    _check(x, z, weight)
    if weight.stride(0) != 1:
        raise ValueError("weight must be contiguous")
    n = x.shape[-1]
    inner, sxo, sxi = _row_view("x", x)
    _, szo, szi = _row_view("z", z)
    if z.dim() == 3 and z.shape[1] != inner:
        raise ValueError("z must have x's shape")
    n_rows = x.numel() // n if n else 0
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if n_rows == 0:
        return y
    block_n = next_power_of_2(n)
    rows = max(1, min(_ELEMENTS_PER_PROGRAM // block_n, next_power_of_2(n_rows)))
    num_warps = max(1, min(16, rows * block_n // 512))
    launcher = _rms_norm_gated_kernel.on(x.device)  # loads Triton (interpreter mode decided)
    import triton.language as language

    product_dtype = {torch.float32: language.float32, torch.float16: language.float16,
                     torch.bfloat16: language.bfloat16}[torch.promote_types(weight.dtype, x.dtype)]
    launcher[(cdiv(n_rows, rows),)](
        x, z, weight, y, n_rows, inner, sxo, sxi, szo, szi, eps,
        N=n, BLOCK_N=block_n, ROWS=rows, PRODUCT_DTYPE=product_dtype, num_warps=num_warps,
    )
    return y
