"""Which layers hold FP8 weights, decided once before weights load (`--quantization`).

- `auto` (default): what the checkpoint stores. A checkpoint whose `config.json` has
  `quantization_config.quant_method == "fp8"` (DeepSeek's and Qwen's block-wise layout: e4m3
  `X.weight` plus a float32 `X.weight_scale_inv` per `weight_block_size` block; per-channel or
  per-tensor scales when no block size is given) keeps FP8 exactly the layers it stores as FP8;
  any other checkpoint loads in the model dtype.
- `fp8`: the same for an FP8 checkpoint; a bf16/fp32 checkpoint (or dummy weights) is quantized
  on load to 128x128 blocks, every linear layer and the routed experts except the LM head and
  the MoE routers (`gate`, `shared_expert_gate`), which stay exact.
- `none`: every layer in the model dtype; FP8 tensors are dequantized on load.

A merged projection (q/k/v, gate/up, the MoE router with the shared expert's gate/up) is FP8
only if all its parts are; otherwise its FP8 parts are dequantized on load. `CheckpointFp8`
tells the loader which stored tensors are scales and how to dequantize a stored FP8 tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tandem.engine_service.layers.fp8 import PER_CHANNEL, load_scale_rows, scale_of
from tandem.engine_service.layers.linear import _ShardedLinear
from tandem.engine_service.layers.merged_linear import MergedColumnLinear
from tandem.engine_service.layers.moe import ExpertWeights, per_expert_checkpoint_name
from tandem.kernels.fp8_gemm import dequantize

__all__ = ["DEFAULT_BLOCK", "KEPT_EXACT", "QUANTIZATION_CHOICES", "CheckpointFp8", "quantize_model",
           "read_checkpoint_fp8"]

QUANTIZATION_CHOICES = ("auto", "none", "fp8")
DEFAULT_BLOCK = (128, 128)  # the block of on-load quantization, as the published checkpoints use
KEPT_EXACT = ("lm_head", "gate", "shared_expert_gate")  # last name component; never quantized on load
_SCALE_NAMES = (".weight_scale_inv", ".weight_scale")


def _quantization_config(config: dict[str, Any]) -> dict[str, Any] | None:
    qc = config.get("quantization_config")
    if qc is None and isinstance(config.get("text_config"), dict):
        qc = config["text_config"].get("quantization_config")
    return qc


@dataclass(frozen=True)
class CheckpointFp8:
    """An FP8 checkpoint's layout: its scale block (`PER_CHANNEL` for per-channel or per-tensor
    scales) and, per stored FP8 weight name, the stored name of its scales."""

    block: tuple[int, int]
    scales: dict[str, str]

    def scale_weight_name(self, stored: str) -> str | None:
        """For a stored scale tensor, the stored name of its weight; None for any other tensor."""
        for suffix in _SCALE_NAMES:
            if stored.endswith(suffix):
                weight = stored[: -len(suffix)] + ".weight"
                return weight if self.scales.get(weight) == stored else None
        return None

    def dequantize(self, stored: str, weight: torch.Tensor, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """The stored FP8 `weight` times its scales (read with `read`), in float32."""
        scale_name = self.scales.get(stored)
        if scale_name is None:
            raise ValueError(f"{stored} is FP8 but the checkpoint has no scales for it")
        rows, cols = weight.shape
        full = torch.empty(rows, 1 if self.block == PER_CHANNEL else -(-cols // self.block[1]))
        block = PER_CHANNEL if self.block == PER_CHANNEL else (1, self.block[1])
        load_scale_rows(full, block, 0, rows, cols, read(scale_name), self.block)
        return dequantize(weight, full, block)


def read_checkpoint_fp8(config: dict[str, Any], names: Iterable[str]) -> CheckpointFp8 | None:
    """The FP8 layout of a checkpoint with `config` and stored tensor `names`, None when its
    config declares no quantization. Raises for quantization methods other than `fp8`."""
    qc = _quantization_config(config)
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method != "fp8":
        raise ValueError(f"checkpoint quantization {method!r} is not supported (only quant_method fp8)")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"FP8 format {qc.get('fmt')!r} is not supported (only e4m3)")
    size = qc.get("weight_block_size")
    block = (int(size[0]), int(size[1])) if size else PER_CHANNEL
    names = set(names)
    scales: dict[str, str] = {}
    for name in names:
        for suffix in _SCALE_NAMES:
            if name.endswith(suffix) and name[: -len(suffix)] + ".weight" in names:
                scales[name[: -len(suffix)] + ".weight"] = name
    return CheckpointFp8(block, scales)


def _scale_loader(loaded_block: tuple[int, int], weight: nn.Parameter) -> Callable[[nn.Parameter, torch.Tensor], None]:
    def load(param: nn.Parameter, loaded: torch.Tensor) -> None:
        _, block = scale_of(weight)  # type: ignore[misc]
        load_scale_rows(param, block, 0, weight.shape[-2], weight.shape[-1], loaded, loaded_block)

    return load


def quantize_model(model: nn.Module, setting: str, checkpoint: CheckpointFp8 | None,
                   rename: Callable[[str], str | None] | None = None) -> tuple[int, int] | None:
    """Turn the layers `setting` asks for into FP8 (see the module docstring), before loading.

    Returns the block the model's FP8 layers use (None: nothing is FP8). Each FP8 linear's scale
    parameter gets a loader that converts the checkpoint's scale blocks into the layer's."""
    if setting not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {setting!r}")
    if setting == "none" or (checkpoint is None and setting == "auto"):
        return None
    if checkpoint is not None:
        block = checkpoint.block
        stored = {rename(n) if rename else n for n in checkpoint.scales}
        fp8_names = {n for n in stored if n is not None}
        fp8_names |= {p[0] for p in map(per_expert_checkpoint_name, fp8_names) if p is not None}

        def wanted(module: str, param: str = "weight") -> bool:
            return f"{module}.{param}" in fp8_names
    else:
        block = DEFAULT_BLOCK

        def wanted(module: str, param: str = "weight") -> bool:
            return module.rsplit(".", 1)[-1] not in KEPT_EXACT

    names = {id(m): n for n, m in model.named_modules()}
    merged_members: set[int] = set()
    for module in list(model.modules()):
        if isinstance(module, MergedColumnLinear):
            merged_members |= {id(m) for m in module.members}
            if all(wanted(names[id(m)]) for m in module.members):
                module.to_fp8(block)
    for name, module in list(model.named_modules()):
        if isinstance(module, _ShardedLinear) and id(module) not in merged_members and wanted(name):
            module.to_fp8(block)
        elif isinstance(module, ExpertWeights) and wanted(name, "gate_up_proj") and wanted(name, "down_proj"):
            module.to_fp8(block)
    for module in model.modules():
        if isinstance(module, _ShardedLinear) and module.weight_block is not None:
            module.weight_scale_inv.weight_loader = _scale_loader(block, module.weight)  # type: ignore
    return block if any(scale_of(p) for p in model.parameters()) else None

