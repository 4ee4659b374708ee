"""Sizes the paged KV cache (and per-request state pools) from the memory a device has left."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import structlog
import torch

from tandem.engine_service.config import CacheConfig

log = structlog.get_logger(__name__)


class KVCacheShape(Protocol):
    """What the planner needs of a model config (our `DecoderConfig` or an HF config)."""

    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int


@dataclass(frozen=True)
class StatePoolSpec:
    """A per-request state pool to reserve before KV blocks (e.g. linear-attention state).

    `bytes_per_entry` covers every layer of one request's state; `num_entries` is how many
    requests can hold state at once.
    """

    name: str
    bytes_per_entry: int
    num_entries: int

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_entry * self.num_entries


@dataclass(frozen=True)
class MemoryPlan:
    """The outcome: how many KV blocks to allocate and how many entries each state pool gets."""

    num_blocks: int
    bytes_per_block: int
    state_pool_entries: dict[str, int] = field(default_factory=dict)
    state_pool_bytes: int = 0

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def kv_bytes_per_block(model_config: KVCacheShape, block_size: int, dtype: torch.dtype) -> int:
    """K and V for every layer: 2 x layers x block_size x kv_heads x head_dim x dtype size."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return (
        2 * model_config.num_hidden_layers * block_size * model_config.num_key_value_heads
        * model_config.head_dim * itemsize
    )


def available_bytes(device: torch.device, cache_config: CacheConfig) -> int:
    """Memory the cache may use: a fraction of free GPU memory (call after loading weights),
    or the configured CPU budget."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * cache_config.memory_fraction)
    return cache_config.cpu_kv_cache_bytes


def plan_kv_cache(
    model_config: KVCacheShape,
    cache_config: CacheConfig,
    device: torch.device | str,
    dtype: torch.dtype,
    state_pools: Sequence[StatePoolSpec] = (),
    reserved_bytes: int = 0,
) -> MemoryPlan:
    """Decide the number of KV blocks.

    State pools are reserved first (they are sized by request count, not tokens), then
    `reserved_bytes` (activation headroom), and the rest is cut into blocks.
    `cache_config.num_blocks`, when set, overrides the computed count.
    """
    device = torch.device(device)
    per_block = kv_bytes_per_block(model_config, cache_config.block_size, dtype)
    pool_bytes = sum(p.total_bytes for p in state_pools)
    entries = {p.name: p.num_entries for p in state_pools}
    if len(entries) != len(state_pools):
        raise ValueError("state pool names must be unique")
    if any(p.bytes_per_entry < 0 or p.num_entries < 0 for p in state_pools):
        raise ValueError("state pool sizes must be non-negative")
    if cache_config.num_blocks is not None:
        num_blocks = cache_config.num_blocks
    else:
        budget = available_bytes(device, cache_config)
        left = budget - pool_bytes - reserved_bytes
        num_blocks = max(left, 0) // per_block
        if num_blocks < 2:
            raise ValueError(
                f"not enough memory for the KV cache: budget {budget} B, state pools {pool_bytes} B, "
                f"reserved {reserved_bytes} B, {per_block} B per block; lower max_num_seqs/state pools "
                f"or raise the memory budget"
            )
    plan = MemoryPlan(
        num_blocks=num_blocks, bytes_per_block=per_block, state_pool_entries=entries, state_pool_bytes=pool_bytes
    )
    log.info(
        "kv cache planned", device=str(device), num_blocks=num_blocks, block_size=cache_config.block_size,
        bytes_per_block=per_block, kv_gib=round(plan.kv_cache_bytes / 2**30, 2), state_pools=entries,
    )
    return plan


def estimate_activation_bytes(
    hidden_size: int,
    intermediate_size: int,
    num_attention_heads: int,
    head_dim: int,
    vocab_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    dtype: torch.dtype,
) -> int:
    """A generous upper bound of one step's transient memory, kept free on GPU.

    Per token: residual + normed hidden, q/k/v, the gate/up/activation triple and the attention
    output, in the model dtype; plus float32 logits (and their softmax) for every sequence.
    Doubled for allocator fragmentation and the not-yet-freed inputs of each op.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_token = (4 * hidden_size + 3 * num_attention_heads * head_dim + 3 * intermediate_size) * itemsize
    logits = 2 * max_num_seqs * vocab_size * 4
    return 2 * (max_num_batched_tokens * per_token + logits)
