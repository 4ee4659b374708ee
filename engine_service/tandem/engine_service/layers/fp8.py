"""FP8 weight parameters: how a layer holds e4m3 weights and their block scales, and loads them.

An FP8 weight parameter is a `float8_e4m3fn` tensor `[..., N, K]` that carries two attributes:
`fp8_block = (bn, bk)` and `fp8_scale`, its float32 scale parameter `[..., ceil(N/bn),
ceil(K/bk)]` (`tandem.kernels.fp8_gemm`'s layout; the real weight is fp8 · scale over each
block). Per-channel weights use `PER_CHANNEL`, a block one row high and wider than any row, so
their scales are `[..., N, 1]`. The scale parameter is registered next to the weight under the
weight's name + `_scale_inv` (`q_proj.weight_scale_inv`, `experts.gate_up_proj_scale_inv`), the
name checkpoints use.

Loading writes row ranges (one projection of a merged weight, one expert of a stacked one):
`load_rows` takes an FP8 tensor as stored, or quantizes a float one into the parameter's blocks
(the `--quantization fp8` path); `load_scale_rows` converts a checkpoint's scales into the
parameter's blocks. Invariant: a row range starts on a block boundary of the parameter (merged
and stacked weights whose parts are not whole blocks high use one-row blocks; see
`part_block`).
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.kernels.fp8_gemm import FP8_DTYPE, expand_scale_rows, quantize, scale_shape

__all__ = ["PER_CHANNEL", "SCALE_SUFFIX", "fp8_parameter", "is_fp8", "load_rows", "load_scale_rows",
           "new_scale", "part_block", "scale_of"]

PER_CHANNEL = (1, 1 << 30)  # one scale per output row: a block wider than any row
SCALE_SUFFIX = "_scale_inv"


def part_block(block: tuple[int, int], part_rows: list[int]) -> tuple[int, int]:
    """The block of a weight stacked from parts of `part_rows` rows: `block` when every part is
    a whole number of blocks high (their scale rows then stack too), else one-row blocks with
    the same width (each part's scales expanded to one per row)."""
    if all(rows % block[0] == 0 for rows in part_rows):
        return block
    return 1, block[1]


def fp8_parameter(data: torch.Tensor, block: tuple[int, int], scale: nn.Parameter) -> nn.Parameter:
    """Wrap FP8 storage `data` (fresh, or a view of merged storage) as a weight parameter whose
    scales are `scale`; its `weight_loader` fills it from a checkpoint tensor."""
    if data.dtype != FP8_DTYPE:
        raise TypeError(f"FP8 weights are {FP8_DTYPE}, got {data.dtype}")
    want = (*data.shape[:-2], *scale_shape(data.shape[-2], data.shape[-1], block))
    if tuple(scale.shape) != want:
        raise ValueError(f"scale {list(scale.shape)} does not fit weight {list(data.shape)} in blocks {block}")
    param = nn.Parameter(data, requires_grad=False)
    param.fp8_block = block  # type: ignore[attr-defined]
    param.fp8_scale = scale  # type: ignore[attr-defined]
    param.weight_loader = _load_whole  # type: ignore[attr-defined]
    return param


def new_scale(weight_shape: tuple[int, ...], block: tuple[int, int], device: torch.device) -> nn.Parameter:
    """An uninitialised float32 scale parameter for a weight of `weight_shape` in `block` blocks."""
    shape = (*weight_shape[:-2], *scale_shape(weight_shape[-2], weight_shape[-1], block))
    return nn.Parameter(torch.empty(shape, dtype=torch.float32, device=device), requires_grad=False)


def is_fp8(param: torch.Tensor) -> bool:
    return getattr(param, "fp8_scale", None) is not None


def scale_of(param: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]] | None:
    """`(scale, block)` of an FP8 weight parameter, None for any other tensor."""
    scale = getattr(param, "fp8_scale", None)
    return None if scale is None else (scale, param.fp8_block)  # type: ignore[attr-defined]


def _load_whole(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    load_rows(param, param.fp8_scale, param.fp8_block, 0, loaded)  # type: ignore[attr-defined]


@torch.no_grad()
def load_rows(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], row0: int,
              loaded: torch.Tensor) -> None:
    """Write `loaded [rows, K]` into rows `row0:` of FP8 `weight [N, K]` (scales `scale` of the
    whole weight, blocks `block`): an FP8 tensor is copied as stored (its scales come through
    `load_scale_rows`), a float tensor is quantized here, scales included."""
    rows = loaded.shape[-2]
    if row0 % block[0]:
        raise ValueError(f"rows {row0}.. do not start on a {block[0]}-row block boundary")
    target = weight.narrow(-2, row0, rows)
    if tuple(target.shape) != tuple(loaded.shape):
        raise ValueError(f"shape mismatch: rows {tuple(target.shape)} vs checkpoint {tuple(loaded.shape)}")
    if loaded.dtype == FP8_DTYPE:
        target.copy_(loaded)
        return
    q, s = quantize(loaded.to(target.device), block)
    target.copy_(q)
    scale.narrow(-2, row0 // block[0], s.shape[-2]).copy_(s)


@torch.no_grad()
def load_scale_rows(scale: torch.Tensor, block: tuple[int, int], row0: int, rows: int, cols: int,
                    loaded: torch.Tensor, loaded_block: tuple[int, int]) -> None:
    """Write a checkpoint's scales of `rows x cols` weight rows (blocks `loaded_block`; a
    per-tensor scalar or a per-channel `[rows]` is accepted too) into `scale` (blocks `block`)
    from weight row `row0` on. Raises where the blocks do not convert exactly."""
    src = loaded.float().reshape(-1, 1) if loaded.dim() < 2 else loaded.float()
    if src.numel() == 1:
        src = src.reshape(1, 1)
    if block[0] != loaded_block[0] and src.shape[0] > 1:
        if block[0] != 1:
            raise ValueError(f"scales of {loaded_block} blocks do not convert to {block} blocks")
        src = expand_scale_rows(src, rows, loaded_block[0])
    want = scale_shape(rows, cols, block)
    if src.shape[0] == 1 and want[0] > 1:  # one scale for every row (per-tensor)
        src = src.expand(want[0], src.shape[1])
    if src.shape[1] != want[1]:
        if src.shape[1] != 1:
            raise ValueError(f"scales of {loaded_block} blocks do not convert to {block} blocks")
        src = src.expand(src.shape[0], want[1])  # a per-row scale repeated over column blocks
    if tuple(src.shape) != want:
        raise ValueError(f"scale shape {tuple(loaded.shape)} does not fit {rows}x{cols} weight rows in "
                         f"{loaded_block} blocks")
    if row0 % block[0]:
        raise ValueError(f"rows {row0}.. do not start on a {block[0]}-row block boundary")
    scale.narrow(-2, row0 // block[0], want[0]).copy_(src)
