"""Sizes every cache group of a model from the memory a device has left (`plan_cache`).

The model declares its caches as a `CacheLayout` (see `cache_spec.py`); the planner turns it
into a `MemoryPlan`: blocks per paged group, slots per state group, bytes of each. The plan
is logged one line per group and kept on the runner (`ModelRunner.memory_plan`,
`MemoryPlan.as_dict()`) so it can be reported.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Protocol

import structlog
import torch

from tandem.engine_service.cache.cache_spec import CacheGroup, CacheLayout, SlidingWindowSpec, attention_layout
from tandem.engine_service.config import CacheConfig

log = structlog.get_logger(__name__)


class KVCacheShape(Protocol):
    """What `full_attention_layout` needs of a model config (our `DecoderConfig` or an HF config)."""

    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int


def torch_dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `"bfloat16"` (the spelling cache specs use)."""
    return str(dtype).removeprefix("torch.")


def full_attention_layout(model_config: KVCacheShape, dtype: torch.dtype) -> CacheLayout:
    """One full-attention group over every layer: the layout of a plain decoder."""
    windows = (None,) * model_config.num_hidden_layers
    return attention_layout(windows, model_config.num_key_value_heads, model_config.head_dim, torch_dtype_name(dtype))


def kv_bytes_per_block(model_config: KVCacheShape, block_size: int, dtype: torch.dtype) -> int:
    """K and V for every layer: 2 x layers x block_size x kv_heads x head_dim x dtype size."""
    return full_attention_layout(model_config, dtype).groups[0].bytes_per_block(block_size)


@dataclass(frozen=True)
class GroupPlan:
    """What one cache group gets: `num_blocks` blocks (paged) or `num_slots` request slots and
    `num_checkpoint_slots` state checkpoint slots (state).

    The runner allocates one more block / slot past each (scratch for padded CUDA-graph rows);
    those are not counted here.
    """

    name: str
    kind: str
    layer_ids: tuple[int, ...]
    num_blocks: int = 0
    bytes_per_block: int = 0
    num_slots: int = 0
    bytes_per_slot: int = 0
    sliding_window: int | None = None
    num_checkpoint_slots: int = 0

    @property
    def paged(self) -> bool:
        return self.kind != "state"

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block + (self.num_slots + self.num_checkpoint_slots) * self.bytes_per_slot


@dataclass(frozen=True)
class MemoryPlan:
    """The planner's outcome for every group of a layout; group order follows the layout.

    `num_blocks` / `bytes_per_block` describe the primary (first) paged group, the one the
    scheduler's capacity is reported in.
    """

    block_size: int
    groups: tuple[GroupPlan, ...]
    budget_bytes: int | None = None  # None when `CacheConfig.num_blocks` fixed the pool
    reserved_bytes: int = 0

    @property
    def paged_groups(self) -> tuple[GroupPlan, ...]:
        return tuple(g for g in self.groups if g.paged)

    @property
    def state_groups(self) -> tuple[GroupPlan, ...]:
        return tuple(g for g in self.groups if not g.paged)

    @property
    def num_blocks(self) -> int:
        return self.paged_groups[0].num_blocks

    @property
    def bytes_per_block(self) -> int:
        return self.paged_groups[0].bytes_per_block

    @property
    def num_state_slots(self) -> int:
        """Requests that can hold state at once (0 when the layout has no state group)."""
        return max((g.num_slots for g in self.state_groups), default=0)

    @property
    def scratch_state_slot(self) -> int | None:
        """The state slot padded CUDA-graph rows write: past the request and checkpoint slots
        (the last index of every state tensor); None without state groups."""
        if not self.state_groups:
            return None
        return self.num_state_slots + self.num_checkpoint_slots

    @property
    def num_checkpoint_slots(self) -> int:
        """State checkpoint slots (prefix caching of models with state; 0 without state groups)."""
        return max((g.num_checkpoint_slots for g in self.state_groups), default=0)

    @property
    def kv_cache_bytes(self) -> int:
        return sum(g.total_bytes for g in self.paged_groups)

    @property
    def state_bytes(self) -> int:
        return sum(g.total_bytes for g in self.state_groups)

    def as_dict(self) -> dict:
        """Plain data for reports and utility calls."""
        return {
            "block_size": self.block_size,
            "budget_bytes": self.budget_bytes,
            "reserved_bytes": self.reserved_bytes,
            "kv_cache_bytes": self.kv_cache_bytes,
            "state_bytes": self.state_bytes,
            "groups": [asdict(g) | {"total_bytes": g.total_bytes} for g in self.groups],
        }


def budget_from_free(free_bytes: int, cache_config: CacheConfig) -> int:
    """The cache's share of a GPU's free memory (read after the weights are loaded)."""
    return int(free_bytes * cache_config.memory_fraction)


