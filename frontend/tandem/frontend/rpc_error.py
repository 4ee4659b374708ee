"""An engine call's failure made by the frontend itself, in the form gRPC's own failures take."""

from __future__ import annotations

import grpc


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """A `grpc.aio.AioRpcError` with `code` and `details` and no metadata: callers handle it like
    one a real call raised (a closed channel, a deadline passed in a queue, an engine's error)."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)
