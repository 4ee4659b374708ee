"""The gated (SwiGLU) feed-forward block shared by the dense decoders and MoE shared experts."""

from __future__ import annotations

import torch
from torch import nn

from tandem.engine_service.layers.activation import silu_and_mul
from tandem.engine_service.layers.linear import ColumnParallelLinear, RowParallelLinear
from tandem.engine_service.layers.merged_linear import MergedColumnLinear
from tandem.kernels import activation as activation_kernels


class GatedMLP(nn.Module):
    """SwiGLU feed-forward: `down(silu(gate(x)) * up(x))`, parameters named as in HF checkpoints.

    `fused=True` (the Triton path) computes gate and up as one GEMM over a merged weight (the
    projections' parameters are views of it, gate rows first) and SiLU·mul as one kernel.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, fused: bool = False) -> None:
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.fused = fused
        if fused:  # gate rows first: the layout silu_and_mul's kernel reads
            self.gate_up = MergedColumnLinear([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gate_up = self.gate_up(x)
            return self.down_proj(activation_kernels.silu_and_mul(gate_up))
        return self.down_proj(silu_and_mul(self.gate_proj(x), self.up_proj(x)))
