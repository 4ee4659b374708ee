"""Hybrid decoders: Qwen3-Next, Qwen3.5 (dense) and Qwen3.5-MoE, written once with switches.

The three share one block structure: a pre-norm decoder whose token mixer is, per layer
(`layer_types`), either a Gated DeltaNet (`linear_attention`, `layers/gated_deltanet.py`) or a
gated full attention (`full_attention`, below), followed by a feed-forward. They differ in:

- the GDN projections: Qwen3-Next packs them (`in_proj_qkvz`, `in_proj_ba`), Qwen3.5 splits
  them (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`);
- the feed-forward: Qwen3.5 dense has a SwiGLU MLP everywhere; Qwen3-Next and Qwen3.5-MoE a
  sparse MoE block with a gated shared expert (`layers/moe.py`), Qwen3-Next on the layers its
  `decoder_sparse_step` / `mlp_only_layers` pick;
- the checkpoint layout: released Qwen3.5 checkpoints wrap the text model in a vision-language
  one (`text_config`, weights under `model.language_model.*`, vision tower under `model.visual.*`);
  only the text part is served (`checkpoint_name` maps and drops names).

Gated attention: `q_proj` yields the queries and an output gate per head (interleaved per head:
`[q_h | gate_h]`), q and k get a zero-centred per-head RMSNorm, RoPE rotates only the first
`partial_rotary_factor` of each head, and the attention output is multiplied by `sigmoid(gate)`
before `o_proj`. Every RMSNorm of these models is zero-centred (`x / rms * (1 + w)`, see
`ZeroCenteredRMSNorm`); Qwen3.5's multimodal RoPE reduces to plain RoPE for text (all three
position ids equal), which is what is implemented.

Caches (`cache_layout`): the attention layers form one `full_attention` paged group; the GDN
layers one `linear_attention_state` state group holding, per request, the conv state
`[conv_dim, W - 1]` (model dtype) and the recurrent state `[HV, K, V]` (float32).

The model's forward takes, per layer, its cache: the paged K/V tensor of an attention layer,
the `(conv_state, recurrent_state)` pools of a GDN layer (`CacheTensors.layer_caches`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from torch import nn

from tandem.engine_service.cache.cache_spec import CacheGroup, CacheLayout, FullAttentionSpec, StateSpec
from tandem.engine_service.layers.attention import (
    Attention,
    AttentionBackend,
    AttentionMetadata,
)
from tandem.engine_service.layers.backend_select import select_attention_backend
from tandem.engine_service.layers.embedding import VocabEmbedding
from tandem.engine_service.layers.gated_deltanet import GatedDeltaNet, GatedDeltaNetShape
from tandem.engine_service.layers.linear import ColumnParallelLinear, RowParallelLinear
from tandem.engine_service.layers.mlp import GatedMLP
from tandem.engine_service.layers.moe import MoeSpec, SparseMoeBlock
from tandem.engine_service.layers.norm import ZeroCenteredRMSNorm
from tandem.engine_service.layers.rotary import RopeConfig, RotaryEmbedding, RotaryInputs, apply_rotary

LINEAR, FULL = "linear_attention", "full_attention"
STATE_GROUP = "linear_attention_state"


@dataclass(frozen=True)
class HybridConfig:
    """The hyperparameters the hybrid model code needs, normalised from an HF config (its text part)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP width (0 when every layer is MoE)
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: RopeConfig
    layer_types: tuple[str, ...]
    gdn: GatedDeltaNetShape
    attention_bias: bool = False
    # Sparse MoE (Qwen3-Next, Qwen3.5-MoE): which layers, and the block's shape.
    moe_layers: tuple[bool, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def moe(self) -> MoeSpec | None:
        """The sparse feed-forward as a `MoeSpec` (None when no layer is sparse), the form the
        roofline's accounting reads for every MoE model."""
        if not any(self.moe_layers):
            return None
        return MoeSpec(self.num_experts, self.num_experts_per_tok, self.moe_intermediate_size, self.norm_topk_prob,
                       self.moe_layers, self.shared_expert_intermediate_size)


def hybrid_cache_layout(cfg: HybridConfig, dtype: str) -> CacheLayout:
    """A `full_attention` paged group over the attention layers and a state group over the GDN
    layers (conv state in `dtype`, recurrent state in float32)."""
    groups = [CacheGroup(FULL, FullAttentionSpec(cfg.num_key_value_heads, cfg.head_dim, dtype), cfg.attention_layers)]
    if cfg.linear_layers:
        spec = StateSpec(cfg.gdn.state_shapes(), (dtype, "float32"))
        groups.append(CacheGroup(STATE_GROUP, spec, cfg.linear_layers))
    return CacheLayout(tuple(groups))


def text_config(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The text model's config: `text_config` of a vision-language wrapper, else `hf` itself.
    Keys only the wrapper carries (`tie_word_embeddings`, token ids) are inherited."""
    inner = hf.get("text_config")
    if not inner:
        return dict(hf)
    out = dict(inner)
    for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id"):
        if key in hf and key not in out:
            out[key] = hf[key]
    return out


def layer_types_from_hf(hf: Mapping[str, Any]) -> tuple[str, ...]:
    """`layer_types`, or transformers' default pattern: every `full_attention_interval`-th layer
    (4 by default) is full attention, the others linear attention."""
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if not types:
        interval = hf.get("full_attention_interval", 4)
        types = [LINEAR if (i + 1) % interval else FULL for i in range(n)]
    if len(types) != n or set(types) - {LINEAR, FULL}:
        raise NotImplementedError(f"layer_types {types!r} is not supported (only linear_attention and full_attention)")
    return tuple(types)


class GatedAttention(nn.Module):
    """Full attention with a sigmoid output gate from `q_proj`, zero-centred q/k norm and partial RoPE."""

    def __init__(self, cfg: HybridConfig, backend: AttentionBackend) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        bias = cfg.attention_bias
        self.q_proj = ColumnParallelLinear(h, 2 * self.num_heads * d, bias=bias)  # [q_h | gate_h] per head
        self.k_proj = ColumnParallelLinear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = ColumnParallelLinear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = RowParallelLinear(self.num_heads * d, h, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(d, cfg.rms_norm_eps, fused=backend.fused_layers)
        self.k_norm = ZeroCenteredRMSNorm(d, cfg.rms_norm_eps, fused=backend.fused_layers)
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, d**-0.5, backend)

    def forward(
        self, x: torch.Tensor, rope: RotaryInputs, kv_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        q, gate = self.q_proj(x).view(t, self.num_heads, 2 * d).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, d))
        v = self.v_proj(x).view(t, self.num_kv_heads, d)
        assert rope.cos is not None and rope.sin is not None
        q, k = apply_rotary(q, rope.cos, rope.sin), apply_rotary(k, rope.cos, rope.sin)
        out = self.attn(q.contiguous(), k, v, kv_cache, metadata)
        return self.o_proj(out * torch.sigmoid(gate.reshape(t, self.num_heads * d)))


class HybridDecoderLayer(nn.Module):
    """Pre-norm block: a GDN (`linear_attn`) or gated attention (`self_attn`) mixer, then the MLP."""

    def __init__(self, cfg: HybridConfig, backend: AttentionBackend, layer_id: int) -> None:
        super().__init__()
        self.is_linear = cfg.layer_types[layer_id] == LINEAR
        # The fused (Triton) op set of the GDN kernels and feed-forwards goes with the attention backend's.
        fused = backend.fused_layers
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg.gdn, fused)
        else:
            self.self_attn = GatedAttention(cfg, backend)
        self.mlp: nn.Module
        if cfg.moe_layers and cfg.moe_layers[layer_id]:
            self.mlp = SparseMoeBlock(
                cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                cfg.norm_topk_prob, shared_expert_intermediate_size=cfg.shared_expert_intermediate_size, fused=fused,
            )
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, fused=fused)
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused=fused)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused=fused)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RotaryInputs,
        cache: Any,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if self.is_linear:
            hidden = self.linear_attn(hidden, cache, metadata)
        else:
            hidden = self.self_attn(hidden, rope, cache, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class HybridModel(nn.Module):
    """Embedding, the hybrid decoder stack and the final norm (the `model.` prefix of checkpoints)."""

    def __init__(self, cfg: HybridConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(HybridDecoderLayer(cfg, backend, i) for i in range(cfg.num_hidden_layers))
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused=backend.fused_layers)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope, cfg.max_position_embeddings)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[Any], metadata: AttentionMetadata
    ) -> torch.Tensor:
        rope = self.rotary_emb.step_inputs(positions)
        hidden, residual = self.embed_tokens(input_ids), None
        for layer, cache in zip(self.layers, caches, strict=True):
            hidden, residual = layer(hidden, residual, rope, cache, metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Qwen3NextForCausalLM(nn.Module):
    """Causal LM over paged K/V (attention layers) and per-request state slots (GDN layers).

    Subclasses set the switches (`split_projections`, how MoE layers are chosen); `forward`
    gives hidden states, `compute_logits` logits, as `LlamaForCausalLM` does.
    """

    family: ClassVar[str] = "qwen3_next"
    split_projections: ClassVar[bool] = False  # Qwen3.5's in_proj_qkv / z / b / a
    # A prefix hit reuses K/V and restores the GDN state from the state checkpoint at the hit
    # position (cache/block_manager.py, cache/state_pool.py): prefix caching works for these models.
    supports_prefix_caching: ClassVar[bool] = True

    def __init__(self, cfg: HybridConfig, attn_backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.config = cfg
        backend = attn_backend or select_attention_backend(torch.get_default_device())
        self.attn_backend = backend
        self.model = HybridModel(cfg, backend)
        self.lm_head = ColumnParallelLinear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def cache_layout(self, dtype: str) -> CacheLayout:
        """See `hybrid_cache_layout` (a function of the config, so the roofline's accounting reads
        the same state shapes and dtypes without building the model)."""
        return hybrid_cache_layout(self.config, dtype)

    @classmethod
    def moe_layers_from_hf(cls, hf: Mapping[str, Any]) -> tuple[bool, ...]:
        """Which layers use the sparse MoE block (Qwen3-Next: `decoder_sparse_step`, minus `mlp_only_layers`)."""
        return MoeSpec.sparse_layers_from_hf(hf["num_hidden_layers"], hf.get("num_experts", 0),
                                             hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or ())

    @classmethod
    def config_from_hf(cls, hf_config: Mapping[str, Any]) -> HybridConfig:
        """Normalise an HF config (or the `text_config` of a vision-language one) for this family."""
        hf = text_config(hf_config)
        if hf.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {hf['hidden_act']!r} is not supported")
        heads = hf["num_attention_heads"]
        rope_source = dict(hf)
        rope_source.setdefault("partial_rotary_factor", 0.25)  # transformers' default for these models
        moe_layers = cls.moe_layers_from_hf(hf)
        return HybridConfig(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf.get("intermediate_size") or 0,
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rope=RopeConfig.from_hf(rope_source),
            layer_types=layer_types_from_hf(hf),
            gdn=GatedDeltaNetShape(
                hidden_size=hf["hidden_size"],
                num_k_heads=hf.get("linear_num_key_heads", 16),
                num_v_heads=hf.get("linear_num_value_heads", 32),
                head_k_dim=hf.get("linear_key_head_dim", 128),
                head_v_dim=hf.get("linear_value_head_dim", 128),
                conv_kernel=hf.get("linear_conv_kernel_dim", 4),
                eps=float(hf.get("rms_norm_eps", 1e-6)),
                split_projections=cls.split_projections,
            ),
            attention_bias=bool(hf.get("attention_bias", False)),
            moe_layers=moe_layers if any(moe_layers) else (),
            num_experts=hf.get("num_experts", 0) if any(moe_layers) else 0,
            num_experts_per_tok=hf.get("num_experts_per_tok", 0),
            moe_intermediate_size=hf.get("moe_intermediate_size", 0),
            shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 0),
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        )

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """Our parameter name for a checkpoint tensor name, or None for a tensor not served: the
        vision tower and the multi-token-prediction head. A vision-language wrapper's
        `model.language_model.*` is the text model's `model.*`."""
        if name.startswith(("mtp.", "model.visual.", "visual.")):
            return None
        if name.startswith("model.language_model."):
            return "model." + name[len("model.language_model."):]
        return name

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[Any], metadata: AttentionMetadata
    ) -> torch.Tensor:
        """`input_ids [T]`, `positions [T]`, per-layer caches -> final hidden states `[T, hidden_size]`."""
        return self.model(input_ids, positions, caches, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states `[N, hidden_size]` -> logits `[N, vocab_size]` in the model dtype."""
        return self.lm_head(hidden)


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5 dense: split GDN projections, a SwiGLU MLP on every layer."""

    family = "qwen3_5"
    split_projections = True

    @classmethod
    def moe_layers_from_hf(cls, hf: Mapping[str, Any]) -> tuple[bool, ...]:
        return (False,) * hf["num_hidden_layers"]


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5-MoE: split GDN projections, the sparse MoE block (with shared expert) on every layer."""

    family = "qwen3_5_moe"
    split_projections = True

    @classmethod
    def moe_layers_from_hf(cls, hf: Mapping[str, Any]) -> tuple[bool, ...]:
        return (True,) * hf["num_hidden_layers"]

    @classmethod
    def config_from_hf(cls, hf_config: Mapping[str, Any]) -> HybridConfig:
        # transformers' Qwen3.5-MoE router always renormalises its top-k weights.
        return replace(super().config_from_hf(hf_config), norm_topk_prob=True)
