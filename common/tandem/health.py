"""grpc.health.v1 registration shared by both services."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer


async def add_health(server: grpc.aio.Server, service_name: str) -> HealthServicer:
    """Registers grpc.health.v1: "" answers liveness (SERVING while the process runs) and
    `service_name` answers readiness (NOT_SERVING until the caller marks it ready)."""
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    await health.set(service_name, health_pb2.HealthCheckResponse.NOT_SERVING)
    return health
