"""Disaggregated prefill/decode through two engine cores on CPU (issue #12, engine side).

Engine A is a producer (`--kv-role producer`), engine B a consumer; both are `EngineCore`s over
real `LLMEngine`s (tiny dummy Llama, varied greedy outputs), driven message by message as the
core loop drives them; A serves pulls on a real TCP socket from its own thread. A third engine
with no role is the reference. Every test ends by checking that every block on every engine is
free (leases included).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from tandem.core_protocol import CoreAbort, CoreRequest, FinishReason, KVTransferParams, SamplingParams
from tandem.engine_service.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig, SchedulerConfig
from tandem.engine_service.core import EngineCore, core_info
from tandem.engine_service.engine import LLMEngine
from tandem.engine_service.kv_cache import first_needed_block
from tandem.engine_service.kv_connector.cuda_ipc import InProcessChannel

MODEL = "dummy:tiny-llama"
BLOCK = 4
VOCAB = 300


def config(role: str, model: str = MODEL, lease_seconds: float = 30.0, transport: str = "tcp",
           overlap: str = "off") -> EngineConfig:
    return EngineConfig(
        ModelConfig(model=model, attention_backend="torch", max_model_len=128, seed=3),
        CacheConfig(block_size=BLOCK, num_blocks=128),
        SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64, overlap_scheduling=overlap),
        KVTransferConfig(role=role, lease_seconds=lease_seconds, transport=transport),
    )


def make_core(role: str, **kw) -> EngineCore:
    ipc = kw.pop("ipc", None)
    return EngineCore(LLMEngine(config(role, **kw), kv_ipc=ipc))


@pytest.fixture(scope="module")
def reference() -> EngineCore:
    core = make_core("none")
    yield core
    core.engine.close()


@pytest.fixture()
def producer() -> EngineCore:
    core = make_core("producer")
    yield core
    core.engine.close()


@pytest.fixture()
def consumer() -> EngineCore:
    core = make_core("consumer")
    yield core
    core.engine.close()


def prompt(i: int, n: int) -> list[int]:
    g = np.random.default_rng(1000 + i)
    return [int(t) for t in g.integers(3, VOCAB, size=n)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)


class Result:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.final = None


def run(core: EngineCore, requests: list[CoreRequest], timeout: float = 120.0,
        during=None) -> dict[str, Result]:
    """Apply `requests`, then step until every one of them finished; `during(core, step)` is
    called after each step (aborts in the middle of things)."""
    results = {r.request_id: Result() for r in requests}
    for r in requests:
        core.apply(r)
    deadline = time.monotonic() + timeout
    n = 0
    while any(res.final is None for res in results.values()):
        assert time.monotonic() < deadline, "requests did not finish"
        batch = core.step()
        n += 1
        for o in batch.outputs if batch is not None else []:
            res = results.get(o.request_id)
            if res is None:
                continue
            res.tokens += o.new_token_ids
            res.logprobs += [lp.logprob for lp in o.new_logprobs]
            if o.finished:
                res.final = o
        if during is not None:
            during(core, n)
    return results


def request(rid: str, tokens: list[int], max_tokens: int, params: KVTransferParams | None = None) -> CoreRequest:
    return CoreRequest(request_id=rid, prompt_token_ids=tokens, sampling=greedy(max_tokens), arrival_time=time.monotonic(),
                       kv_transfer_params=params)


def prefill_leg(core: EngineCore, prompts: dict[str, list[int]]) -> dict[str, Result]:
    out = run(core, [request(f"{rid}-p", t, 1, KVTransferParams(do_remote_decode=True)) for rid, t in prompts.items()])
    for res in out.values():
        assert res.final.finish_reason == FinishReason.LENGTH
        assert res.final.kv_transfer_params.do_remote_prefill
    return {rid[:-2]: res for rid, res in out.items()}


def decode_leg(core: EngineCore, prompts: dict[str, list[int]], legs: dict[str, Result], max_tokens: int,
               during=None) -> dict[str, Result]:
    reqs = [request(f"{rid}-d", t + [legs[rid].tokens[0]], max_tokens - 1, legs[rid].final.kv_transfer_params)
            for rid, t in prompts.items()]
    out = run(core, reqs, during=during)
    return {rid[:-2]: res for rid, res in out.items()}


def assert_all_free(*cores: EngineCore, timeout: float = 10.0) -> None:
    """Every block and lease on every engine is free (released leases are swept on tick)."""
    deadline = time.monotonic() + timeout
    for core in cores:
        while True:
            core.tick()
            st = core.engine.stats()
            if (st.kv_blocks_used, st.group_blocks_used, st.kv_leases_active, st.kv_loading_requests,
                    st.num_running, st.num_waiting) == (0, 0, 0, 0, 0, 0):
                break
            assert time.monotonic() < deadline, f"blocks or leases left: {st}"
            time.sleep(0.02)
        bm = core.engine.block_manager
        for pool in bm.pools:
            assert all(b.ref_count == 0 for b in pool.blocks), "a block is still referenced"


PROMPT_LENGTHS = [5, 8, 13, 16, 23, 30, 37, 41]


def test_two_legs_equal_one_engine_and_consumer_reports_loaded_tokens(reference, producer, consumer):
    prompts = {f"r{i}": prompt(i, n) for i, n in enumerate(PROMPT_LENGTHS)}
    max_tokens = 6
    ref = run(reference, [request(rid, t, max_tokens) for rid, t in prompts.items()])
    legs = prefill_leg(producer, prompts)
    assert producer.engine.stats().kv_leases_active == len(prompts)
    decoded = decode_leg(consumer, prompts, legs, max_tokens)
    outputs_differ = set()
    for rid in prompts:
        got = legs[rid].tokens + decoded[rid].tokens
        assert got == ref[rid].tokens, rid
        np.testing.assert_allclose(legs[rid].logprobs + decoded[rid].logprobs, ref[rid].logprobs, atol=1e-4)
        assert decoded[rid].final.finish_reason == FinishReason.LENGTH
        outputs_differ.add(tuple(got))
    assert len(outputs_differ) == len(prompts)  # the model does not answer every prompt alike
    st = consumer.engine.stats()
    assert st.kv_remote_tokens_loaded == sum(PROMPT_LENGTHS)
    assert st.kv_remote_blocks_pulled == sum(-(-n // BLOCK) for n in PROMPT_LENGTHS)
    assert st.kv_remote_loads == len(prompts) and st.kv_remote_load_failures == 0
    # The consumer computed only the first token's position of each prompt, never the prompt.
    assert st.prompt_tokens_total == sum(PROMPT_LENGTHS) + len(prompts)
    assert_all_free(producer, consumer)
    assert producer.engine.stats().kv_leases_expired == 0


def test_overlapped_scheduling_on_both_engines(reference):
    """Overlap on (the CUDA default): the prefill leg's lease is taken while the next step is in
    flight, and a loaded request joins the running batch between overlapped steps."""
    producer = make_core("producer", overlap="on")
    consumer = make_core("consumer", overlap="on")
    try:
        prompts = {f"o{i}": prompt(60 + i, n) for i, n in enumerate([7, 19, 33])}
        ref = run(reference, [request(rid, t, 5) for rid, t in prompts.items()])
        legs = prefill_leg(producer, prompts)
        decoded = decode_leg(consumer, prompts, legs, 5)
        for rid in prompts:
            assert legs[rid].tokens + decoded[rid].tokens == ref[rid].tokens
        assert_all_free(producer, consumer)
    finally:
        producer.engine.close()
        consumer.engine.close()


def test_decode_leg_without_the_pull_would_differ(reference, producer, consumer):
    """The parity above is not luck: zeroing the producer's leased blocks changes the decode."""
    prompts = {"z": prompt(50, 29)}
    ref = run(reference, [request("z", prompts["z"], 5)])
    legs = prefill_leg(producer, prompts)
    for t in producer.engine.runner.kv_caches:
        t.zero_()
    decoded = decode_leg(consumer, prompts, legs, 5)
    got = legs["z"].logprobs + decoded["z"].logprobs
    assert not np.allclose(got, ref["z"].logprobs, atol=1e-4)
    assert_all_free(producer, consumer)


