"""One matmul for several column-parallel projections of the same input (q/k/v, gate/up).

The fused path wants `[T, q+k+v]` and `[T, 2·I]` from one GEMM each (fewer launches, one read of
the activations, and the `[T, 2I]` layout `silu_and_mul` takes). Checkpoints keep the
projections apart (`q_proj.weight`, ...), so instead of renaming parameters the merged weight
is allocated once and each projection's parameter becomes a row-slice *view* of it: loading by
name, the dummy initialiser and tied weights all work unchanged, and every write through a
projection's parameter lands in the merged tensor.

The views stay valid as long as nobody replaces the parameters' storage (`module.to(...)`,
`param.data = ...`); the engine never does once a model is built (`worker/meta_init.py`, which
gives meta-built models their storage, keeps each view on its merged storage).

`MergedColumnLinear` holds the merged tensors as a module (non-persistent buffers: the
checkpoint names stay the projections'); `to_fp8` re-merges them as FP8 with merged block scales,
each projection's weight and scale again views of them (`layers/fp8.py`).
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.engine_service.layers.fp8 import new_scale, part_block
from tandem.engine_service.layers.linear import ColumnParallelLinear, apply_linear
from tandem.kernels.fp8_gemm import FP8_DTYPE


def _merge(params: list[nn.Parameter]) -> torch.Tensor:
    first = params[0]
    rows = sum(p.shape[0] for p in params)
    return torch.empty((rows, *first.shape[1:]), dtype=first.dtype, device=first.device)


def _alias(module: nn.Module, name: str, old: nn.Parameter, view: torch.Tensor) -> None:
    param = nn.Parameter(view, requires_grad=old.requires_grad)
    loader = getattr(old, "weight_loader", None)
    if loader is not None:
        param.weight_loader = loader  # type: ignore[attr-defined]
    # Re-registering under the same name keeps the parameter order (and so the order in which
    # the seeded dummy initialiser draws), identical to the unmerged model's.
    setattr(module, name, param)


def merge_column_linears(linears: list[ColumnParallelLinear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Re-point the weights (and biases) of `linears` at row slices of one merged tensor.

    Returns `(weight [sum(out), in], bias [sum(out)] or None)`; `F.linear(x, weight, bias)` then
    equals the concatenation of the projections' outputs. Call before weights are loaded (the
    merged storage starts uninitialised).
    """
    if not linears:
        raise ValueError("nothing to merge")
    in_features = {lin.in_features for lin in linears}
    if len(in_features) != 1:
        raise ValueError(f"projections read different input sizes: {sorted(in_features)}")
    has_bias = {lin.bias is not None for lin in linears}
    if len(has_bias) != 1:
        raise ValueError("either every merged projection has a bias or none does")

    weight = _merge([lin.weight for lin in linears])
    bias = _merge([lin.bias for lin in linears]) if has_bias == {True} else None  # type: ignore[misc]
    row = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        _alias(lin, "weight", lin.weight, weight[row : row + rows])
        if bias is not None:
            assert lin.bias is not None
            _alias(lin, "bias", lin.bias, bias[row : row + rows])
        row += rows
    return weight, bias


class MergedColumnLinear(nn.Module):
    """One GEMM over `linears` (column-parallel projections of the same input), their outputs
    concatenated in order. Owns no parameters: its `weight`/`bias` buffers are the merged storage
    the projections' parameters are views of (see `merge_column_linears`)."""

    def __init__(self, linears: list[ColumnParallelLinear]) -> None:
        super().__init__()
        self._members = tuple(linears)  # a tuple: not registered as submodules, no duplicate names
        weight, bias = merge_column_linears(linears)
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.register_buffer("weight_scale_inv", None, persistent=False)
        self.weight_block: tuple[int, int] | None = None

    @property
    def members(self) -> tuple[ColumnParallelLinear, ...]:
        return self._members

    def to_fp8(self, block: tuple[int, int]) -> None:
        """Hold the merged weight as FP8 with block scales, each projection a row slice of both.
        Projections that are not a whole number of blocks high get one-row blocks."""
        rows = [lin.out_features for lin in self._members]
        block = part_block(block, rows)
        weight = torch.empty(self.weight.shape, dtype=FP8_DTYPE, device=self.weight.device)
        scale = new_scale(tuple(weight.shape), block, weight.device)
        row = 0
        for lin, n in zip(self._members, rows):
            view = nn.Parameter(scale[row // block[0]: (row + n + block[0] - 1) // block[0]], requires_grad=False)
            lin.to_fp8(block, weight[row: row + n], view)
            row += n
        self.weight = weight
        self.weight_scale_inv = scale.data
        self.weight_block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_linear(x, self.weight, self.bias, self.weight_scale_inv, self.weight_block)
