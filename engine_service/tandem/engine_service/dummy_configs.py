"""Built-in model configurations for `dummy:<name>` specs (random weights, real shapes).

The public ones copy the hyperparameters of the published `config.json` files, so benchmarks
on dummy weights do exactly the work the real model would. The `tiny-*` ones are for tests.
"""

from __future__ import annotations

import copy
from typing import Any

_QWEN3_COMMON: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "hidden_act": "silu",
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "use_sliding_window": False,
    "vocab_size": 151936,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}

# Qwen/Qwen3-Next-80B-A3B-Instruct's config.json: the layer shapes of the hybrid MoE model.
_QWEN3_NEXT_80B: dict[str, Any] = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 5120,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "attention_bias": False,
    "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "norm_topk_prob": True,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000000.0,
    "partial_rotary_factor": 0.25,
    "tie_word_embeddings": False,
    "vocab_size": 151936,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}

# Test-sized hybrids: 4 layers (3 Gated DeltaNet, then 1 gated attention, transformers' default
# pattern), 2 key heads serving 4 value heads in the GDN layers, partial RoPE (8 of 32 dims).
_TINY_HYBRID: dict[str, Any] = {
    "hidden_act": "silu",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "attention_bias": False,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    # 2048, not 512: `tandem.gpu_checks.model_parity` runs at max_model_len 1024 (its H200 call at
    # 07:20 UTC failed to build any engine on 512).
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    "tie_word_embeddings": False,
    "vocab_size": 320,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
_TINY_MOE: dict[str, Any] = {
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
}

DUMMY_CONFIGS: dict[str, dict[str, Any]] = {
    # Qwen3-Next-80B-A3B's layer shapes with 12 of its 48 layers (9 GDN + 3 attention, the same
    # 3:1 pattern): ~20 B parameters, so it fits one H200 in bfloat16 with room for the caches.
    "qwen3-next-80b-a3b": {**_QWEN3_NEXT_80B, "num_hidden_layers": 12},
    # Qwen3.5 dense at transformers' Qwen3_5TextConfig defaults (its docstring: "Qwen3.5-9B style"):
    # 32 layers (24 GDN + 8 gated attention).
    "qwen3.5-9b": {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 32,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "attention_bias": False,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "tie_word_embeddings": False,
        "vocab_size": 248320,
    },
    "tiny-qwen3-next": {
        **_TINY_HYBRID, **_TINY_MOE,
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "decoder_sparse_step": 2,  # layers 1 and 3 MoE, 0 and 2 dense: both feed-forwards covered
        "norm_topk_prob": True,
    },
    "tiny-qwen3.5": {**_TINY_HYBRID, "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text"},
    "tiny-qwen3.5-moe": {
        **_TINY_HYBRID, **_TINY_MOE,
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "model_type": "qwen3_5_moe_text",
    },
    # Qwen/Qwen3-0.6B
    "qwen3-0.6b": {
        **_QWEN3_COMMON,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "tie_word_embeddings": True,
    },
    # Qwen/Qwen3-8B
    "qwen3-8b": {
        **_QWEN3_COMMON,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    },
    # Qwen3-0.6B shapes, layers 14-27 over a 64-token window (two paged cache groups): the GPU
    # model-parity check of windowed kernels and per-group CUDA graphs.
    "qwen3-0.6b-sw64": {
        **_QWEN3_COMMON,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "tie_word_embeddings": True,
        "use_sliding_window": True,
        "sliding_window": 64,
        "max_window_layers": 14,
    },
    # Qwen3-8B shapes with every layer attending over a 1k window (for the sliding-window roofline:
    # decode at 8k context reads only the window's K/V).
    "qwen3-8b-sw1k": {
        **_QWEN3_COMMON,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
        "use_sliding_window": True,
        "sliding_window": 1024,
        "max_window_layers": 0,
    },
    # Qwen/Qwen3-30B-A3B: 48 layers, every one sparse (128 experts of 768, 8 per token).
    "qwen3-30b-a3b": {
        **_QWEN3_COMMON,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "max_window_layers": 48,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
    # Qwen3-30B-A3B's layer shapes, 4 layers (~5.5 GB in bf16): the GPU model-parity check of the
    # MoE path, whose three engines must fit one GPU together.
    "qwen3-30b-a3b-l4": {
        **_QWEN3_COMMON,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "max_window_layers": 4,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
    # mistralai/Mistral-7B-v0.1 (sliding_window 4096 on every layer)
    "mistral-7b": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "tie_word_embeddings": False,
        "vocab_size": 32000,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    # meta-llama/Llama-3.1-8B-Instruct
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": False,
        "vocab_size": 128256,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
    },
    # HuggingFaceTB/SmolLM2-135M-Instruct
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "rope_scaling": None,
        "tie_word_embeddings": True,
        "vocab_size": 49152,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    # Test-sized models: two layers, grouped-query attention, a few hundred tokens of vocabulary.
    "tiny-llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "vocab_size": 320,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "tiny-qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
        "tie_word_embeddings": True,
        "vocab_size": 320,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    # Every layer windowed, the window (8) shorter than the test prompts.
    "tiny-mistral": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "sliding_window": 8,
        "tie_word_embeddings": False,
        "vocab_size": 320,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    # Qwen3 with per-layer types: layer 0 full attention, layers 1-2 over a window of 8.
    "tiny-qwen3-sw": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "use_sliding_window": True,
        "sliding_window": 8,
        "max_window_layers": 1,
        "tie_word_embeddings": True,
        "vocab_size": 320,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    # Qwen3-MoE: layers 0 and 2 sparse (8 experts, 2 per token, renormalised), layer 1 dense
    # (`mlp_only_layers`), so both feed-forward kinds and the per-layer choice are exercised.
    "tiny-qwen3-moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "attention_bias": False,
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "vocab_size": 320,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "tiny-qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,  # deliberately != hidden_size / heads, as in the real Qwen3 models
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
        "tie_word_embeddings": True,
        "vocab_size": 320,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}


def _all_full_attention(name: str) -> dict[str, Any]:
    """A hybrid config with every layer full (gated) attention: the same depth and shapes without
    recurrent state (the full-attention side of `tandem bench prefix`)."""
    cfg = copy.deepcopy(DUMMY_CONFIGS[name])
    cfg["layer_types"] = ["full_attention"] * cfg["num_hidden_layers"]
    return cfg


for _hybrid in ("tiny-qwen3.5", "qwen3.5-9b", "qwen3-next-80b-a3b"):
    DUMMY_CONFIGS[f"{_hybrid}-full-attention"] = _all_full_attention(_hybrid)


def dummy_config_names() -> list[str]:
    return sorted(DUMMY_CONFIGS)


def get_dummy_config(name: str) -> dict[str, Any]:
    """A fresh copy of the named config; raises `KeyError` listing the known names."""
    try:
        return copy.deepcopy(DUMMY_CONFIGS[name])
    except KeyError:
        raise KeyError(f"unknown dummy config {name!r}; known: {', '.join(dummy_config_names())}") from None