def available_bytes(device: torch.device, cache_config: CacheConfig) -> int:
    """Memory the cache may use: a fraction of free GPU memory (call after loading weights),
    or the configured CPU budget."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return budget_from_free(free, cache_config)
    return cache_config.cpu_kv_cache_bytes


def sliding_group_cap(group: CacheGroup, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                      max_model_len: int) -> int:
    """Blocks a sliding-window group can ever hold at once: every running request's live window,
    plus the blocks one step's chunks add before the window's tail is freed."""
    assert isinstance(group.spec, SlidingWindowSpec)
    per_request = group.spec.blocks_per_request(max_model_len, block_size)
    return max_num_seqs * per_request + -(-max_num_batched_tokens // block_size)


def plan_cache(
    layout: CacheLayout,
    cache_config: CacheConfig,
    device: torch.device | str,
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    reserved_bytes: int = 0,
    budget_bytes: int | None = None,
) -> MemoryPlan:
    """Size every group of `layout` within `budget_bytes` (default: what `device` has left,
    `available_bytes`; `tandem plan` passes the budget of a device it does not have).

    1. State groups get `max_num_seqs` slots each (one per running request), reserved first.
    2. `reserved_bytes` (activation headroom) is set aside.
    3. With prefix caching, state checkpoint slots (one slot of every state group each) take
       `state_checkpoint_memory_fraction` of what is left.
    4. The rest is cut into blocks. Full-attention and latent groups track the same tokens, so
       they get the same block count N. A sliding-window group never needs more than
       `sliding_group_cap` blocks; when that is below the even split it gets exactly that and the
       memory it leaves goes to the other groups (a model whose every paged group is windowed
       splits the budget evenly).

    `cache_config.num_blocks`, when set, gives every paged group that many blocks; checkpoints
    then take the same fraction of the blocks' and checkpoints' bytes together.
    """
    device = torch.device(device)
    bs = cache_config.block_size
    state = [
        GroupPlan(g.name, g.spec.kind, g.layer_ids, num_slots=max_num_seqs, bytes_per_slot=g.bytes_per_slot())
        for g in layout.state_groups
    ]
    paged = layout.paged_groups
    per_block = {g.name: g.bytes_per_block(bs) for g in paged}
    blocks: dict[str, int] = {}
    budget: int | None = None
    per_checkpoint = sum(s.bytes_per_slot for s in state)
    fraction = cache_config.state_checkpoint_memory_fraction if cache_config.enable_prefix_caching else 0.0
    num_checkpoints = 0
    if cache_config.num_blocks is not None:
        blocks = {g.name: cache_config.num_blocks for g in paged}
        if per_checkpoint and fraction:
            blocks_bytes = cache_config.num_blocks * sum(per_block.values())
            num_checkpoints = int(blocks_bytes * fraction / (1.0 - fraction)) // per_checkpoint
    else:
        budget = available_bytes(device, cache_config) if budget_bytes is None else budget_bytes
        state_bytes = sum(s.total_bytes for s in state)
        left = max(budget - state_bytes - reserved_bytes, 0)
        if per_checkpoint and fraction:
            num_checkpoints = int(left * fraction) // per_checkpoint
            left -= num_checkpoints * per_checkpoint
        even = left // sum(per_block.values())
        caps = {}
        if any(not isinstance(g.spec, SlidingWindowSpec) for g in paged):
            for g in paged:
                if isinstance(g.spec, SlidingWindowSpec):
                    cap = sliding_group_cap(g, bs, max_num_seqs, max_num_batched_tokens, max_model_len)
                    if cap < even:
                        caps[g.name] = cap
        rest = left - sum(caps[n] * per_block[n] for n in caps)
        n = rest // sum(per_block[g.name] for g in paged if g.name not in caps)
        blocks = {g.name: caps.get(g.name, n) for g in paged}
        if min(blocks.values()) < 2:
            raise ValueError(
                f"not enough memory for the KV cache: budget {budget} B, state {state_bytes} B, "
                f"reserved {reserved_bytes} B, {sum(per_block.values())} B per block across groups; "
                f"lower max_num_seqs or raise the memory budget"
            )
    if per_checkpoint and cache_config.enable_prefix_caching and not num_checkpoints:
        log.warning("no state checkpoints (state_checkpoint_memory_fraction 0, or too little memory): this "
                    "model gets no prefix-cache hits", bytes_per_checkpoint=per_checkpoint, fraction=fraction)
    plans: list[GroupPlan] = []
    state_by_name = {s.name: replace(s, num_checkpoint_slots=num_checkpoints) for s in state}
    for g in layout.groups:
        if g.paged:
            plans.append(GroupPlan(
                g.name, g.spec.kind, g.layer_ids, num_blocks=blocks[g.name], bytes_per_block=per_block[g.name],
                sliding_window=g.sliding_window,
            ))
        else:
            plans.append(state_by_name[g.name])
    plan = MemoryPlan(block_size=bs, groups=tuple(plans), budget_bytes=budget, reserved_bytes=reserved_bytes)
    for gp in plan.groups:
        log.info(
            "cache group planned", device=str(device), group=gp.name, kind=gp.kind, layers=len(gp.layer_ids),
            num_blocks=gp.num_blocks, block_size=bs, bytes_per_block=gp.bytes_per_block,
            sliding_window=gp.sliding_window, num_slots=gp.num_slots, bytes_per_slot=gp.bytes_per_slot,
            num_checkpoint_slots=gp.num_checkpoint_slots,
            gib=round(gp.total_bytes / 2**30, 3),
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
