"""Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Qwen3) written once, top to bottom.

The variants differ only in a few switches read from the Hugging Face config:
- Qwen2: bias on the q/k/v projections (not on o_proj).
- Qwen3: per-head RMSNorm on queries and keys (`q_norm`, `k_norm`) before RoPE, no bias.
- Llama 3.x / YaRN models: RoPE frequency scaling (see `layers/rotary.py`).
- Mistral: every layer attends over a sliding window (`sliding_window`); Qwen2/Qwen3 with
  `use_sliding_window`: the layers `layer_types` marks "sliding_attention" do.

Families whose feed-forward block differs (mixture of experts: `models/qwen3_moe.py`) override
`build_mlp`; the decoder layer takes whatever block it returns.

The model declares its caches (`cache_layout`): one full-attention group and one group per
distinct window; each layer reads its group's block table from the step metadata.

Parameter names match the Hugging Face checkpoints so safetensors load by name.

Two op sets, chosen with the attention backend at construction (`backend.fused_layers`):
the PyTorch one (the reference, and the CPU path) and the fused Triton one — q/k/v and gate/up
each as one GEMM over merged weights (`layers/merged_linear.py`), add + RMSNorm, SiLU·mul and
(q/k norm +) RoPE + KV store as single kernels. Both compute the same function with the same
roundings.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from tandem.engine_service.cache.cache_spec import CacheLayout, attention_layout
from tandem.engine_service.layers.attention import (
    Attention,
    AttentionBackend,
    AttentionMetadata,
)
from tandem.engine_service.layers.backend_select import select_attention_backend
from tandem.engine_service.layers.embedding import VocabEmbedding
from tandem.engine_service.layers.linear import ColumnParallelLinear, RowParallelLinear
from tandem.engine_service.layers.merged_linear import MergedColumnLinear
from tandem.engine_service.layers.mlp import GatedMLP
from tandem.engine_service.layers.norm import RMSNorm
from tandem.engine_service.layers.rotary import RopeConfig, RotaryEmbedding, RotaryInputs, apply_rotary


@dataclass(frozen=True)
class DecoderConfig:
    """The hyperparameters the model code needs, normalised from an HF `config.json` dict."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: RopeConfig
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # Per layer: the attention window (None = full attention); empty means every layer is full.
    layer_windows: tuple[int | None, ...] = ()

    @property
    def windows(self) -> tuple[int | None, ...]:
        return self.layer_windows or (None,) * self.num_hidden_layers


def layer_windows_from_hf(family: str, hf: Mapping[str, Any]) -> tuple[int | None, ...]:
    """Per-layer attention windows as transformers applies them (None = full attention).

    Mistral windows every layer when `sliding_window` is set. Qwen2/Qwen3 window only with
    `use_sliding_window`, on the layers `layer_types` names "sliding_attention" (derived as
    transformers does, from `max_window_layers`, when the config has no `layer_types`).
    """
    n = hf["num_hidden_layers"]
    if family == "mistral":
        return (hf.get("sliding_window"),) * n
    if family not in ("qwen2", "qwen3"):
        return (None,) * n
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    types = hf.get("layer_types") or [
        "sliding_attention" if window is not None and i >= hf.get("max_window_layers", 28) else "full_attention"
        for i in range(n)
    ]
    if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
        raise NotImplementedError(f"layer_types {types!r} is not supported (only full and sliding attention)")
    return tuple(window if t == "sliding_attention" else None for t in types)


class LlamaMLP(GatedMLP):
    """SwiGLU feed-forward of a dense decoder layer, sized from the config."""

    def __init__(self, cfg: DecoderConfig, fused: bool = False) -> None:
        super().__init__(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias, fused=fused)


