"""Construct a model without storage for its parameters, then give them storage once their final
dtypes are known (FP8 or the model dtype), so loading never holds the whole model in bf16.

`build_model` constructs the model inside `meta_parameters()`: every parameter a module registers
lives on the `meta` device (shape, dtype, strides, no storage), while buffers (rotary tables, ...)
and every other tensor are created for real on the default device, so what constructors compute
into buffers survives. `quantize_model` then turns layers into FP8 on meta, and `materialize`
allocates real storage for every meta tensor: the device memory peak is the model as it is served
(plus one parameter's transient allocation during construction), never the model in bf16.

Invariants `materialize` keeps:
- tensors that share a storage on meta share one real storage, at the same offsets and strides
  (a `MergedColumnLinear`'s merged weight and scale buffers and its members' row-slice
  parameters; a parameter registered under two names, such as tied embeddings, is one tensor);
- every tensor keeps its Python identity and attributes (`weight_loader`, `fp8_scale`,
  `fp8_block`, ...): its contents are swapped in place (`torch.utils.swap_tensors`), so
  references held elsewhere (closures, `fp8_scale` links, module attributes) see the real tensor;
- the new storage is uninitialised, and values a constructor wrote into a parameter are lost:
  the caller fills every parameter (checkpoint or seeded dummy weights), as the loader does.

`meta_parameters` patches `nn.Module.register_parameter` for the duration of the `with` block,
so modules other threads construct meanwhile get meta parameters too; the engine builds one
model at a time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["materialize", "meta_bytes", "meta_parameters"]

_META = torch.device("meta")


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Within the block, every parameter a module registers is moved to the meta device (its
    attributes kept); buffers and other tensors stay where the default device puts them."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device != _META:
            attrs = param.__dict__
            param = type(param)(param.to(_META), requires_grad=param.requires_grad)
            param.__dict__.update(attrs)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _meta_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every meta parameter and buffer of `model`, each tensor once (tied ones included once)."""
    found: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for t in (*module._parameters.values(), *module._buffers.values()):
            if t is not None and t.device == _META:
                found[id(t)] = t
    return list(found.values())


def _storage_groups(model: nn.Module) -> list[list[torch.Tensor]]:
    """The meta tensors of `model` grouped by the storage they share, found while every meta
    storage is alive (a storage's address is its key)."""
    groups: dict[int, list[torch.Tensor]] = {}
    for t in _meta_tensors(model):
        groups.setdefault(t.untyped_storage()._cdata, []).append(t)
    return list(groups.values())


def meta_bytes(model: nn.Module) -> int:
    """Bytes `materialize(model, ...)` would allocate: each meta storage once."""
    return sum(members[0].untyped_storage().nbytes() for members in _storage_groups(model))


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device | str) -> None:
    """Give every meta parameter and buffer of `model` uninitialised storage on `device`, keeping
    aliasing, identity and attributes (the module docstring's invariants). Raises if a meta tensor
    remains reachable from a module attribute afterwards (an alias the model keeps outside its
    parameters and buffers, which this cannot re-point)."""
    device = torch.device(device)
    for members in _storage_groups(model):
        nbytes = members[0].untyped_storage().nbytes()
        storage = torch.empty(nbytes, dtype=torch.uint8, device=device).untyped_storage()
        for t in members:
            real = torch.empty(0, dtype=t.dtype, device=device).set_(storage, t.storage_offset(), t.shape, t.stride())
            if isinstance(t, nn.Parameter):
                real = type(t)(real, requires_grad=t.requires_grad)
            attrs = t.__dict__
            torch.utils.swap_tensors(t, real)  # t now holds the real tensor; `real` the meta one
            t.__dict__.update(attrs)
    if _meta_tensors(model):
        raise RuntimeError("a parameter or buffer is still on the meta device")
    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, torch.Tensor) and value.device == _META:
                raise RuntimeError(f"{name or type(model).__name__}.{attr} is still on the meta device")
