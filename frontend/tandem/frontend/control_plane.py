"""Typed answers of the Frontend's control-plane RPCs (GetModelInfo, GetServerInfo, GetLoads).

Pure builders over what the frontend already holds (its `RequestBuilder`, the engine replicas'
typed GetModelInfo answers and their Utility STATS answers), so the RPC handlers in `server.py`
stay thin. STATS arrives as `google.protobuf.Struct` (numbers as doubles); its counts are turned
into the messages' integer fields here, once, at the frontend's edge.
"""

from __future__ import annotations

from importlib import metadata

from tandem.frontend.engine_pool import EngineReplica, PoolLimits
from tandem.frontend.request_builder import RequestBuilder
from tandem.v1 import engine_pb2, frontend_pb2


def version() -> str:
    try:
        return metadata.version("tandem-frontend")
    except metadata.PackageNotFoundError:
        return "unknown"


def model_info(builder: RequestBuilder, limits_info: PoolLimits,
               replica_info: engine_pb2.EngineModelInfo) -> frontend_pb2.GetModelInfoResponse:
    """`limits_info`: the pools' strictest limits (`EnginePool.limits_info`); `replica_info`: a
    ready replica's GetModelInfo answer (the same model on every replica)."""
    return frontend_pb2.GetModelInfoResponse(
        served_model_name=builder.served_model_name,
        model=limits_info.model,
        max_context_length=builder.limits.max_model_len,
        vocab_size=builder.limits.vocab_size,
        eos_token_ids=list(replica_info.eos_token_ids),  # what the engine stops on
        sampling_defaults=replica_info.sampling_defaults,
        sampling_defaults_source=replica_info.sampling_defaults_source,
        kv_capacity_tokens=limits_info.kv_capacity_tokens,
        tokenizer_kind=builder.tokenizer.kind,
        has_chat_template=builder.tokenizer.has_chat_template,
        tokenizer_round_trip_ok=bool(builder.tokenizer.probe_passed),
        architecture=replica_info.architecture,
        dtype=replica_info.dtype,
    )


def replica_info(replica: EngineReplica, role: str) -> frontend_pb2.EngineReplicaInfo:
    kv = replica.model_info.kv_transfer if replica.model_info is not None else engine_pb2.EngineKVTransferInfo()
    return frontend_pb2.EngineReplicaInfo(
        address=replica.address, role=role, ready=replica.routable,
        kv_role=kv.role, kv_engine_id=kv.engine_id, kv_transports=list(kv.transports),
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
