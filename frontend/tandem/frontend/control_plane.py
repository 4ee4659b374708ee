"""Typed answers of the Frontend's control-plane RPCs (GetModelInfo, GetServerInfo, GetLoads).

Pure builders over what the frontend already holds (its `RequestBuilder`, the engine replicas'
model info and their Utility STATS answers), so the RPC handlers in `server.py` stay thin.
The engines' answers arrive as `google.protobuf.Struct` (numbers as doubles); they are turned
into the messages' integer fields here, once, at the frontend's edge.
"""

from __future__ import annotations

from importlib import metadata

from tandem.frontend.engine_pool import EngineReplica
from tandem.frontend.request_builder import RequestBuilder
from tandem.v1 import common_pb2, frontend_pb2

# SamplingParams fields an engine's effective defaults may name, with their wire types.
_INT_DEFAULTS = ("max_tokens", "top_k", "min_tokens")
_FLOAT_DEFAULTS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def version() -> str:
    try:
        return metadata.version("tandem-frontend")
    except metadata.PackageNotFoundError:
        return "unknown"


def sampling_defaults_proto(defaults: dict | None) -> tuple[common_pb2.SamplingParams, str]:
    """An engine's effective sampling defaults (MODEL_INFO's `sampling_defaults`) as
    SamplingParams with every named field set, and their source."""
    params = common_pb2.SamplingParams()
    defaults = defaults or {}
    for name in _INT_DEFAULTS:
        if defaults.get(name) is not None:
            setattr(params, name, int(defaults[name]))
    for name in _FLOAT_DEFAULTS:
        if defaults.get(name) is not None:
            setattr(params, name, float(defaults[name]))
    return params, str(defaults.get("source", ""))


def model_info(builder: RequestBuilder, limits_info: dict, replica_info: dict) -> frontend_pb2.GetModelInfoResponse:
    """`limits_info`: the pools' strictest limits (`EnginePool.limits_info`); `replica_info`: a
    ready replica's MODEL_INFO (the same model on every replica)."""
    defaults, source = sampling_defaults_proto(replica_info.get("sampling_defaults"))
    return frontend_pb2.GetModelInfoResponse(
        served_model_name=builder.served_model_name,
        model=str(limits_info.get("model", "")),
        max_context_length=builder.limits.max_model_len,
        vocab_size=builder.limits.vocab_size,
        eos_token_ids=list(builder.tokenizer.eos_token_ids),
        sampling_defaults=defaults,
        sampling_defaults_source=source,
        kv_capacity_tokens=int(limits_info.get("kv_capacity_tokens", 0)),
        tokenizer_kind=builder.tokenizer.kind,
        has_chat_template=builder.tokenizer.has_chat_template,
        architecture=str(replica_info.get("architecture", "")),
        dtype=str(replica_info.get("dtype", "")),
    )


def replica_info(replica: EngineReplica, role: str) -> frontend_pb2.EngineReplicaInfo:
    kv = replica.model_info.get("kv_transfer") or {}
    return frontend_pb2.EngineReplicaInfo(
        address=replica.address, role=role, ready=replica.routable,
        kv_role=str(kv.get("role") or ""), kv_engine_id=str(kv.get("engine_id") or ""),
        kv_transports=[str(t) for t in kv.get("transports") or ()],
    )


def replica_load(replica: EngineReplica, role: str, stats: dict | None, error: str = "") -> frontend_pb2.ReplicaLoad:
    """One replica's load from its Utility STATS answer (`stats`; None with `error` when it
    did not answer)."""
    load = frontend_pb2.ReplicaLoad(address=replica.address, role=role, ready=replica.routable,
                                    in_flight=replica.in_flight, error=error)
    if stats is not None:
        for name in ("num_running", "num_waiting", "waiting_tokens", "kv_blocks_total", "kv_blocks_used",
                     "state_slots_used", "kv_loading_requests", "kv_leases_active"):
            setattr(load, name, int(stats.get(name, 0)))
        load.kv_usage = float(stats.get("kv_usage", 0.0))
    return load
