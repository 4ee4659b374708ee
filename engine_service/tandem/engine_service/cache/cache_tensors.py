"""Allocates the device tensors of every cache group a `MemoryPlan` sized.

Per layer of a paged attention group (full or sliding window): `[2, num_blocks + 1, block_size,
num_kv_heads, head_dim]` (K and V). Per layer of a latent group: `[num_blocks + 1, block_size,
entry_size]`. Per layer of a state group and per state shape: `[num_slots + num_checkpoint_slots
+ 1, *shape]` (request slots, then state checkpoint slots; see `state_pool.py`). The extra block /
slot past each pool is scratch, written only by padded CUDA-graph rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.engine_service.cache.cache_spec import CacheLayout, FullAttentionSpec, LatentSpec, StateSpec
from tandem.engine_service.cache.memory_plan import MemoryPlan


@dataclass
class CacheTensors:
    """The runner's cache memory. `kv_caches[layer]` is the attention cache a layer reads (None
    for a layer without one); `latent[layer]` and `state[group name][layer]` the other kinds."""

    kv_caches: list[torch.Tensor | None]
    latent: dict[int, torch.Tensor] = field(default_factory=dict)
    state: dict[str, dict[int, list[torch.Tensor]]] = field(default_factory=dict)

    def layer_caches(self) -> list:
        """Per layer, what the model's forward reads for it: the attention cache tensor, or for a
        layer with only a state (a Gated DeltaNet layer) the tuple of its state pools (one tensor
        per `StateSpec` shape, in order). A layer with both gets its attention cache here (no
        model has such a layer yet; it would read `state` itself)."""
        per_layer: list = list(self.kv_caches)
        for layers in self.state.values():
            for layer, tensors in layers.items():
                if per_layer[layer] is None:
                    per_layer[layer] = tuple(tensors)
        return per_layer

    def total_bytes(self) -> int:
        tensors = [t for t in self.kv_caches if t is not None] + list(self.latent.values())
        tensors += [t for layers in self.state.values() for ts in layers.values() for t in ts]
        return sum(t.numel() * t.element_size() for t in tensors)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown cache dtype {name!r}")
    return dtype


def allocate_cache_tensors(
    layout: CacheLayout, plan: MemoryPlan, num_layers: int, device: torch.device
) -> CacheTensors:
    """Zeroed tensors for every group of `layout`, sized by `plan` (same group names and order)."""
    sizes = {g.name: g for g in plan.groups}
    out = CacheTensors(kv_caches=[None] * num_layers)
    bs = plan.block_size
    for group in layout.groups:
        gp = sizes[group.name]
        spec = group.spec
        for layer in group.layer_ids:
            if isinstance(spec, FullAttentionSpec):  # sliding windows included
                shape = (2, gp.num_blocks + 1, bs, spec.num_kv_heads, spec.head_dim)
                out.kv_caches[layer] = torch.zeros(shape, dtype=_dtype(spec.dtype), device=device)
            elif isinstance(spec, LatentSpec):
                shape = (gp.num_blocks + 1, bs, spec.entry_size)
                out.latent[layer] = torch.zeros(shape, dtype=_dtype(spec.dtype), device=device)
            elif isinstance(spec, StateSpec):
                out.state.setdefault(group.name, {})[layer] = [
                    torch.zeros((gp.num_slots + gp.num_checkpoint_slots + 1, *s), dtype=_dtype(d), device=device)
                    for s, d in zip(spec.shapes, spec.dtypes)
                ]
            else:  # pragma: no cover - a new spec kind must be taught here
                raise TypeError(f"no allocation for cache spec {type(spec).__name__}")
    return out
