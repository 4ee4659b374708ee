"""Rotary position embedding (NeoX half-split layout) with the scaling schemes of HF configs.

Supported `rope_type`s: `default`, `linear`, `llama3` and `yarn`. The frequencies follow the
formulas of the Hugging Face reference implementation in float32, so a checkpoint sees the
same angles it was trained with.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    """Everything that determines the rotary frequencies of one model."""

    theta: float = 10000.0
    rope_type: str = "default"
    partial_rotary_factor: float = 1.0
    # Type-specific parameters (factor, low_freq_factor, beta_fast, ...), as in the HF config.
    scaling: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> "RopeConfig":
        """Read `rope_parameters` (transformers >= 5) or `rope_theta` + `rope_scaling` (older)."""
        params = config.get("rope_parameters")
        if params and not isinstance(next(iter(params.values())), Mapping):
            theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
            scaling = dict(params)
        elif params:
            raise NotImplementedError("per-layer-type rope_parameters are not supported")
        else:
            theta = config.get("rope_theta", 10000.0)
            scaling = dict(config.get("rope_scaling") or {})
        rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
        scaling.pop("type", None)
        scaling.pop("rope_theta", None)
        partial = scaling.pop("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise NotImplementedError(f"rope_type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")
        return cls(theta=float(theta), rope_type=rope_type, partial_rotary_factor=float(partial), scaling=scaling)


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, s: Mapping[str, Any]) -> torch.Tensor:
    factor = s["factor"]
    low, high = s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are interpolated by `factor`, short ones kept; the band between blends.
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(medium, blended, out)


def _yarn_inv_freq(
    theta: float, dim: int, s: Mapping[str, Any], max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    original = s.get("original_max_position_embeddings") or max_position_embeddings
    factor = s.get("factor") or max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast = s.get("beta_fast") or 32
    beta_slow = s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    # High-frequency dims (ramp 0) keep their original frequency; low-frequency ones interpolate.
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def compute_inv_freq(rope: RopeConfig, head_dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies `[rotary_dim // 2]` (float32, CPU) and the cos/sin magnitude scale."""
    dim = int(head_dim * rope.partial_rotary_factor)
    s = rope.scaling
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope.theta, dim, s, max_position_embeddings)
    inv_freq = _base_inv_freq(rope.theta, dim)
    if rope.rope_type == "linear":
        inv_freq = inv_freq / s["factor"]
    elif rope.rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, s)
    return inv_freq, 1.0


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x [T, heads, head_dim]`'s first `2 * cos.shape[-1]` dims; `cos`/`sin` are `[T, rot/2]`."""
    half = cos.shape[-1]
    rot, rest = x[..., : 2 * half], x[..., 2 * half :]
    x1, x2 = rot.float().chunk(2, dim=-1)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
    return rotated if rest.numel() == 0 else torch.cat((rotated, rest), dim=-1)


@dataclass(frozen=True)
class RotaryInputs:
    """One step's rotary inputs, computed once by the model and shared by every layer.

    The PyTorch path rotates with the `cos`/`sin` rows gathered for the step's positions; a
    fused kernel indexes `table` (`[max_position, rotary_dim]`, cos half then sin half) by
    position itself, so nothing is gathered for it (`cos`/`sin` are None).
    """

    table: torch.Tensor
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None


class RotaryEmbedding(nn.Module):
    """Looks up cos/sin for a step's positions from a table precomputed up to `max_position`.

    One instance serves every layer: the model gathers `cos, sin = rotary(positions)` once per
    step and each attention layer calls `apply_rotary` on its queries and keys.
    """

    def __init__(
        self, head_dim: int, rope: RopeConfig, max_position: int, max_position_embeddings: int | None = None
    ) -> None:
        super().__init__()
        inv_freq, magnitude = compute_inv_freq(rope, head_dim, max_position_embeddings or max_position)
        self.rotary_dim = 2 * inv_freq.numel()
        self.max_position = max_position
        angles = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        table = torch.cat((angles.cos() * magnitude, angles.sin() * magnitude), dim=-1)
        # Kept in float32 whatever the model dtype: rotation is done in float32 (see apply_rotary).
        self.register_buffer("cos_sin_cache", table, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos_sin = self.cos_sin_cache.index_select(0, positions)
        return cos_sin.chunk(2, dim=-1)  # type: ignore[return-value]

    def step_inputs(self, positions: torch.Tensor, gather: bool = True) -> RotaryInputs:
        """The step's `RotaryInputs`; `gather=False` for a fused kernel that reads the table."""
        if not gather:
            return RotaryInputs(self.cos_sin_cache)
        cos, sin = self(positions)
        return RotaryInputs(self.cos_sin_cache, cos, sin)

    def extra_repr(self) -> str:
        return f"rotary_dim={self.rotary_dim}, max_position={self.max_position}"
