"""Paged attention on the Triton kernels of `tandem.kernels` (the CUDA path).

One step = store this step's K/V into the paged cache (fused with RoPE, and with Qwen3's q/k
norm, when the model asks: `forward_rotary`), then attend: the split-KV decode kernel when every
sequence brings exactly one token, the variable-length prefill kernel otherwise (it reads
prefix-cache hits and earlier chunks straight from the pool, so chunked prefill needs no special
case).

Nothing here reads a device tensor on the host: the kernels are sized from shapes and from the
host-side lists of `AttentionMetadata` (`max_query_len`, `is_pure_decode`), so a step issues no
device-to-host sync and a decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

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

    @staticmethod
    def _attend(
        q: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        # A fresh contiguous output: q may be a strided view of the qkv projection.
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
