"""RMSNorm and fused residual-add + RMSNorm.

Semantics follow Hugging Face's Llama/Qwen ``RMSNorm`` exactly, including its roundings: the
residual sum is rounded to the activation dtype (the model keeps its residual stream in that
dtype), the variance is taken in float32 over that rounded sum, the normalised value is rounded
to the activation dtype and only then multiplied by the weight.

``zero_centered=True`` is the Qwen3-Next / Qwen3.5 convention (transformers' ``Qwen3NextRMSNorm``):
the scale is ``1 + weight`` and the whole product ``x·rstd·(1 + weight)`` is formed in float32
and rounded once (the residual sum is rounded as above).

Bytes moved per row of ``N`` elements of ``e`` bytes: ``rmsnorm`` reads ``N·e`` and writes
``N·e``; ``fused_add_rmsnorm`` reads ``2·N·e`` and writes ``2·N·e`` (the weight, ``N·e``, is
read by every program but stays in L2). Fusing saves the separate add's ``3·N·e`` round trip.
A whole row lives in registers, so each element is read once; short rows (Qwen3's per-head q/k
norm over ``head_dim`` = 128) are packed several to a program so a program still moves a few KiB.
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

__all__ = [
    "fused_add_rmsnorm",
    "fused_add_rmsnorm_reference",
    "rmsnorm",
    "rmsnorm_reference",
]

_ELEMENTS_PER_PROGRAM = 4096  # rows are packed until a program handles about this many


@triton_kernel
def _rmsnorm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    n_rows,
    inner,
    stride_x_outer,
    stride_x_inner,
    stride_r_outer,
    stride_r_inner,
    eps,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    # Rows are addressed as (outer, inner) so strided 3-D views (q/k heads sliced out of a fused
    # qkv projection) need no copy.
    outer = (rows // inner).to(tl.int64)
    inn = (rows % inner).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = row_mask[:, None] & (cols < N)[None, :]
    x_off = (outer * stride_x_outer + inn * stride_x_inner)[:, None] + cols[None, :]
    x = tl.load(x_ptr + x_off, mask=mask, other=0.0).to(tl.float32)
    out_off = rows.to(tl.int64)[:, None] * N + cols[None, :]
    if HAS_RESIDUAL:
        r_off = (outer * stride_r_outer + inn * stride_r_inner)[:, None] + cols[None, :]
        r = tl.load(res_ptr + r_off, mask=mask, other=0.0).to(tl.float32)
        summed = cast(x + r, res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + out_off, summed, mask=mask)
        x = summed.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / N + eps)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    if ZERO_CENTERED:  # one rounding, of the float32 product
        tl.store(out_ptr + out_off, cast(x * rstd[:, None] * (1.0 + w[None, :]), out_ptr.dtype.element_ty),
                 mask=mask)
    else:
        normed = cast(x * rstd[:, None], out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + out_off, cast(normed * w[None, :], out_ptr.dtype.element_ty), mask=mask)


def _row_view(name: str, t: torch.Tensor) -> tuple[int, int, int, int]:
    """(n_rows, inner, stride_outer, stride_inner) addressing the rows of a 2-D or 3-D tensor."""
    check_contiguous_last_dim(name, t)
    if t.dim() == 2:
        return t.shape[0], 1, t.stride(0), 0
    if t.dim() == 3:
        return t.shape[0] * t.shape[1], t.shape[1], t.stride(0), t.stride(1)
    raise ValueError(f"{name} must be 2-D [rows, N] or 3-D [T, heads, N], got {list(t.shape)}")


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None,
    residual_out: torch.Tensor | None,
    zero_centered: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    check_dtype("x", x, FLOAT_DTYPES)
    check_dtype("weight", weight, FLOAT_DTYPES)
    n = x.shape[-1]
    check_shape("weight", weight, (n,))
    if weight.stride(0) != 1:
        raise ValueError("weight must be contiguous")
    n_rows, inner, sxo, sxi = _row_view("x", x)
    tensors = {"x": x, "weight": weight}
    sro = sri = 0
    if residual is not None:
        check_shape("residual", residual, tuple(x.shape))
        if residual.dtype != x.dtype:
            raise TypeError(f"residual dtype {residual.dtype} differs from x dtype {x.dtype}")
        _, _, sro, sri = _row_view("residual", residual)
        tensors["residual"] = residual
    device = check_same_device(**tensors)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=device)
    if residual is not None and residual_out is None:
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=device)
    for name, t in (("out", out), ("residual_out", residual_out)):
        if t is not None and (t.shape != x.shape or t.dtype != x.dtype or t.device != device
                              or not t.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous {x.dtype} tensor of shape {list(x.shape)}")
    if n_rows == 0:
        return out, residual_out

    block_n = next_power_of_2(n)
    rows = max(1, min(_ELEMENTS_PER_PROGRAM // block_n, next_power_of_2(n_rows)))
    num_warps = max(1, min(16, rows * block_n // 512))
    grid = (cdiv(n_rows, rows),)
    _rmsnorm_kernel.on(device)[grid](
        x,
        residual if residual is not None else x,
        weight,
        out,
        residual_out if residual_out is not None else out,
        n_rows,
        inner,
        sxo,
        sxi,
        sro,
        sri,
        eps,
        N=n,
        BLOCK_N=block_n,
        ROWS=rows,
        HAS_RESIDUAL=residual is not None,
        ZERO_CENTERED=zero_centered,
        num_warps=num_warps,
    )
    return out, residual_out


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None, zero_centered: bool = False
) -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` (``[rows, N]`` or a strided ``[T, heads, N]`` view,
    as for Qwen3's per-head q/k norm). Returns a new contiguous tensor (or ``out``)."""
    result, _ = _launch(x, None, weight, eps, out, None, zero_centered)
    return result


def fused_add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    zero_centered: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``new_residual = x + residual``; ``out = rmsnorm(new_residual)``. Returns
    ``(out, new_residual)``; ``out``/``residual_out`` may alias ``x``/``residual`` (each row is
    read completely before it is written)."""
    result, new_residual = _launch(x, residual, weight, eps, out, residual_out, zero_centered)
    assert new_residual is not None
    return result, new_residual


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    """PyTorch twin of :func:`rmsnorm` (Hugging Face's ``LlamaRMSNorm`` arithmetic, or
    ``Qwen3NextRMSNorm``'s when ``zero_centered``)."""
    xf = x.float()
    if zero_centered:
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (xf * (1.0 + weight.float())).to(x.dtype).contiguous()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed.float() * weight.float()).to(x.dtype).contiguous()


def fused_add_rmsnorm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch twin of :func:`fused_add_rmsnorm`."""
    new_residual = (x.float() + residual.float()).to(x.dtype)
    return rmsnorm_reference(new_residual, weight, eps, zero_centered), new_residual.contiguous()
