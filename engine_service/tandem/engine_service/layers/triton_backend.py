"""Paged attention on the Triton kernels of `tandem.kernels` (the CUDA path).

One step = store this step's K/V into the paged cache (fused with RoPE, and with Qwen3's q/k
norm, when the model asks: `forward_rotary`), then attend: the split-KV decode kernel when every
sequence brings exactly one token, the variable-length prefill kernel otherwise (it reads
prefix-cache hits and earlier chunks straight from the pool, so chunked prefill needs no special
case).

Nothing here reads a device tensor on the host: the kernels are sized from shapes and from the
host-side lists of `AttentionMetadata` (`max_query_len`, `is_pure_decode`), so a step issues no
device-to-host sync and a decode step can be captured in a CUDA graph.

The attend half is the one launch whose grid depends on the step's sequence lengths. Steps with
prefill rows are captured in pieces around it (`worker/piecewise_graphs.py`), which install an
`attend_hook` while they capture: the hook ends one piece, and the attention itself runs eagerly
between two replayed pieces.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tandem.engine_service.layers.attention import AttentionMetadata
from tandem.kernels.kv_store import store_kv
from tandem.kernels.paged_attention import paged_decode_attention, paged_prefill_attention
from tandem.kernels.rotary import rope_and_store_kv


class TritonAttentionBackend:
    """Paged attention through the Triton kernels; runs on CUDA, and on CPU under TRITON_INTERPRET=1."""

    name = "triton"
    fused_layers = True
    supports_cuda_graphs = True

    def __init__(self) -> None:
        # Called instead of `attend_paged` while set: (q, kv_cache, metadata, scale, sliding_window) -> out.
        self.attend_hook: Callable[..., torch.Tensor] | None = None

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
        """q/k already rotated: store K/V at `metadata.slot_mapping`, then attend."""
        store_kv(k, v, kv_cache, metadata.slot_mapping)
        return self._attend(q, kv_cache, metadata, scale, sliding_window)

    def forward_rotary(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        cos_sin_cache: torch.Tensor,
        q_norm_weight: torch.Tensor | None = None,
        k_norm_weight: torch.Tensor | None = None,
        eps: float = 1e-6,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Rotate q and k in place at `metadata.positions` and store K/V in the same kernel, then
        attend. `q`/`k`/`v` may be strided views of one fused projection output. With the norm
        weights the same kernel first RMS-normalises each q and k head (Qwen3's q/k norm)."""
        rope_and_store_kv(
            metadata.positions, q, k, v, cos_sin_cache, kv_cache, metadata.slot_mapping,
            q_norm_weight, k_norm_weight, eps,
        )
        return self._attend(q, kv_cache, metadata, scale, sliding_window)

    def _attend(
        self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        if self.attend_hook is not None:
            return self.attend_hook(q, kv_cache, metadata, scale, sliding_window)
        return attend_paged(q, kv_cache, metadata, scale, sliding_window)


def attend_paged(
    q: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
    sliding_window: int | None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of `q` over the cache (its K/V already stored): the split-KV decode kernel when
    every sequence brings one token, else the variable-length prefill kernel. `out` (contiguous,
    q's shape) is written when given, else a fresh tensor (q may be a strided view of the qkv
    projection)."""
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if metadata.is_pure_decode:
        return paged_decode_attention(
            q, kv_cache, metadata.block_tables, metadata.seq_lens, scale,
            num_splits=metadata.decode_num_splits, out=out, sliding_window=sliding_window,
        )
    return paged_prefill_attention(
        q, kv_cache, metadata.query_start_loc, metadata.seq_lens, metadata.block_tables, scale,
        metadata.max_query_len, out=out, sliding_window=sliding_window,
    )
