"""What a model needs cached, declared per layer group (torch-free, so planners and tools import it).

A model describes its caches as a `CacheLayout`: a tuple of `CacheGroup`s, each naming the
layers it covers and one spec:

- `FullAttentionSpec`: paged K/V, every token of the context kept (Llama, Qwen3 full layers).
- `SlidingWindowSpec`: paged K/V of which only the last `sliding_window` tokens are read;
  blocks wholly before the window are given back during the request (Mistral, Qwen3 sliding
  layers, Gemma 3, gpt-oss).
- `LatentSpec`: paged entries of `entry_size` elements per token and layer (compressed or latent
  KV, e.g. DeepSeek MLA / V4).
- `StateSpec`: one slot per running request holding fixed-shape tensors (recurrent or
  convolution state of Gated DeltaNet / Mamba layers); sized by requests, not tokens.

Paged groups share the token block size (`CacheConfig.block_size`) and hand out block ids from
their own pools; a request holds one block table per paged group and, when the layout has a
state group, one state slot (the same slot index in every state group).

Invariants (checked by `CacheLayout.__post_init__`): group names are unique, every group covers
at least one layer, and a layer belongs to at most one paged group and at most one state group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Bytes per element of the dtypes a cache may hold, by their torch names.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1,
}


def dtype_bytes(dtype: str) -> int:
    """Element size of a cache dtype named as torch spells it (`bfloat16`, `float32`, ...)."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown cache dtype {dtype!r}; known: {', '.join(sorted(DTYPE_BYTES))}") from None


