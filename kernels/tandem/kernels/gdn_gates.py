"""The Gated DeltaNet gates in one launch: ``beta = sigmoid(b)``, ``g = -exp(A_log) · softplus(a + dt_bias)``.

Arithmetic as transformers' ``Qwen3NextGatedDeltaNet`` forms them: ``beta`` is ``b.sigmoid()``
in ``b``'s dtype (float32 inside, rounded once); ``g`` is float32 throughout (in half precision
``exp(A_log)`` may overflow), with ``softplus(x) = x`` above 20, else ``log(1 + exp(x))``
(``torch.nn.functional.softplus``'s threshold).

``a`` and ``b`` are ``[T, HV]`` or ``[T, G, R]`` views with a contiguous last dim (Qwen3-Next's
packed ``in_proj_ba`` output is ``[T, H, 2R]``: per key head its R b's, then its R a's; head
``h·R + r`` is value head ``h·R + r``), so the packed projection is read in place. Outputs are
contiguous ``[T, HV]``. Done in PyTorch these are about ten launches per GDN layer (casts, add,
softplus, exp, neg, mul, sigmoid, and the copies that make the packed views contiguous).

``gdn_gates_ref`` is the PyTorch twin (transformers' operations, same signature).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tandem.kernels._utils import (
    FLOAT_DTYPES,
    cast,
    cdiv,
    check_dtype,
    check_same_device,
    check_shape,
    next_power_of_2,
    tl,
    triton_kernel,
)
from tandem.kernels.causal_conv1d import use_triton

__all__ = ["gdn_gates", "gdn_gates_ref"]

_ELEMENTS_PER_PROGRAM = 2048


def _as_3d(name: str, t: torch.Tensor) -> torch.Tensor:
    check_dtype(name, t, FLOAT_DTYPES)
    if t.dim() == 2:
        t = t.unsqueeze(1)  # [T, 1, HV]: one group of every head
    if t.dim() != 3 or (t.shape[-1] > 1 and t.stride(-1) != 1):
        raise ValueError(f"{name} must be [T, HV] or [T, G, R] with a contiguous last dim, got "
                         f"{list(t.shape)} strides {t.stride()}")
    return t


def _check(b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor) -> tuple[int, int]:
    if a.shape != b.shape:
        raise ValueError(f"a {list(a.shape)} and b {list(b.shape)} differ in shape")
    t, heads = b.shape[0], math.prod(b.shape[1:])
    check_shape("A_log", a_log, (heads,))
    check_shape("dt_bias", dt_bias, (heads,))
    check_dtype("A_log", a_log, FLOAT_DTYPES)
    check_dtype("dt_bias", dt_bias, FLOAT_DTYPES)
    check_same_device(a=a, b=b, A_log=a_log, dt_bias=dt_bias)
    return t, heads


def gdn_gates_ref(
    b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch twin of :func:`gdn_gates`: ``(beta [T, HV] in b's dtype, g [T, HV] float32)``."""
    t, heads = _check(b, a, a_log, dt_bias)
    b, a = b.reshape(t, heads), a.reshape(t, heads)
    beta = b.sigmoid()
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    return beta, g


@triton_kernel(do_not_specialize=("n_tokens",))
def _gdn_gates_kernel(
    b_ptr,
    a_ptr,
    a_log_ptr,
    dt_bias_ptr,
    beta_ptr,
    g_ptr,
    n_tokens,
    stride_bt,
    stride_bg,
    stride_at,
    stride_ag,
    HEADS: tl.constexpr,
    R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    heads = tl.arange(0, BLOCK_H)
    head_ok = heads < HEADS
    mask = (rows < n_tokens)[:, None] & head_ok[None, :]
    r64 = rows.to(tl.int64)[:, None]
    grp, sub = heads // R, heads % R
    b = tl.load(b_ptr + r64 * stride_bt + (grp * stride_bg + sub)[None, :], mask=mask, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + r64 * stride_at + (grp * stride_ag + sub)[None, :], mask=mask, other=0.0).to(tl.float32)
    a_log = tl.load(a_log_ptr + heads, mask=head_ok, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + heads, mask=head_ok, other=0.0).to(tl.float32)
    beta = 1.0 / (1.0 + tl.exp(-b))
    x = a + dt_bias[None, :]
    # log1p(u) without a log1p: log(1 + u) · u / ((1 + u) - 1) cancels the rounding of 1 + u.
    u = tl.exp(tl.minimum(x, 20.0))
    w = 1.0 + u
    softplus = tl.where(x > 20.0, x, tl.where(w == 1.0, u, tl.log(w) * (u / tl.where(w == 1.0, 1.0, w - 1.0))))
    g = -tl.exp(a_log)[None, :] * softplus
    out = r64 * HEADS + heads[None, :]
    tl.store(beta_ptr + out, cast(beta, beta_ptr.dtype.element_ty), mask=mask)
    tl.store(g_ptr + out, g, mask=mask)


def gdn_gates(
    b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(beta [T, HV] in b's dtype, g [T, HV] float32)`` from ``b, a`` (``[T, HV]`` or
    ``[T, G, R]`` views), ``A_log [HV]`` and ``dt_bias [HV]``. Triton on CUDA, or on CPU under
    ``TRITON_INTERPRET=1``; else the PyTorch twin."""
    if not use_triton(b.device):
        return gdn_gates_ref(b, a, a_log, dt_bias)
    t, heads = _check(b, a, a_log, dt_bias)
    b3, a3 = _as_3d("b", b), _as_3d("a", a)
    for name, w in (("A_log", a_log), ("dt_bias", dt_bias)):
        if w.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous")
    beta = torch.empty(t, heads, dtype=b.dtype, device=b.device)
    g = torch.empty(t, heads, dtype=torch.float32, device=b.device)
    if t == 0:
        return beta, g
    block_h = next_power_of_2(heads)
    block_t = max(1, min(_ELEMENTS_PER_PROGRAM // block_h, next_power_of_2(t)))
    _gdn_gates_kernel.on(b.device)[(cdiv(t, block_t),)](
        b3, a3, a_log, dt_bias, beta, g, t, b3.stride(0), b3.stride(1), a3.stride(0), a3.stride(1),
        HEADS=heads, R=b3.shape[2], BLOCK_H=block_h, BLOCK_T=block_t, num_warps=4,
    )
    return beta, g
