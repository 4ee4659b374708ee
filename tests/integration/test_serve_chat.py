"""Acceptance 1: the default model served over gRPC answers a real question."""

from __future__ import annotations

import subprocess
import sys

from tandem.v1 import common_pb2


def test_chat_capital_of_france_over_grpc(client):
    reply = client.chat([{"role": "user", "content": "What is the capital of France?"}], max_tokens=32, temperature=0.0)
    choice = reply.choices[0]
    assert "Paris" in choice.text
    assert choice.finish_reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
    assert reply.usage.prompt_tokens > 10
    assert reply.usage.completion_tokens == len(choice.token_ids)
    assert reply.request_id  # generated when the client gives none
    assert reply.timings.latency >= reply.timings.ttft > 0


def test_chat_cli_against_running_server(serve):
    out = subprocess.run(
        [sys.executable, "-P", "-m", "tandem.cli", "chat", "What is the capital of France?", "--address",
         serve["frontend"], "--max-tokens", "32", "--temperature", "0"],
        capture_output=True, text=True, timeout=120, cwd="/",
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


def test_request_id_is_echoed(client):
    reply = client.generate("Hello", max_tokens=2, temperature=0.0, request_id="client-abc-1")
    assert reply.request_id == "client-abc-1"


def test_model_info_and_health(client):
    info = client.model_info()
    assert info.vocab_size >= 49152
    assert info.max_context_length > 0
    assert info.tokenizer_round_trip_ok
    health = client.utility("health")
    assert health["status"] == "SERVING"


def test_reflection_is_off_by_default(serve):
    import grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(serve["frontend"]) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        req = reflection_pb2.ServerReflectionRequest(list_services="")
        try:
            list(stub.ServerReflectionInfo(iter([req]), timeout=10))
            raise AssertionError("reflection answered although it was not enabled")
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNIMPLEMENTED


def test_typed_control_plane_from_the_python_client(client, serve):
    import grpc

    from tandem.v1 import engine_pb2, engine_pb2_grpc

    info = client.model_info()
    with grpc.insecure_channel(serve["engine"]) as channel:  # the engine's own typed answer
        engine = engine_pb2_grpc.EngineStub(channel).GetModelInfo(engine_pb2.EngineModelInfoRequest(), timeout=10)
    assert info.max_context_length == engine.max_model_len > 0 and info.vocab_size == engine.vocab_size
    assert info.kv_capacity_tokens == engine.kv_capacity_tokens == engine.kv_blocks * engine.block_size
    ids = client.tokenize(messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert client.detokenize(ids).count("What is the capital of France?") == 1  # inside the chat template
    assert client.detokenize(client.tokenize("Paris")) == "Paris"
    loads = client.loads()
    assert len(loads.replicas) == len(client.server_info().engines) >= 1
