"""Linear layers shaped for tensor parallelism (column- and row-sharded), uninitialised.

With `tp_size == 1` both are a plain `y = x @ W.T + b`. Each parameter carries a
`weight_loader(param, full_tensor)` that copies its own shard out of the full checkpoint
tensor, so the weight loader stays the same when tensor parallelism arrives.

`to_fp8(block)` turns a layer's weight into FP8 with block scales (`layers/fp8.py`) before
weights load; its forward then runs the W8A16 GEMM (`tandem.kernels.fp8_gemm.fp8_linear`).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tandem.engine_service.layers.fp8 import SCALE_SUFFIX, fp8_parameter, new_scale
from tandem.kernels.fp8_gemm import FP8_DTYPE, fp8_linear

WeightLoader = Callable[[nn.Parameter, torch.Tensor], None]


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Copy a full checkpoint tensor into `param`, casting dtype and moving device."""
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


def apply_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 scale: torch.Tensor | None = None, block: tuple[int, int] | None = None) -> torch.Tensor:
    """`x @ W.T + b`: `F.linear`, or the W8A16 GEMM when `weight` is FP8 with `scale` in `block`s."""
    if scale is None:
        return F.linear(x, weight, bias)
    assert block is not None
    return fp8_linear(x, weight, scale, block, bias)


def _sharded_loader(dim: int, rank: int, size: int) -> WeightLoader:
    def load(param: nn.Parameter, loaded: torch.Tensor) -> None:
        if size > 1:
            shard = loaded.shape[dim] // size
            loaded = loaded.narrow(dim, rank * shard, shard)
        default_weight_loader(param, loaded)

    return load


def _split(n: int, tp_size: int, what: str) -> int:
    if n % tp_size:
        raise ValueError(f"{what}={n} is not divisible by tp_size={tp_size}")
    return n // tp_size


class _ShardedLinear(nn.Module):
    """Holds one rank's uninitialised weight shard (split along `shard_dim`) and its loaders."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, shard_dim: int, tp_rank: int, tp_size: int
    ) -> None:
        super().__init__()
        self.in_features = in_features  # this rank's shard
        self.out_features = out_features
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = _sharded_loader(shard_dim, tp_rank, tp_size)  # type: ignore[attr-defined]
        if bias:
            self.bias: nn.Parameter | None = nn.Parameter(torch.empty(out_features), requires_grad=False)
            # A column shard owns a slice of the bias; a row shard's bias is the full vector.
            loader = _sharded_loader(0, tp_rank, tp_size) if shard_dim == 0 else default_weight_loader
            self.bias.weight_loader = loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)
        self.register_parameter("weight" + SCALE_SUFFIX, None)  # set by to_fp8
        self.weight_block: tuple[int, int] | None = None

    def to_fp8(self, block: tuple[int, int], storage: torch.Tensor | None = None,
               scale: nn.Parameter | None = None) -> None:
        """Hold the weight as FP8 in `block` blocks (before loading: the storage starts empty).
        A merged projection passes its row slices of the merged `storage` and `scale`."""
        if self.tp_size > 1:
            raise NotImplementedError("FP8 weights with tensor parallelism")
        shape = tuple(self.weight.shape)
        if storage is None:
            storage = torch.empty(shape, dtype=FP8_DTYPE, device=self.weight.device)
        if scale is None:
            scale = new_scale(shape, block, self.weight.device)
        self.weight = fp8_parameter(storage, block, scale)
        setattr(self, "weight" + SCALE_SUFFIX, scale)
        self.weight_block = block

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return apply_linear(x, self.weight, bias, self.weight_scale_inv, self.weight_block)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, "
            f"tp={self.tp_rank}/{self.tp_size}" + (f", fp8 blocks {self.weight_block}" if self.weight_block else "")
        )


class ColumnParallelLinear(_ShardedLinear):
    """Linear whose output features are split across tensor-parallel ranks (no communication)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        super().__init__(in_features, _split(out_features, tp_size, "out_features"), bias, 0, tp_rank, tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.bias)


class RowParallelLinear(_ShardedLinear):
    """Linear whose input features are split across ranks; partial outputs are all-reduced."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        super().__init__(_split(in_features, tp_size, "in_features"), out_features, bias, 1, tp_rank, tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._linear(x, self.bias)
        out = self._linear(x, None)
        dist.all_reduce(out)
        # The bias is added once, after the reduction, not once per rank.
        return out if self.bias is None else out + self.bias
