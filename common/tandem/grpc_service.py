"""Registers a servicer from its proto service descriptor, with lenient request parsing.

grpcio's generated registration answers a request that fails to parse (for instance a string
field with malformed UTF-8) with INTERNAL before the servicer sees it. Clients deserve
INVALID_ARGUMENT for bad input, so requests are parsed here: a parse failure becomes a
`MalformedRequest` that `reject_malformed` turns into INVALID_ARGUMENT.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf import message as pb_message
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor


@dataclass(frozen=True)
class MalformedRequest:
    """Stands in for a request whose bytes did not parse."""

    error: str


def _lenient_parser(cls):
    def parse(data: bytes):
        try:
            return cls.FromString(data)
        except pb_message.DecodeError as exc:
            return MalformedRequest(str(exc))

    return parse


async def reject_malformed(request, context) -> None:
    """Aborts the call with INVALID_ARGUMENT if the request did not parse."""
    if isinstance(request, MalformedRequest):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {request.error}")


def add_service(server: grpc.aio.Server, servicer: object, service: ServiceDescriptor) -> None:
    """Adds every unary/server-streaming method of `service` implemented by `servicer`."""
    handlers = {}
    for method in service.methods:
        if method.client_streaming:
            raise NotImplementedError(f"{method.full_name}: client streaming is not used by Tandem")
        request_cls = message_factory.GetMessageClass(method.input_type)
        kind = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = kind(
            getattr(servicer, method.name),
            request_deserializer=_lenient_parser(request_cls),
            response_serializer=lambda msg: msg.SerializeToString(),
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


def enable_reflection(server: grpc.aio.Server, service_names: list[str]) -> None:
    """Serves grpc.reflection (off by default: it tells anyone what the server offers)."""
    from grpc_reflection.v1alpha import reflection

    reflection.enable_server_reflection([*service_names, "grpc.health.v1.Health", reflection.SERVICE_NAME], server)