@dataclass(frozen=True)
class FullAttentionSpec:
    """Paged K and V of every context token: `[2, blocks, block_size, num_kv_heads, head_dim]` per layer."""

    num_kv_heads: int
    head_dim: int
    dtype: str
    kind = "full_attention"
    paged = True

    def bytes_per_token(self) -> int:
        """Bytes one token adds to one layer of this group."""
        return 2 * self.num_kv_heads * self.head_dim * dtype_bytes(self.dtype)

    def blocks_per_request(self, num_tokens: int, block_size: int) -> int:
        """Blocks a request of `num_tokens` tokens holds at most."""
        return -(-num_tokens // block_size)


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """Paged K/V read only over the last `sliding_window` tokens (the query's own included).

    A query at position p attends to keys at positions `p - sliding_window + 1 .. p` (transformers'
    convention), so once a request's next query sits at position c, every block ending before
    `c - sliding_window + 1` is dead and goes back to the pool.
    """

    sliding_window: int = 0
    kind = "sliding_window"

    def __post_init__(self) -> None:
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")

    def blocks_per_request(self, num_tokens: int, block_size: int) -> int:
        """Live blocks at most: the window (plus the one its start falls in) and the block being written."""
        window_blocks = -(-(self.sliding_window - 1) // block_size) + 2
        return min(-(-num_tokens // block_size), window_blocks)


@dataclass(frozen=True)
class LatentSpec:
    """Paged entries of `entry_size` elements per token and layer: `[blocks, block_size, entry_size]`."""

    entry_size: int
    dtype: str
    kind = "latent"
    paged = True

    def bytes_per_token(self) -> int:
        return self.entry_size * dtype_bytes(self.dtype)

    def blocks_per_request(self, num_tokens: int, block_size: int) -> int:
        return -(-num_tokens // block_size)


@dataclass(frozen=True)
class StateSpec:
    """Per-request state of fixed shapes, e.g. `((conv_dim, kernel - 1), (heads, dk, dv))` per layer.

    The runner allocates, per layer and per shape, a tensor `[num_slots + 1, *shape]` (the last
    slot is scratch for padded CUDA-graph rows); a request's state lives at its slot index.
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    kind = "state"
    paged = False

    def __post_init__(self) -> None:
        if len(self.shapes) != len(self.dtypes) or not self.shapes:
            raise ValueError("a state spec needs one dtype per shape, and at least one shape")
        if any(d < 1 for shape in self.shapes for d in shape):
            raise ValueError(f"state shapes must be positive, got {self.shapes}")

    def bytes_per_slot(self) -> int:
        """Bytes one request's state takes in one layer."""
        return sum(math.prod(s) * dtype_bytes(d) for s, d in zip(self.shapes, self.dtypes))


CacheSpec = FullAttentionSpec | SlidingWindowSpec | LatentSpec | StateSpec


@dataclass(frozen=True)
class CacheGroup:
    """Layers that share one cache spec, and so one block table (paged) or one slot (state) per request."""

    name: str
    spec: CacheSpec
    layer_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.layer_ids:
            raise ValueError(f"cache group {self.name!r} covers no layer")
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise ValueError(f"cache group {self.name!r} lists a layer twice")

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def paged(self) -> bool:
        return self.spec.paged

    @property
    def sliding_window(self) -> int | None:
        return self.spec.sliding_window if isinstance(self.spec, SlidingWindowSpec) else None

    def bytes_per_block(self, block_size: int) -> int:
        """One block of this group across all its layers (paged groups only)."""
        if not self.paged:
            raise ValueError(f"cache group {self.name!r} is not paged")
        return self.num_layers * block_size * self.spec.bytes_per_token()  # type: ignore[union-attr]

    def bytes_per_slot(self) -> int:
        """One request's state across all this group's layers (state groups only)."""
        if not isinstance(self.spec, StateSpec):
            raise ValueError(f"cache group {self.name!r} is not a state group")
        return self.num_layers * self.spec.bytes_per_slot()


@dataclass(frozen=True)
class CacheLayout:
    """Every cache group of a model. Paged groups keep their order: group 0 is the primary one
    (the block table `Sequence.block_table` names, and the one capacity is reported in)."""

    groups: tuple[CacheGroup, ...]
    _paged_index: dict[int, tuple[int, int]] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("a cache layout needs at least one group")
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ValueError(f"cache group names must be unique, got {names}")
        seen_paged: set[int] = set()
        seen_state: set[int] = set()
        for g in self.groups:
            seen = seen_paged if g.paged else seen_state
            overlap = seen.intersection(g.layer_ids)
            if overlap:
                raise ValueError(f"layers {sorted(overlap)} are in two {'paged' if g.paged else 'state'} groups")
            seen.update(g.layer_ids)
        for gi, g in enumerate(self.paged_groups):
            for j, layer in enumerate(g.layer_ids):
                self._paged_index[layer] = (gi, j)

    @property
    def paged_groups(self) -> tuple[CacheGroup, ...]:
        return tuple(g for g in self.groups if g.paged)

    @property
    def state_groups(self) -> tuple[CacheGroup, ...]:
        return tuple(g for g in self.groups if not g.paged)

    def paged_group_of(self, layer: int) -> int:
        """Index (among paged groups) of the paged group holding `layer`'s cache."""
        try:
            return self._paged_index[layer][0]
        except KeyError:
            raise ValueError(f"layer {layer} has no paged cache group") from None


def attention_layout(
    layer_windows: tuple[int | None, ...], num_kv_heads: int, head_dim: int, dtype: str
) -> CacheLayout:
    """The layout of a decoder whose layer i attends fully (`None`) or over a window of `layer_windows[i]`.

    Full layers form the group `full_attention` (listed first when present); each distinct window
    forms a group `sliding_window_<w>`.
    """
    full = tuple(i for i, w in enumerate(layer_windows) if w is None)
    groups: list[CacheGroup] = []
    if full:
        groups.append(CacheGroup("full_attention", FullAttentionSpec(num_kv_heads, head_dim, dtype), full))
    for window in sorted({w for w in layer_windows if w is not None}):
        layers = tuple(i for i, w in enumerate(layer_windows) if w == window)
        spec = SlidingWindowSpec(num_kv_heads, head_dim, dtype, sliding_window=window)
        groups.append(CacheGroup(f"sliding_window_{window}", spec, layers))
    return CacheLayout(tuple(groups))
