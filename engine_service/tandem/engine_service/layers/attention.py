"""Attention over the paged KV cache: step metadata, the KV write, and the backend seam.

KV cache layout (one tensor per layer): `[2, num_blocks, block_size, num_kv_heads, head_dim]`,
index 0 = K, 1 = V. Token position p of a sequence lives at slot
`block_table[p // block_size] * block_size + p % block_size` of the flattened
`num_blocks * block_size` axis.

`select_attention_backend` (`layers/backend_select.py`, which imports both this module and
`layers/triton_backend.py`, so neither imports the other back) is the one place that decides which
implementation runs: the Triton kernels on CUDA, the PyTorch reference on CPU, or what
`ModelConfig.attention_backend` asks for.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class StateSplit:
    """How a mixed step's rows divide between the two state-kernel sets (Gated DeltaNet layers).

    Rows that continue a state with one token ("state decodes": one scheduled token and
    `has_initial_state`) run the single-token kernels, the others (prompt chunks, fresh rows) the
    varlen ones, so a decode row's numerics never depend on what else is in the step. The layer
    works in a *split order* with the `num_decodes` decode rows first: token row r of that order
    is row `rows[r]` of the step (`rows` is None when the decode rows already are the step's
    first rows, and the order is the step's own). Built on the host with the step's other arrays
    (`input_batch.plan_state_split`); None on steps that are not mixed (pure state decode, or no
    decode row at all).
    """

    num_decodes: int  # D (host int): decode rows, and decode sequences (one row each)
    rows: torch.Tensor | None  # [T] int64 step row of each split-order row, or None (identity)
    state_indices: torch.Tensor  # [B] int32: each sequence's state slot, in split order
    has_initial_state: torch.Tensor  # [B - D] bool: of the non-decode sequences
    query_start_loc: torch.Tensor  # [B - D + 1] int32: row offsets of the non-decode sequences, from 0


@dataclass
class AttentionMetadata:
    """Per-step description of the flat token batch, built once and passed to every layer.

    The batch is B sequences whose new tokens are concatenated into T rows. Device tensors
    serve the kernels; the `*_cpu` lists serve the reference path (which loops per sequence)
    without forcing device-to-host syncs.
    """

    positions: torch.Tensor  # [T] int64: position of each token in its sequence
    slot_mapping: torch.Tensor  # [T] int64: cache slot each token's K/V is written to
    query_start_loc: torch.Tensor  # [B+1] int32: row offsets of each sequence's tokens
    seq_lens: torch.Tensor  # [B] int32: context length including this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0 (never read past seq_len)
    logits_indices: torch.Tensor  # [S] int64: row of the last token of each sampling sequence
    seq_lens_cpu: list[int]
    query_lens_cpu: list[int]
    # Split-KV factor for the decode kernel; fixed per batch bucket by a captured CUDA graph
    # (a graph replays one launch configuration), None lets the kernel choose from shapes.
    decode_num_splits: int | None = None
    # (block_tables, slot_mapping) of paged cache groups 1, 2, ...; the fields above are group 0's.
    extra_groups: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
    # Models with state cache groups (Gated DeltaNet): each sequence's slot in the state pools
    # ([B] int32; padded CUDA-graph rows hold the scratch slot), and whether that slot already
    # holds the sequence's state ([B] bool; False on its first chunk after admission or resume,
    # so the kernels start from zeros whatever a previous owner left). None without state groups.
    state_indices: torch.Tensor | None = None
    has_initial_state: torch.Tensor | None = None
    # Host copy of `has_initial_state`: a pure-decode step takes the single-token state kernels
    # only when every sequence continues a state (a 1-token prompt is a "decode" that starts one).
    has_initial_state_cpu: list[bool] | None = None
    # Mixed steps with state groups: which rows take the single-token state kernels (see
    # `StateSplit`); None when the step is a pure state decode or has no state-decode row.
    state_split: StateSplit | None = None
    _group_views: dict[int, "AttentionMetadata"] = field(default_factory=dict, repr=False, compare=False)

    def for_group(self, group: int) -> "AttentionMetadata":
        """This step's metadata as paged cache group `group`'s layers see it (its block table and
        slot mapping; everything else shared)."""
        if group == 0:
            return self
        view = self._group_views.get(group)
        if view is None:
            if group > len(self.extra_groups):
                raise ValueError(f"the step has no block tables for cache group {group}")
            tables, slots = self.extra_groups[group - 1]
            view = replace(self, block_tables=tables, slot_mapping=slots, extra_groups=(), _group_views={})
            self._group_views[group] = view
        return view

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    # Cached: every layer asks, and a Python scan per layer adds up at 256 sequences.
    @cached_property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @cached_property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    @cached_property
    def is_pure_decode(self) -> bool:
        """Every sequence contributes exactly one token (the decode-kernel fast path)."""
        return all(q == 1 for q in self.query_lens_cpu)

    @cached_property
    def is_state_decode(self) -> bool:
        """Pure decode where every sequence continues its state (the single-token state kernels)."""
        return self.is_pure_decode and all(self.has_initial_state_cpu or ())

    @cached_property
    def num_state_decodes(self) -> int:
        """Sequences that continue their state with one token (0 without state groups)."""
        if self.has_initial_state_cpu is None:
            return 0
        return sum(1 for q, h in zip(self.query_lens_cpu, self.has_initial_state_cpu) if q == 1 and h)


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store `k`, `v` (`[T, num_kv_heads, head_dim]`) at their slots of one layer's cache."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def gather_kv(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, first_block: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V (`[seq_len - first_block * block_size, num_kv_heads, head_dim]`) of positions
    `first_block * block_size .. seq_len - 1` of one sequence (earlier blocks are not read)."""
    block_size = kv_cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    blocks = kv_cache[:, block_table[first_block:num_blocks].long()]  # [2, n, block_size, kvh, d]
    flat = blocks.flatten(1, 2)[:, : seq_len - first_block * block_size]
    return flat[0], flat[1]


def paged_attention_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached context, in float32.

    `q` is `[T, num_heads, head_dim]`; the K/V of this step must already be in the cache. The
    query rows of a sequence sit at positions `seq_len - q_len .. seq_len - 1`. With a
    `sliding_window` W, the query at position p sees keys `p - W + 1 .. p` only, and blocks
    wholly before the first query's window are not read (they may have been given back).
    """
    num_heads = q.shape[1]
    num_kv_heads = kv_cache.shape[3]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    start = 0
    block_size = kv_cache.shape[2]
    for i, (q_len, seq_len) in enumerate(zip(metadata.query_lens_cpu, metadata.seq_lens_cpu)):
        first_block = 0
        if sliding_window is not None:
            first_block = max(0, seq_len - q_len - sliding_window + 1) // block_size
        k, v = gather_kv(kv_cache, metadata.block_tables[i], seq_len, first_block)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(first_block * block_size, seq_len, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # [q_len, keys], True = attend
        if sliding_window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
        qi = q[start : start + q_len].transpose(0, 1).float()  # [heads, q_len, d]
        ki = k.repeat_interleave(group, dim=1).transpose(0, 1).float()
        vi = v.repeat_interleave(group, dim=1).transpose(0, 1).float()
        oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
        out[start : start + q_len] = oi.transpose(0, 1).to(q.dtype)
        start += q_len
    return out


class AttentionBackend(Protocol):
    """An implementation of paged attention: store this step's K/V, attend over the cache.

    `fused_layers`: the model built on this backend uses the fused Triton layer kernels
    (add + RMSNorm, SiLU·mul, merged projections) and calls `forward_rotary`, which applies
    RoPE (after the per-head q/k norm, for Qwen3) and stores K/V in one kernel.
    `supports_cuda_graphs`: `forward` has no host syncs and no data-dependent shapes, so decode
    steps can be captured.
    """

    name: str
    fused_layers: bool
    supports_cuda_graphs: bool

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,  # keys p - W + 1 .. p only; a per-layer constant
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        ...


class TorchReferenceBackend:
    """Plain PyTorch paged attention (per-sequence SDPA); correct everywhere, fast nowhere."""

    name = "torch-reference"
    fused_layers = False
    # Loops over sequences with host-side lengths: shapes change with the data.
    supports_cuda_graphs = False

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        write_kv(k, v, kv_cache, metadata.slot_mapping)
        return paged_attention_reference(q, kv_cache, metadata, scale, sliding_window)


class Attention(nn.Module):
    """Multi-head / grouped-query attention of one layer over its paged KV cache.

    Holds the head geometry and softmax scale; delegates the work to the backend chosen by
    `select_attention_backend`, shared by every layer of a model.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        backend: AttentionBackend,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend = backend
        # Fixed per layer, so a captured CUDA graph bakes it in as a kernel argument.
        self.sliding_window = sliding_window

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """`q [T, heads, d]`, `k`/`v [T, kv_heads, d]` -> `[T, heads * d]`."""
        out = self.backend.forward(q, k, v, kv_cache, metadata, self.scale, self.sliding_window)
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)

    def forward_rotary(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        cos_sin_cache: torch.Tensor,
        q_norm_weight: torch.Tensor | None = None,
        k_norm_weight: torch.Tensor | None = None,
        eps: float = 1e-6,
    ) -> torch.Tensor:
        """As `forward`, with q/k not yet rotated: the backend applies RoPE at
        `metadata.positions` from `cos_sin_cache` while it stores K/V (fused backends only),
        after RMS-normalising each q and k head with the given weights (both or neither)."""
        rotary = getattr(self.backend, "forward_rotary", None)
        if rotary is None:
            raise TypeError(f"attention backend {self.backend.name!r} cannot fuse RoPE")
        out = rotary(
            q, k, v, kv_cache, metadata, self.scale, cos_sin_cache, q_norm_weight, k_norm_weight, eps,
            sliding_window=self.sliding_window,
        )
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"backend={self.backend.name}, sliding_window={self.sliding_window}"
        )
