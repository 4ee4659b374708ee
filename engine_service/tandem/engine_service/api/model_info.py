"""The engine's typed model info (`Engine.GetModelInfo`), built once when the model is loaded.

What the core reports (`CoreInfo`) and the effective sampling defaults become one
`EngineModelInfo` message: counts are integers on the wire, so a frontend reads its limits from
it without casts or string lookups.
"""

from __future__ import annotations

from typing import Any

from tandem.core_protocol import CoreInfo
from tandem.v1 import common_pb2, engine_pb2

# SamplingParams fields the effective defaults may name, with their wire types.
_INT_DEFAULTS = ("max_tokens", "top_k", "min_tokens")
_FLOAT_DEFAULTS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def sampling_defaults_proto(defaults: dict[str, Any]) -> tuple[common_pb2.SamplingParams, str]:
    """The effective sampling defaults (`GenerationDefaults.effective`) as SamplingParams with
    every named field set, and their source."""
    params = common_pb2.SamplingParams()
    for name in _INT_DEFAULTS:
        if defaults.get(name) is not None:
            setattr(params, name, int(defaults[name]))
    for name in _FLOAT_DEFAULTS:
        if defaults.get(name) is not None:
            setattr(params, name, float(defaults[name]))
    return params, str(defaults.get("source", ""))


def engine_model_info(info: CoreInfo, sampling_defaults: dict[str, Any]) -> engine_pb2.EngineModelInfo:
    """`info`: the loaded core's; `sampling_defaults`: what a request that sets no sampling
    field gets (`GenerationDefaults.effective`)."""
    defaults, source = sampling_defaults_proto(sampling_defaults)
    msg = engine_pb2.EngineModelInfo(
        model=info.model, model_path=info.model_path or "", tokenizer_path=info.tokenizer_path or "",
        architecture=info.architecture, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
        eos_token_ids=list(info.eos_token_ids), dtype=info.dtype, device=info.device, kv_blocks=info.kv_blocks,
        block_size=info.block_size, kv_capacity_tokens=info.kv_capacity_tokens,
        enable_prefix_caching=info.enable_prefix_caching, sampling_defaults=defaults,
        sampling_defaults_source=source,
    )
    kv = info.kv_transfer
    if kv is not None:
        msg.kv_transfer.CopyFrom(engine_pb2.EngineKVTransferInfo(
            role=kv["role"], engine_id=kv["engine_id"], transfer_address=kv.get("transfer_address") or "",
            transports=list(kv.get("transports") or ()), lease_seconds=float(kv.get("lease_seconds") or 0.0)))
    return msg
