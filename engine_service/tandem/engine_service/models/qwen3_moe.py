"""Qwen3-MoE (`model_type: qwen3_moe`, e.g. Qwen3-30B-A3B, Qwen3-235B-A22B).

The Qwen3 decoder (per-head q/k RMSNorm, no bias) whose feed-forward block is, in the layers
transformers makes sparse, a mixture of experts without a shared expert (`layers/moe.py`):
layer i is sparse unless it is in `mlp_only_layers`, and only when `(i + 1) %
decoder_sparse_step == 0`; the other layers keep a dense MLP of `intermediate_size`.
With `use_sliding_window`, transformers windows EVERY layer (Qwen3-MoE reads no `layer_types`).
Everything else (attention, caches, op-set selection) is `models/llama.py`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from torch import nn

from tandem.engine_service.layers.moe import MoeSpec, SparseMoeBlock
from tandem.engine_service.models.llama import DecoderConfig, Qwen3ForCausalLM


@dataclass(frozen=True)
class MoeDecoderConfig(DecoderConfig):
    """`DecoderConfig` plus the mixture-of-experts hyperparameters (`moe`)."""

    moe: MoeSpec | None = None


def moe_spec_from_hf(hf: Mapping[str, Any], shared_expert: bool = False,
                     always_renormalize: bool = False) -> MoeSpec:
    """The MoE part of an HF config (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE spell it the same way;
    transformers 5 may save `num_experts` as `num_local_experts`)."""
    num_experts = int(hf.get("num_experts", hf.get("num_local_experts", 0)) or 0)
    return MoeSpec(
        num_experts=num_experts,
        top_k=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        norm_topk_prob=always_renormalize or bool(hf.get("norm_topk_prob", False)),
        sparse_layers=MoeSpec.sparse_layers_from_hf(
            hf["num_hidden_layers"], num_experts, hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or ()),
        shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size", 0)) if shared_expert else 0,
    )


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3 with sparse mixture-of-experts feed-forward blocks (no shared expert)."""

    def build_mlp(self, layer_id: int) -> nn.Module | None:
        moe = getattr(self.config, "moe", None)
        if moe is None or not moe.sparse_layers[layer_id]:
            return None
        return SparseMoeBlock(
            self.config.hidden_size, moe.moe_intermediate_size, moe.num_experts, moe.top_k, moe.norm_topk_prob,
            moe.shared_expert_intermediate_size, fused=self.attn_backend.fused_layers,
        )

    @classmethod
    def config_from_hf(cls, hf: Mapping[str, Any]) -> MoeDecoderConfig:
        if hf.get("shared_expert_intermediate_size"):
            raise NotImplementedError("qwen3_moe with a shared expert is not a released layout")
        base = super().config_from_hf({**hf, "use_sliding_window": False})
        n = hf["num_hidden_layers"]
        window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
        values = {f.name: getattr(base, f.name) for f in fields(DecoderConfig)}
        values["layer_windows"] = (window,) * n if window is not None else ()
        return MoeDecoderConfig(**values, moe=moe_spec_from_hf(hf))
