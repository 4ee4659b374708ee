"""Maps a Hugging Face config (its `architectures` / `model_type`) to our model class."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from tandem.engine_service.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from tandem.engine_service.models.qwen3_moe import Qwen3MoeForCausalLM
from tandem.engine_service.models.qwen3_next import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM

_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    # Released Qwen3.5 checkpoints are vision-language models: their text part is served.
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForCausalLM,
}

# Used when a config names no architecture (e.g. one converted from GGUF).
_MODEL_TYPES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "mistral": MistralForCausalLM,
    "qwen3_next": Qwen3NextForCausalLM,
    "qwen3_5": Qwen3_5ForCausalLM,
    "qwen3_5_text": Qwen3_5ForCausalLM,
    "qwen3_5_moe": Qwen3_5MoeForCausalLM,
    "qwen3_5_moe_text": Qwen3_5MoeForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def get_model_class(hf_config: Mapping[str, Any]) -> type[nn.Module]:
    """The class implementing `hf_config`; raises `ValueError` naming what is supported."""
    for arch in hf_config.get("architectures") or ():
        if arch in _ARCHITECTURES:
            return _ARCHITECTURES[arch]
    model_type = hf_config.get("model_type")
    if not hf_config.get("architectures") and model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    raise ValueError(
        f"unsupported model: architectures={hf_config.get('architectures')}, model_type={model_type!r}; "
        f"supported architectures: {', '.join(supported_architectures())}"
    )
