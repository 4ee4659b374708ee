"""Gated activations for the MLP blocks."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's elementwise part: `silu(gate) * up` (one place for a fused kernel to replace)."""
    return F.silu(gate) * up
