"""A small synchronous Python client for the public `tandem.v1.Frontend` service.

    client = TandemClient("127.0.0.1:50051")
    reply = client.chat([{"role": "user", "content": "What is the capital of France?"}], max_tokens=32)
    print(reply.choices[0].text)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Iterator

import grpc
from google.protobuf import json_format

from tandem.proto_wire import kv_transfer_from_dict, kv_transfer_to_proto
from tandem.readiness import stderr_progress, wait_until_ready
from tandem.security import SecurityOptions
from tandem.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc

SAMPLING_FIELDS = (
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "ignore_eos",
    "logprobs", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens",
    "logit_bias", "cache_salt", "priority", "prompt_logprobs",
    "json_schema", "json_object", "regex", "grammar",  # structured output (one of them)
)
REQUEST_FIELDS = (
    "request_id", "stop", "include_stop_str_in_output", "n", "skip_special_tokens", "model",
    "add_generation_prompt", "return_prompt_token_ids", "truncate_prompt_tokens",
)


def build_request(
    prompt: str | None = None,
    messages: list[dict] | None = None,
    prompt_token_ids: list[int] | None = None,
    kv_transfer_params: dict | None = None,
    **kwargs,
) -> frontend_pb2.GenerateRequest:
    """Builds a GenerateRequest; keyword arguments are sampling or request fields by name."""
    req = frontend_pb2.GenerateRequest()
    if prompt is not None:
        req.prompt = prompt
    for m in messages or []:
        req.messages.add(role=m["role"], content=m["content"])
    if prompt_token_ids is not None:
        req.prompt_token_ids.extend(prompt_token_ids)
    if kv_transfer_params is not None:
        req.kv_transfer_params.CopyFrom(kv_transfer_to_proto(kv_transfer_from_dict(kv_transfer_params)))
    for key, value in kwargs.items():
        if value is None:
            continue
        if key in SAMPLING_FIELDS:
            target = req.sampling
        elif key in REQUEST_FIELDS:
            target = req
        else:
            raise TypeError(f"unknown request field {key!r}")
        if isinstance(value, dict):  # a map field (logit_bias)
            getattr(target, key).update(value)
        elif isinstance(value, (list, tuple)):
            getattr(target, key).extend(value)
        else:
            setattr(target, key, value)
    return req


class TandemClient:
    """Blocking client: generate, chat, stream and utility calls against a frontend."""

    def __init__(self, address: str = "127.0.0.1:50051", credentials: grpc.ChannelCredentials | None = None,
                 metadata: list[tuple[str, str]] | None = None, *, token: str | None = None,
                 tls_ca: str | None = None, security: SecurityOptions | None = None) -> None:
        """`security` sets TLS/mTLS and the bearer token from one hop's options; `tls_ca` (TLS
        trusting that CA) and `token` are shortcuts for the common case. Explicit `credentials`
        take precedence; the token is appended to `metadata`."""
        options = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]
        if security is None and (token or tls_ca):
            security = SecurityOptions(tls_ca=tls_ca, tokens=(token,) if token else ())
        if security is not None:
            credentials = credentials or security.channel_credentials()
            metadata = list(metadata or []) + security.call_metadata() or None
            options += security.channel_options()
        self.channel = (
            grpc.secure_channel(address, credentials, options=options)
            if credentials is not None
            else grpc.insecure_channel(address, options=options)
        )
        self.address = address
        self.stub = frontend_pb2_grpc.FrontendStub(self.channel)
        self.metadata = metadata

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "TandemClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def wait_ready(self, timeout: float = 300.0, progress: Callable[[str], None] | None = stderr_progress) -> None:
        """Blocks until the frontend is ready (as `tandem chat` does); raises
        `tandem.readiness.ServerNotReady` with a one-line reason otherwise: at once when the
        server stops while it starts. `progress` gets a line now and then during a long wait
        (default: stderr; None: silent)."""
        wait_until_ready(self.channel, self.address, timeout, progress=progress)

    def generate(self, prompt: str | None = None, timeout: float | None = None, **kwargs) -> frontend_pb2.GenerateResponse:
        return self.stub.Generate(build_request(prompt=prompt, **kwargs), timeout=timeout, metadata=self.metadata)

    def chat(self, messages: list[dict], timeout: float | None = None, **kwargs) -> frontend_pb2.GenerateResponse:
        return self.stub.Generate(build_request(messages=messages, **kwargs), timeout=timeout, metadata=self.metadata)

    def stream(self, prompt: str | None = None, timeout: float | None = None, **kwargs) -> Iterator[frontend_pb2.GenerateStreamResponse]:
        """Returns the call itself: iterate it for messages; `.cancel()` aborts the request."""
        return self.stub.Stream(build_request(prompt=prompt, **kwargs), timeout=timeout, metadata=self.metadata)

    def utility(self, command: str, request_id: str = "", timeout: float | None = 30.0) -> dict:
        """Runs a Utility command by name (health, abort, stats, flush_prefix_cache, ...)."""
        value = common_pb2.UtilityCommand.Value("UTILITY_COMMAND_" + command.upper())
        resp = self.stub.Utility(
            common_pb2.UtilityRequest(command=value, request_id=request_id), timeout=timeout, metadata=self.metadata
        )
        return json_format.MessageToDict(resp.result)

    # -- the typed control plane (integers stay integers; nothing runs a generation) ------------------
    def model_info(self, timeout: float | None = 30.0) -> frontend_pb2.GetModelInfoResponse:
        return self.stub.GetModelInfo(frontend_pb2.GetModelInfoRequest(), timeout=timeout, metadata=self.metadata)

    def server_info(self, timeout: float | None = 30.0) -> frontend_pb2.GetServerInfoResponse:
        return self.stub.GetServerInfo(frontend_pb2.GetServerInfoRequest(), timeout=timeout, metadata=self.metadata)

    def loads(self, timeout: float | None = 30.0) -> frontend_pb2.GetLoadsResponse:
        return self.stub.GetLoads(frontend_pb2.GetLoadsRequest(), timeout=timeout, metadata=self.metadata)

    def tokenize(self, prompt: str | None = None, messages: list[dict] | None = None,
                 add_generation_prompt: bool | None = None, timeout: float | None = 30.0) -> list[int]:
        """The token ids a generation of `prompt` (or chat `messages`) would see."""
        request = frontend_pb2.TokenizeRequest(prompt=prompt or "", messages=[
            frontend_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages or ()])
        if add_generation_prompt is not None:
            request.add_generation_prompt = add_generation_prompt
        return list(self.stub.Tokenize(request, timeout=timeout, metadata=self.metadata).token_ids)

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False,
                   timeout: float | None = 30.0) -> str:
        request = frontend_pb2.DetokenizeRequest(token_ids=token_ids, skip_special_tokens=skip_special_tokens)
        return self.stub.Detokenize(request, timeout=timeout, metadata=self.metadata).text
