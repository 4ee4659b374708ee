"""What a model gets on a device before it is deployed (`tandem plan`), from the planner the
engine itself runs.

`plan_model_cache` is the one path from a model's cache layout and the engine settings to a
`MemoryPlan`: the `ModelRunner` calls it with the device it holds, and `plan_serving` with the
budget of a GPU it does not have (its free memory after the weights, the weights counted on the
meta device by `meta_model`, nothing allocated). So `tandem plan`'s blocks, slots and bytes are
the runner's for the same model, settings and free memory.

What a real GPU has free is its memory less the CUDA context and whatever else runs there;
`--gpu-memory` is that usable amount, not the card's nominal size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tandem.engine_service.cache.cache_spec import CacheLayout
from tandem.engine_service.cache.memory_plan import (
    MemoryPlan,
    budget_from_free,
    estimate_activation_bytes,
    plan_cache,
    torch_dtype_name,
)
from tandem.engine_service.config import EngineConfig

class WeightsDoNotFit(ValueError):
    """The planned GPU memory is not larger than the model's weights."""


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` -> bfloat16 on GPU, float32 on CPU (CPU half-precision matmuls are slow)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def resolve_max_model_len(max_model_len: int | None, arch: Any) -> int:
    """The context length served: the setting, else the model's `max_position_embeddings`;
    longer than the model allows is an error."""
    length = max_model_len or arch.max_position_embeddings
    if length > arch.max_position_embeddings:
        raise ValueError(f"max_model_len={length} exceeds the model's max_position_embeddings="
                         f"{arch.max_position_embeddings}")
    return length


def activation_reserve(arch: Any, config: EngineConfig, dtype: torch.dtype, device: torch.device) -> int:
    """Bytes kept free for one step's activations: `estimate_activation_bytes` on GPU, 0 on CPU
    (whose cache budget is a fixed size, `--cpu-kv-cache-gb`)."""
    if device.type != "cuda":
        return 0
    sc = config.scheduler
    return estimate_activation_bytes(arch.hidden_size, arch.intermediate_size, arch.num_attention_heads,
                                     arch.head_dim, arch.vocab_size, sc.max_num_batched_tokens, sc.max_num_seqs,
                                     dtype)


def plan_model_cache(layout: CacheLayout, arch: Any, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                     max_model_len: int, budget_bytes: int | None = None) -> MemoryPlan:
    """The cache plan of a model (its `layout`, its config `arch`) under `config` on `device`;
    `budget_bytes` None reads what the device has left (`available_bytes`)."""
    sc = config.scheduler
    return plan_cache(layout, config.cache, device, max_num_seqs=sc.max_num_seqs,
                      max_num_batched_tokens=sc.max_num_batched_tokens, max_model_len=max_model_len,
                      reserved_bytes=activation_reserve(arch, config, dtype, device), budget_bytes=budget_bytes)


@dataclass(frozen=True)
class ServingPlan:
    """A model's weights and cache plan on one device, and what that serves.

    `device_memory_bytes` is the usable GPU memory planned for (None: the engine's own device,
    CPU, whose budget is `--cpu-kv-cache-gb`)."""

    model: str
    device: str
    dtype: str
    quantization: str
    device_memory_bytes: int | None
    weight_bytes: int
    max_model_len: int
    max_num_seqs: int
    layout: CacheLayout
    memory: MemoryPlan

    def requests_at(self, context_length: int) -> int:
        """Requests of `context_length` tokens each whose whole cache fits at once: the fewest
        any paged group holds (its blocks over the blocks one such request needs), at most
        `max_num_seqs` (which is also every state group's slot count)."""
        fits = [gp.num_blocks // group.spec.blocks_per_request(context_length, self.memory.block_size)
                for group, gp in zip(self.layout.groups, self.memory.groups) if gp.paged]
        return min([self.max_num_seqs, *fits])

    def as_dict(self, context_lengths: list[int]) -> dict:
        bs = self.memory.block_size
        groups = []
        for gp in self.memory.groups:
            row = {"name": gp.name, "kind": gp.kind, "layers": len(gp.layer_ids), "total_bytes": gp.total_bytes}
            if gp.paged:
                row |= {"bytes_per_token": gp.bytes_per_block // bs, "bytes_per_block": gp.bytes_per_block,
                        "num_blocks": gp.num_blocks, "kv_tokens": gp.num_blocks * bs,
                        "sliding_window": gp.sliding_window}
            else:
                row |= {"bytes_per_slot": gp.bytes_per_slot, "num_slots": gp.num_slots,
                        "num_checkpoint_slots": gp.num_checkpoint_slots}
            groups.append(row)
        return {
            "model": self.model, "device": self.device, "dtype": self.dtype, "quantization": self.quantization,
            "device_memory_bytes": self.device_memory_bytes, "weight_bytes": self.weight_bytes,
            "budget_bytes": self.memory.budget_bytes, "reserved_bytes": self.memory.reserved_bytes,
            "kv_cache_bytes": self.memory.kv_cache_bytes, "state_bytes": self.memory.state_bytes,
            "block_size": bs, "max_model_len": self.max_model_len, "max_num_seqs": self.max_num_seqs,
            "groups": groups,
            "requests": {str(n): self.requests_at(n) for n in context_lengths},
        }


def plan_serving(config: EngineConfig, gpu_memory_bytes: int | None = None) -> ServingPlan:
    """The plan of `config`'s model: on a GPU with `gpu_memory_bytes` usable (planned for, on any
    machine), or on the engine's own CPU device when None. The model is built on the meta device
    (`meta_model`); its weights take `meta_bytes`, the rest is what the runner's free-memory reading
    would be."""
    from tandem.engine_service.worker.loader import meta_model, resolve_model
    from tandem.engine_service.worker.meta_init import meta_bytes

    mc = config.model
    if gpu_memory_bytes is None:
        device = torch.device("cpu" if mc.device == "auto" else mc.device)
        if device.type == "cuda":
            raise ValueError("planning for a GPU takes its usable memory (--gpu-memory)")
    else:
        device = torch.device("cuda")
    dtype = resolve_dtype(mc.dtype, device)
    resolved = resolve_model(mc.model, mc.cache_dir)
    # Built with CPU buffers (rotary tables, not counted): the parameters, the only thing
    # counted, are the same on every device. `auto` attention here is the PyTorch one, whose
    # parameters are those of every backend.
    backend = "torch" if mc.attention_backend == "auto" else mc.attention_backend
    model = meta_model(resolved, "cpu", dtype, backend, mc.quantization)
    weights = meta_bytes(model)
    arch = model.config
    max_len = resolve_max_model_len(mc.max_model_len, arch)
    budget = None
    if gpu_memory_bytes is not None:
        if gpu_memory_bytes <= weights:
            raise WeightsDoNotFit(f"the weights ({weights:,} B) do not fit in {gpu_memory_bytes:,} B")
        budget = budget_from_free(gpu_memory_bytes - weights, config.cache)
    layout = model.cache_layout(torch_dtype_name(dtype))
    memory = plan_model_cache(layout, arch, config, device, dtype, max_len, budget)
    quantized = any(p.dtype == torch.float8_e4m3fn for p in model.parameters())
    return ServingPlan(model=mc.model, device=device.type, dtype=torch_dtype_name(dtype),
                       quantization="fp8" if quantized else "none", device_memory_bytes=gpu_memory_bytes,
                       weight_bytes=weights, max_model_len=max_len, max_num_seqs=config.scheduler.max_num_seqs,
                       layout=layout, memory=memory)
