"""RMSNorm, optionally fused with the residual add that precedes it in a pre-norm block."""

from __future__ import annotations

from typing import overload

import torch
from torch import nn

from tandem.kernels.norm import fused_add_rmsnorm, rmsnorm


class RMSNorm(nn.Module):
    """Root-mean-square layer norm over the last dimension, with an optional fused residual add.

    `forward(x)` returns the normalised tensor. `forward(x, residual)` first forms
    `x + residual` (the new residual stream) and returns `(normalised, new_residual)`, so a
    decoder layer never materialises the sum twice. `fused=True` (the Triton path) runs both
    forms as one Triton kernel each, with the same roundings; `x` may then also be a strided
    `[T, heads, N]` view (per-head q/k norm on a fused qkv output).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, fused: bool = False) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.fused = fused
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in float32 whatever the activation dtype; the scale is applied after the
        # cast back, as in the reference checkpoints' own implementation.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.fused:
            if residual is None:
                return rmsnorm(x, self.weight, self.eps)
            return fused_add_rmsnorm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}" + (", fused" if self.fused else "")


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm whose scale is stored as an offset from one: `x / rms(x) * (1 + weight)`.

    The Qwen3-Next / Qwen3.5 convention (transformers' `Qwen3NextRMSNorm`): the whole product is
    formed in float32 and cast back once (unlike `RMSNorm`, which casts before scaling), and a
    zero weight is the identity scale. `forward(x, residual)` fuses the preceding residual add
    as `RMSNorm` does and returns `(normalised, new_residual)`. `fused=True` runs both forms as
    one Triton kernel each (the zero-centred variant of `RMSNorm`'s, same roundings), `x` then
    also a strided `[T, heads, N]` view.
    """

    # What `loader.init_dummy_weights` fills the weight with (the identity scale).
    dummy_weight_value = 0.0

    def __init__(self, hidden_size: int, eps: float = 1e-6, fused: bool = False) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.fused = fused
        self.weight = nn.Parameter(torch.zeros(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.fused:
            if residual is None:
                return rmsnorm(x, self.weight, self.eps, zero_centered=True)
            return fused_add_rmsnorm(x, residual, self.weight, self.eps, zero_centered=True)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, zero_centered" + (", fused" if self.fused else "")
