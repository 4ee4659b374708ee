"""The frontend's limits come from the engines' typed GetModelInfo, integers as integers.

A scripted engine reports limits no real model has (an odd context length, EOS ids, sampling
defaults); the frontend set up from it must validate with them and report them, so a frontend
that read them from anywhere else would fail here.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tandem.frontend.app import FrontendOptions, build_request_builder
from tandem.frontend.engine_pool import EnginePool
from tandem.frontend.request_ids import RequestIdMap
from tandem.frontend.server import FrontendServicer
from tandem.frontend.tokenize_pool import TokenizePool
from tandem.grpc_service import add_service
from tandem.health import add_health
from tandem.v1 import common_pb2, engine_pb2, engine_pb2_grpc, frontend_pb2, frontend_pb2_grpc
from grpc_health.v1 import health_pb2

CONTEXT = 12_345  # not a power of two: no default could produce it
KV_TOKENS = 999 * 16
EOS = [2, 7]


class ModelInfoEngine(engine_pb2_grpc.EngineServicer):
    """Answers GetModelInfo only (Utility answers UNIMPLEMENTED, as any RPC not defined here)."""

    def __init__(self, model_path: str) -> None:
        self.model_path = model_path
        self.asked = 0

    async def GetModelInfo(self, request, context):
        self.asked += 1
        defaults = common_pb2.SamplingParams(max_tokens=77, temperature=0.3, top_p=0.9, top_k=40)
        return engine_pb2.EngineModelInfo(
            model="scripted", model_path=self.model_path, tokenizer_path=self.model_path, architecture="Scripted",
            max_model_len=CONTEXT, vocab_size=49152, eos_token_ids=EOS, dtype="float32", kv_blocks=999,
            block_size=16, kv_capacity_tokens=KV_TOKENS, sampling_defaults=defaults,
            sampling_defaults_source="scripted generation_config.json")


async def _serve_engine(engine) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    add_service(server, engine, engine_pb2.DESCRIPTOR.services_by_name["Engine"])
    health = await add_health(server, "tandem.v1.Engine")
    await health.set("tandem.v1.Engine", health_pb2.HealthCheckResponse.SERVING)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def test_limits_eos_ids_and_defaults_come_from_get_model_info(smollm2_dir):
    async def run() -> None:
        engine = ModelInfoEngine(str(smollm2_dir))
        engine_server, address = await _serve_engine(engine)
        pool = EnginePool([address])
        frontend = grpc.aio.server()
        try:
            builder = await build_request_builder(FrontendOptions(engines=[address], default_max_tokens=5), pool)
            assert engine.asked == 1
            limits = builder.limits
            assert (limits.max_model_len, limits.vocab_size, limits.kv_capacity_tokens) == (CONTEXT, 49152, KV_TOKENS)
            assert type(limits.max_model_len) is int and type(limits.kv_capacity_tokens) is int
            assert limits.default_max_tokens == 77  # the engine's default, not the frontend's own 5
            assert builder.served_model_name == "scripted"

            servicer = FrontendServicer(pool, RequestIdMap("t"))
            servicer.attach(builder, TokenizePool(builder.tokenizer, 1, 4))
            add_service(frontend, servicer, frontend_pb2.DESCRIPTOR.services_by_name["Frontend"])
            port = frontend.add_insecure_port("127.0.0.1:0")
            await frontend.start()
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = frontend_pb2_grpc.FrontendStub(channel)
                info = await stub.GetModelInfo(frontend_pb2.GetModelInfoRequest(), timeout=10)
                assert info.max_context_length == CONTEXT and info.kv_capacity_tokens == KV_TOKENS
                assert list(info.eos_token_ids) == EOS
                assert info.sampling_defaults.max_tokens == 77 and info.sampling_defaults.top_k == 40
                assert info.sampling_defaults.temperature == pytest.approx(0.3)
                assert info.sampling_defaults_source == "scripted generation_config.json"
                assert (info.architecture, info.dtype, info.model) == ("Scripted", "float32", "scripted")
                # The context the engine reported is the one requests are judged by.
                request = frontend_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3])
                request.sampling.max_tokens = CONTEXT - 2
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Generate(request, timeout=10)
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert str(CONTEXT) in refused.value.details()
                # MODEL_INFO (2) is no Utility command any more.
                with pytest.raises(grpc.aio.AioRpcError) as unknown:
                    await stub.Utility(common_pb2.UtilityRequest(command=2), timeout=10)
                assert unknown.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            servicer.close()
        finally:
            await frontend.stop(0)
            await pool.close()
            await engine_server.stop(0)

    asyncio.run(run())