class LlamaAttention(nn.Module):
    """Self-attention block: q/k/v projections, optional q/k norm, RoPE, paged attention, o_proj."""

    def __init__(self, cfg: DecoderConfig, backend: AttentionBackend, layer_id: int, cache_group: int) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.cache_group = cache_group  # which paged cache group's block table this layer reads
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = ColumnParallelLinear(h, self.num_heads * d, bias=cfg.qkv_bias)
        self.k_proj = ColumnParallelLinear(h, self.num_kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = ColumnParallelLinear(h, self.num_kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(self.num_heads * d, h, bias=cfg.o_bias)
        self.fused = backend.fused_layers
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, self.fused) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, self.fused) if cfg.qk_norm else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, d**-0.5, backend, cfg.windows[layer_id])
        if self.fused:
            self.qkv = MergedColumnLinear([self.q_proj, self.k_proj, self.v_proj])

    def forward(
        self,
        x: torch.Tensor,
        rope: RotaryInputs,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        metadata = metadata.for_group(self.cache_group)
        if self.fused:
            return self.o_proj(self._forward_fused(x, rope, kv_cache, metadata))
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        assert rope.cos is not None and rope.sin is not None
        q, k = apply_rotary(q, rope.cos, rope.sin), apply_rotary(k, rope.cos, rope.sin)
        return self.o_proj(self.attn(q, k, v, kv_cache, metadata))

    def _forward_fused(
        self, x: torch.Tensor, rope: RotaryInputs, kv_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        # q, k, v are strided views of one [T, (H + 2 Hkv) * D] GEMM output; the kernels take
        # them as they are (RoPE rotates q and k in place while it writes K/V to the cache, and
        # applies Qwen3's per-head q/k norm first, in the same kernel).
        t, d = x.shape[0], self.head_dim
        qkv = self.qkv(x)
        q_end, k_end = self.num_heads * d, (self.num_heads + self.num_kv_heads) * d
        q = qkv[:, :q_end].view(t, self.num_heads, d)
        k = qkv[:, q_end:k_end].view(t, self.num_kv_heads, d)
        v = qkv[:, k_end:].view(t, self.num_kv_heads, d)
        if self.q_norm is not None and self.k_norm is not None:
            return self.attn.forward_rotary(
                q, k, v, kv_cache, metadata, rope.table,
                self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
            )
        return self.attn.forward_rotary(q, k, v, kv_cache, metadata, rope.table)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; carries the residual stream separately so norms can fuse the add.

    The feed-forward block is pluggable (`mlp`: any module mapping `[T, hidden]` to `[T, hidden]`,
    e.g. a sparse MoE block); by default the dense SwiGLU MLP."""

    def __init__(
        self, cfg: DecoderConfig, backend: AttentionBackend, layer_id: int, cache_group: int,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        fused = backend.fused_layers
        self.self_attn = LlamaAttention(cfg, backend, layer_id, cache_group)
        self.mlp = mlp if mlp is not None else LlamaMLP(cfg, fused)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RotaryInputs,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """Embedding, decoder stack and final norm (the `model.` prefix of checkpoint names).

    `mlp_factory(layer_id)` builds each layer's feed-forward block (None: the dense MLP)."""

    def __init__(
        self, cfg: DecoderConfig, backend: AttentionBackend,
        mlp_factory: Callable[[int], nn.Module | None] | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        # The layout's group indices do not depend on the cache dtype.
        layout = attention_layout(cfg.windows, cfg.num_key_value_heads, cfg.head_dim, "float32")
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, backend, i, layout.paged_group_of(i), mlp_factory(i) if mlp_factory else None)
            for i in range(cfg.num_hidden_layers)
        )
        self.fused = backend.fused_layers
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.fused)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope, cfg.max_position_embeddings)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        # The fused RoPE kernel reads the table at metadata.positions (== positions) itself.
        rope = self.rotary_emb.step_inputs(positions, gather=not self.fused)
        hidden, residual = self.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, rope, kv_cache, metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Causal LM over the paged KV cache: `forward` gives hidden states, `compute_logits` logits.

    Subclasses set `family`, which decides how the HF config is read (`config_from_hf`).
    """

    family: ClassVar[str] = "llama"

    def __init__(self, cfg: DecoderConfig, attn_backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.config = cfg
        backend = attn_backend or select_attention_backend(torch.get_default_device())
        self.attn_backend = backend
        self.model = LlamaModel(cfg, backend, self.build_mlp)
        self.lm_head = ColumnParallelLinear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def build_mlp(self, layer_id: int) -> nn.Module | None:
        """The feed-forward block of layer `layer_id`; None means the dense SwiGLU MLP. Families
        with other blocks (mixture of experts) override this."""
        return None

    def cache_layout(self, dtype: str) -> CacheLayout:
        """The caches this model needs, per layer group, holding `dtype` (torch's name)."""
        cfg = self.config
        return attention_layout(cfg.windows, cfg.num_key_value_heads, cfg.head_dim, dtype)

    @classmethod
    def config_from_hf(cls, hf: Mapping[str, Any]) -> DecoderConfig:
        """Normalise an HF config dict for this family; refuses features the code lacks."""
        if hf.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {hf['hidden_act']!r} is not supported")
        windows = layer_windows_from_hf(cls.family, hf)
        heads = hf["num_attention_heads"]
        attention_bias = bool(hf.get("attention_bias", False))
        return DecoderConfig(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rope=RopeConfig.from_hf(hf),
            # Qwen2 hard-codes bias on q/k/v only; Llama and Qwen3 gate all four on attention_bias.
            qkv_bias=True if cls.family == "qwen2" else attention_bias,
            o_bias=False if cls.family == "qwen2" else attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=cls.family == "qwen3",
            layer_windows=windows if any(w is not None for w in windows) else (),
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """`input_ids [T]`, `positions [T]` -> final hidden states `[T, hidden_size]`."""
        return self.model(input_ids, positions, kv_caches, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states `[N, hidden_size]` -> logits `[N, vocab_size]` in the model dtype."""
        return self.lm_head(hidden)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5: Llama with bias on the q/k/v projections."""

    family = "qwen2"


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense: Llama with per-head q/k RMSNorm before RoPE."""

    family = "qwen3"


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama whose every layer attends over the last `sliding_window` tokens."""

    family = "mistral"