def test_shared_prefix_pulls_only_new_blocks(reference, producer, consumer):
    base = prompt(7, 20)  # five full blocks
    first = {"a": base + prompt(8, 6)}
    second = {"b": base + prompt(9, 9)}
    decode_leg(consumer, first, prefill_leg(producer, first), 4)
    pulled_before = consumer.engine.stats().kv_remote_blocks_pulled
    frames_before = producer.engine.kv.server.frames_sent
    legs = prefill_leg(producer, second)
    decoded = decode_leg(consumer, second, legs, 4)
    ref = run(reference, [request("b", second["b"], 4)])
    assert legs["b"].tokens + decoded["b"].tokens == ref["b"].tokens
    new_blocks = -(-29 // BLOCK) - 5
    assert consumer.engine.stats().kv_remote_blocks_pulled - pulled_before == new_blocks
    assert producer.engine.kv.server.frames_sent - frames_before == new_blocks
    assert decoded["b"].final.num_cached_prompt_tokens == 20
    # A prompt the consumer holds whole (six full blocks of "a"): nothing to pull, and the
    # producer's lease is still released (an empty pull).
    third = {"c": first["a"][:24]}
    pulled_before = consumer.engine.stats().kv_remote_blocks_pulled
    legs = prefill_leg(producer, third)
    decoded = decode_leg(consumer, third, legs, 4)
    ref = run(reference, [request("c", third["c"], 4)])
    assert legs["c"].tokens + decoded["c"].tokens == ref["c"].tokens
    assert consumer.engine.stats().kv_remote_blocks_pulled == pulled_before
    assert decoded["c"].final.num_cached_prompt_tokens == 24
    assert_all_free(producer, consumer)
    assert producer.engine.stats().kv_leases_expired == 0


def test_lease_expiry_frees_the_producer_and_a_late_decode_leg_fails_cleanly(consumer):
    producer = make_core("producer", lease_seconds=0.3)
    try:
        prompts = {"e": prompt(11, 18)}
        legs = prefill_leg(producer, prompts)
        assert producer.engine.stats().kv_blocks_used > 0  # held by the lease
        time.sleep(0.4)
        producer.tick()
        st = producer.engine.stats()
        assert (st.kv_blocks_used, st.kv_leases_active, st.kv_leases_expired) == (0, 0, 1)
        decoded = decode_leg(consumer, prompts, legs, 4)
        final = decoded["e"].final
        assert final.finish_reason == FinishReason.ERROR
        assert "kv_transfer_failed" in final.error and "expired" in final.error
        assert decoded["e"].tokens == []
        assert consumer.engine.stats().kv_remote_load_failures == 1
        assert_all_free(producer, consumer)
    finally:
        producer.engine.close()


def test_abort_of_the_prefill_id_releases_the_lease(producer):
    prompts = {"x": prompt(12, 21)}
    prefill_leg(producer, prompts)
    assert producer.engine.stats().kv_leases_active == 1
    producer.apply(CoreAbort(["x-p"]))
    assert_all_free(producer)
    assert producer.engine.stats().kv_leases_expired == 0


def test_abort_of_the_decode_leg_during_the_transfer_frees_both_sides(producer, consumer):
    prompts = {"c": prompt(13, 40)}
    legs = prefill_leg(producer, prompts)
    sending = threading.Event()

    def slow(data: bytes) -> bytes:
        sending.set()
        time.sleep(0.05)  # ten blocks: half a second on the wire
        return data

    producer.engine.kv.server.tamper = slow

    def abort_once_sending(core: EngineCore, step: int) -> None:
        if step == 1:
            assert sending.wait(10)
            assert core.engine.stats().kv_loading_requests == 1
            core.apply(CoreAbort(["c-d"]))

    decoded = decode_leg(consumer, prompts, legs, 4, during=abort_once_sending)
    assert decoded["c"].final.finish_reason == FinishReason.ABORT
    consumer.step()  # the plan that tells the worker to drop the load
    assert consumer.engine.kv.worker.num_loading == 0
    assert_all_free(producer, consumer)
    assert producer.engine.stats().kv_leases_expired == 0  # released by the broken pull, not by time


def test_corrupted_transfer_fails_the_request_and_frees_both_sides(producer, consumer):
    prompts = {"k": prompt(14, 17)}
    legs = prefill_leg(producer, prompts)
    producer.engine.kv.server.tamper = lambda data: bytes([data[0] ^ 0xFF]) + data[1:]
    decoded = decode_leg(consumer, prompts, legs, 4)
    final = decoded["k"].final
    assert final.finish_reason == FinishReason.ERROR
    assert "checksum mismatch" in final.error
    assert decoded["k"].tokens == []
    assert_all_free(producer, consumer)


def test_cuda_ipc_path_through_the_cpu_stand_in(reference):
    """The CUDA IPC transport's handshake, pinning and device-copy path, with the CPU stand-in
    channel in place of CUDA IPC (tandem.gpu_checks.kv_transfer runs the real one)."""
    producer = make_core("producer", transport="cuda_ipc", ipc=InProcessChannel())
    consumer = make_core("consumer", ipc=InProcessChannel())
    try:
        prompts = {f"i{i}": prompt(20 + i, n) for i, n in enumerate([9, 26])}
        legs = prefill_leg(producer, prompts)
        assert all(res.final.kv_transfer_params.remote_transport == "cuda_ipc" for res in legs.values())
        decoded = decode_leg(consumer, prompts, legs, 5)
        ref = run(reference, [request(rid, t, 5) for rid, t in prompts.items()])
        for rid in prompts:
            assert legs[rid].tokens + decoded[rid].tokens == ref[rid].tokens
        assert producer.engine.kv.server.frames_sent == 0  # nothing went over the byte stream
        assert consumer.engine.stats().kv_remote_blocks_pulled == -(-9 // BLOCK) + -(-26 // BLOCK)
        assert_all_free(producer, consumer)
    finally:
        producer.engine.close()
        consumer.engine.close()


def test_sliding_window_model_moves_every_cache_group():
    """Qwen3 with sliding-window layers: two paged groups; the window's blocks behind the first
    local query are neither pulled nor held; logprobs equal one engine's."""
    model = "dummy:tiny-qwen3-sw"
    ref_core = make_core("none", model=model)
    producer = make_core("producer", model=model)
    consumer = make_core("consumer", model=model)
    try:
        assert producer.engine.block_manager.num_groups == 2
        prompts = {f"w{i}": prompt(30 + i, n) for i, n in enumerate([11, 47, 60])}
        ref = run(ref_core, [request(rid, t, 4) for rid, t in prompts.items()])
        legs = prefill_leg(producer, prompts)
        decoded = decode_leg(consumer, prompts, legs, 4)
        for rid in prompts:
            assert legs[rid].tokens + decoded[rid].tokens == ref[rid].tokens
            np.testing.assert_allclose(legs[rid].logprobs + decoded[rid].logprobs, ref[rid].logprobs, atol=1e-4)
        # Full group: every block of the prompt; window-8 group: only from the first query's window.
        lengths = [len(t) for t in prompts.values()]
        expected = sum(-(-n // BLOCK) + -(-n // BLOCK) - first_needed_block(n, 8, BLOCK) for n in lengths)
        assert consumer.engine.stats().kv_remote_blocks_pulled == expected
        assert_all_free(producer, consumer, ref_core)
    finally:
        for core in (ref_core, producer, consumer):
            core.engine.close()


def test_model_info_reports_the_role(producer, consumer):
    info = core_info(producer.engine).model_info()["kv_transfer"]
    from tandem.engine_service.kv_connector.nixl_transport import nixl_available

    # CPU: TCP always, NIXL where the package is installed, never CUDA IPC.
    assert info["role"] == "producer" and info["transports"] == ["tcp"] + (["nixl"] if nixl_available() else [])
    host, port = info["transfer_address"].rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) == producer.engine.kv.server.port > 0
    assert info["engine_id"].startswith("tandem-")
    cinfo = core_info(consumer.engine).model_info()["kv_transfer"]
    assert cinfo["role"] == "consumer" and cinfo["transfer_address"] is None


# -- two `tandem engine` processes over gRPC (the engine core in its own process) -----------------


def _engine_process(tmp_path, role: str, extra: list[str] | None = None):
    from tests.conftest import ServerProcess, free_port, wait_serving

    port = free_port()
    proc = ServerProcess(["engine", "--host", "127.0.0.1", "--port", str(port), "--model", MODEL, "--seed", "3",
                          "--attention-backend", "torch", "--max-model-len", "128", "--block-size", str(BLOCK),
                          "--num-kv-blocks", "128", "--kv-role", role, *(extra or [])],
                         stderr=tmp_path / f"{role}.log")
    address = f"127.0.0.1:{port}"
    try:
        wait_serving(address, "tandem.v1.Engine", 180, proc.proc)
    except Exception:
        proc.stop()
        raise
    return proc, address


def test_two_engine_processes_over_grpc(tmp_path, reference):
    """The same two legs through `tandem engine --kv-role producer|consumer` processes: the
    parameters cross gRPC both ways, and the producer frees the lease after the pull."""
    import grpc
    from google.protobuf import json_format

    from tandem.protocol import kv_transfer_from_proto, kv_transfer_to_proto
    from tandem.v1 import common_pb2, engine_pb2, engine_pb2_grpc

    producer, paddr = _engine_process(tmp_path, "producer", ["--kv-engine-id", "prefill-0"])
    consumer, caddr = _engine_process(tmp_path, "consumer")
    try:
        pstub = engine_pb2_grpc.EngineStub(grpc.insecure_channel(paddr))
        cstub = engine_pb2_grpc.EngineStub(grpc.insecure_channel(caddr))

        def utility(stub, command) -> dict:
            r = stub.Utility(common_pb2.UtilityRequest(command=command), timeout=10)
            return json_format.MessageToDict(r.result)

        info = utility(pstub, common_pb2.UTILITY_COMMAND_MODEL_INFO)["kv_transfer"]
        assert info["role"] == "producer" and info["engine_id"] == "prefill-0"

        def call(stub, rid, tokens, max_tokens, params=None):
            req = engine_pb2.EngineRequest(request_id=rid, prompt_token_ids=tokens, sampling=common_pb2.SamplingParams(
                max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            if params is not None:
                req.kv_transfer_params.CopyFrom(kv_transfer_to_proto(params))
            toks, last = [], None
            for msg in stub.Stream(req, timeout=60):
                toks += list(msg.token_ids)
                last = msg
            return toks, last

        prompts = {f"g{i}": prompt(40 + i, n) for i, n in enumerate([6, 14, 27])}
        ref = run(reference, [request(rid, t, 5) for rid, t in prompts.items()])
        for rid, tokens in prompts.items():
            first, last = call(pstub, rid + "-p", tokens, 1, KVTransferParams(do_remote_decode=True))
            params = kv_transfer_from_proto(last.kv_transfer_params)
            assert params.do_remote_prefill and params.remote_engine_id == "prefill-0"
            rest, _ = call(cstub, rid + "-d", tokens + first, 4, params)
            assert first + rest == ref[rid].tokens
        stats = utility(cstub, common_pb2.UTILITY_COMMAND_STATS)
        assert int(stats["kv_remote_tokens_loaded"]) == sum(len(t) for t in prompts.values())
        deadline = time.monotonic() + 10
        while True:  # released by the pull's end; swept by the idle core (and before STATS answers)
            time.sleep(0.1)
            pstats = utility(pstub, common_pb2.UTILITY_COMMAND_STATS)
            if int(pstats.get("kv_leases_active", 0)) == 0 and int(pstats.get("kv_blocks_used", 0)) == 0:
                break
            assert time.monotonic() < deadline, pstats
        assert int(stats.get("kv_blocks_used", 0)) == 0
    finally:
        producer.stop()
        consumer.stop()
