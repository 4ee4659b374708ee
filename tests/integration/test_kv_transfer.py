"""Disaggregated prefill/decode through two engine cores on CPU (issue #12, engine side).

Engine A is a producer (`--kv-role producer`), engine B a consumer; both are `EngineCore`s over
real `LLMEngine`s (tiny dummy Llama, varied greedy outputs), driven message by message as the
core loop drives them; A serves pulls on a real TCP socket from its own thread. A third engine
with no role is the reference. Every test ends by checking that every block and every state slot
on every engine is free (leases included). The hybrid section (tiny Qwen3-Next / Qwen3.5: Gated
DeltaNet state slots next to paged attention) moves the state slot with the blocks.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from tandem.core_protocol import CoreAbort, CoreRequest, FinishReason, KVTransferParams, SamplingParams
from tandem.engine_service.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig, SchedulerConfig
from tandem.engine_service.core.engine_core import EngineCore, core_info
from tandem.engine_service.core.engine import LLMEngine
from tandem.engine_service.cache.block_manager import first_needed_block
from tandem.engine_service.kv_connector.cuda_ipc import InProcessChannel

MODEL = "dummy:tiny-llama"
BLOCK = 4
VOCAB = 300


def config(role: str, model: str = MODEL, lease_seconds: float = 30.0, transport: str = "tcp",
           overlap: str = "off", checkpoint_stride: int | None = None) -> EngineConfig:
    return EngineConfig(
        ModelConfig(model=model, attention_backend="torch", max_model_len=128, seed=3),
        CacheConfig(block_size=BLOCK, num_blocks=128, state_checkpoint_stride=checkpoint_stride),
        SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64, overlap_scheduling=overlap),
        # Producers bind port 0 on loopback: consumers trust every loopback port (development).
        KVTransferConfig(role=role, lease_seconds=lease_seconds, transport=transport, producers=["127.0.0.1:*"]),
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
    """Every block, state slot and lease on every engine is free (released leases are swept on
    tick); no state checkpoint save is left pending."""
    deadline = time.monotonic() + timeout
    for core in cores:
        while True:
            core.tick()
            st = core.engine.stats()
            if (st.kv_blocks_used, st.group_blocks_used, st.kv_leases_active, st.kv_loading_requests,
                    st.num_running, st.num_waiting, st.state_slots_used) == (0, 0, 0, 0, 0, 0, 0):
                break
            assert time.monotonic() < deadline, f"blocks or leases left: {st}"
            time.sleep(0.02)
        bm = core.engine.block_manager
        for pool in bm.pools:
            assert all(b.ref_count == 0 for b in pool.blocks), "a block is still referenced"
        if bm.state_slots is not None:
            assert bm.state_slots.num_used == 0, "a state slot is still held"
            assert bm.state_slots.num_free == bm.state_slots.num_slots
        if bm.checkpoints is not None:
            assert bm.checkpoints.num_pending == 0, "a checkpoint save is still pending"


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
        assert "kv_transfer_refused" in final.error and "expired" in final.error
        assert decoded["e"].tokens == []
        assert consumer.engine.stats().kv_remote_load_failures == 1
        assert_all_free(producer, consumer)
    finally:
        producer.engine.close()


def test_lease_expiry_is_published_without_another_request():
    """Issue 19 item 9: an idle core whose lease expires publishes stats at once, so the
    snapshot the metrics read (`CoreClient.stats_snapshot`) stops reporting the lease active."""
    import asyncio

    from tandem.engine_service.api.inproc_client import InProcessCoreClient

    async def scenario() -> None:
        client = InProcessCoreClient(LLMEngine(config("producer", lease_seconds=0.3)))
        client.start()
        try:
            stream = client.submit("e-p", prompt(12, 18), greedy(1), kv_transfer_params=KVTransferParams(
                do_remote_decode=True))
            while not (await stream.next_batch())[-1].finished:
                pass
            assert client.stats_snapshot.kv_leases_active == 1
            deadline = time.monotonic() + 5
            while client.stats_snapshot.kv_leases_active:
                assert time.monotonic() < deadline, "the expired lease is still reported active"
                await asyncio.sleep(0.02)
            snap = client.stats_snapshot
            assert (snap.kv_leases_expired, snap.kv_blocks_used) == (1, 0)
        finally:
            client.stop()

    asyncio.run(scenario())


def test_refused_decode_legs_release_the_lease_at_once_and_foreign_leases_are_refused(producer, consumer):
    """Items 4 and 7: a num_prompt_tokens mismatch is refused (kv_transfer_refused, the client's
    status INVALID_ARGUMENT) and frees the lease now, not at expiry; a decode leg with another
    prompt's lease (its secret included) gets nothing, decodes no token and frees the lease."""
    import msgspec

    prompts = {"m": prompt(21, 17), "o": prompt(22, 17)}
    legs = prefill_leg(producer, prompts)
    mismatch = msgspec.structs.replace(legs["m"].final.kv_transfer_params, num_prompt_tokens=18)
    foreign = legs["o"].final.kv_transfer_params  # "o"'s lease on "m"'s prompt
    out = run(consumer, [request("m-d", prompts["m"] + [legs["m"].tokens[0]], 3, mismatch),
                         request("x-d", prompts["m"] + [legs["o"].tokens[0]], 3, foreign)])
    assert "kv_transfer_refused" in out["m-d"].final.error and "num_prompt_tokens" in out["m-d"].final.error
    assert "kv_transfer_refused" in out["x-d"].final.error and "another prompt" in out["x-d"].final.error
    assert out["m-d"].tokens == [] and out["x-d"].tokens == []
    assert_all_free(producer, consumer, timeout=5.0)  # the leases last 30 s: released, not expired
    assert producer.engine.stats().kv_leases_expired == 0


def test_a_killed_producer_ends_the_decode_leg_unavailable(consumer):
    """Item 8: the producer process is gone before the pull: the decode leg ends with
    kv_producer_unavailable (UNAVAILABLE for the client: retry both legs), and frees its blocks."""
    producer = make_core("producer")
    prompts = {"k": prompt(23, 17)}
    legs = prefill_leg(producer, prompts)
    producer.engine.close()  # the pull port closes with it
    decoded = decode_leg(consumer, prompts, legs, 4)
    final = decoded["k"].final
    assert final.finish_reason == FinishReason.ERROR
    assert final.error.startswith("kv_producer_unavailable"), final.error
    assert decoded["k"].tokens == []
    assert_all_free(consumer)


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
    info = core_info(producer.engine).kv_transfer
    from tandem.engine_service.kv_connector.nixl_transport import nixl_available

    # CPU: TCP always, NIXL where the package is installed, never CUDA IPC.
    assert info["role"] == "producer" and info["transports"] == ["tcp"] + (["nixl"] if nixl_available() else [])
    host, port = info["transfer_address"].rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) == producer.engine.kv.server.port > 0
    assert info["engine_id"].startswith("tandem-")
    cinfo = core_info(consumer.engine).kv_transfer
    assert cinfo["role"] == "consumer" and cinfo["transfer_address"] is None


# -- two `tandem engine` processes over gRPC (the engine core in its own process) -----------------


def _engine_process(tmp_path, role: str, extra: list[str] | None = None):
    from tests.conftest import ServerProcess, free_port, wait_serving

    port = free_port()
    proc = ServerProcess(["engine", "--host", "127.0.0.1", "--port", str(port), "--model", MODEL, "--seed", "3",
                          "--attention-backend", "torch", "--max-model-len", "128", "--block-size", str(BLOCK),
                          "--num-kv-blocks", "128", "--kv-role", role, "--kv-producer", "127.0.0.1:*", *(extra or [])],
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

    from tandem.proto_wire import kv_transfer_from_proto, kv_transfer_to_proto
    from tandem.v1 import common_pb2, engine_pb2, engine_pb2_grpc

    producer, paddr = _engine_process(tmp_path, "producer", ["--kv-engine-id", "prefill-0"])
    consumer, caddr = _engine_process(tmp_path, "consumer")
    try:
        pstub = engine_pb2_grpc.EngineStub(grpc.insecure_channel(paddr))
        cstub = engine_pb2_grpc.EngineStub(grpc.insecure_channel(caddr))

        def utility(stub, command) -> dict:
            r = stub.Utility(common_pb2.UtilityRequest(command=command), timeout=10)
            return json_format.MessageToDict(r.result)

        info = pstub.GetModelInfo(engine_pb2.EngineModelInfoRequest(), timeout=10).kv_transfer
        assert info.role == "producer" and info.engine_id == "prefill-0"

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


# -- hybrid models: the state slot travels with the blocks ------------------------------------------

HYBRID_MODELS = ["dummy:tiny-qwen3-next", "dummy:tiny-qwen3.5"]
STRIDE = 2 * BLOCK  # state checkpoint stride: prompts below reach past it
# 8 and 16: exact multiples of the block size (and of the stride); 23 and 30: past the stride.
HYBRID_LENGTHS = [5, 8, 13, 16, 23, 30]


class Hybrid:
    """A reference, a producer and a consumer of one hybrid model (checkpoints every STRIDE)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.ref = make_core("none", model=model, checkpoint_stride=STRIDE)
        self.producer = make_core("producer", model=model, checkpoint_stride=STRIDE)
        self.consumer = make_core("consumer", model=model, checkpoint_stride=STRIDE)

    def close(self) -> None:
        for core in (self.ref, self.producer, self.consumer):
            core.engine.close()


@pytest.fixture(scope="module", params=HYBRID_MODELS)
def hybrid(request) -> Hybrid:
    h = Hybrid(request.param)
    yield h
    h.close()


def _state_io(core: EngineCore):
    from tandem.engine_service.kv_connector.state_io import StateSlotIO

    bm = core.engine.block_manager
    runner = core.engine.runner
    return StateSlotIO(runner.cache_layout, runner.cache_tensors, bm.state_slots.num_slots)


def test_hybrid_two_legs_equal_one_engine(hybrid):
    """Blocks and the state slot after exactly the prompt: the decode leg continues it."""
    prompts = {f"h{i}": prompt(200 + i, n) for i, n in enumerate(HYBRID_LENGTHS)}
    max_tokens = 6
    consumer_before = hybrid.consumer.engine.stats()
    ref = run(hybrid.ref, [request(rid, t, max_tokens) for rid, t in prompts.items()])
    legs = prefill_leg(hybrid.producer, prompts)
    bm = hybrid.producer.engine.block_manager
    assert bm.state_slots.num_used == len(prompts)  # every slot held by its lease
    slots = [legs[rid].final.kv_transfer_params.remote_state_slot for rid in prompts]
    assert None not in slots and len(set(slots)) == len(prompts)
    decoded = decode_leg(hybrid.consumer, prompts, legs, max_tokens)
    for rid in prompts:
        assert decoded[rid].final.error is None, decoded[rid].final.error
        assert legs[rid].tokens + decoded[rid].tokens == ref[rid].tokens, rid
        np.testing.assert_allclose(legs[rid].logprobs + decoded[rid].logprobs, ref[rid].logprobs, atol=1e-4)
    assert len({tuple(r.tokens) for r in ref.values()}) == len(prompts)
    st = hybrid.consumer.engine.stats()
    blocks = sum(-(-n // BLOCK) for n in HYBRID_LENGTHS)
    assert st.kv_remote_blocks_pulled - consumer_before.kv_remote_blocks_pulled == blocks
    block_bytes = hybrid.consumer.engine.kv.worker.block_io.block_bytes[0]
    slot_bytes = hybrid.consumer.engine.kv.worker.state_io.slot_bytes
    assert slot_bytes > 0
    assert (st.kv_remote_bytes_pulled - consumer_before.kv_remote_bytes_pulled
            == blocks * block_bytes + len(prompts) * slot_bytes)
    # The consumer computed only the first token's position of each prompt.
    assert st.prompt_tokens_total - consumer_before.prompt_tokens_total == sum(HYBRID_LENGTHS) + len(prompts)
    assert_all_free(hybrid.producer, hybrid.consumer, hybrid.ref)


def test_hybrid_decode_leg_without_the_state_would_differ(hybrid):
    """The parity above is not luck: zeroing the producer's leased state slot (its blocks kept)
    changes the decode."""
    prompts = {"hz": prompt(220, 19)}
    ref = run(hybrid.ref, [request("hz", prompts["hz"], 5)])
    legs = prefill_leg(hybrid.producer, prompts)
    slot = legs["hz"].final.kv_transfer_params.remote_state_slot
    io = _state_io(hybrid.producer)
    io.write_slot(slot, bytes(io.slot_bytes))
    decoded = decode_leg(hybrid.consumer, prompts, legs, 5)
    assert decoded["hz"].final.error is None
    assert not np.allclose(legs["hz"].logprobs + decoded["hz"].logprobs, ref["hz"].logprobs, atol=1e-4)
    assert_all_free(hybrid.producer, hybrid.consumer, hybrid.ref)


def test_hybrid_shared_prefix_pulls_only_new_blocks_and_restores_no_local_checkpoint(hybrid):
    """The consumer holds a prefix's K/V (and a state checkpoint inside it): the decode leg hits
    the K/V alone, pulls only the blocks after them plus the state, and restores no checkpoint
    over the pulled state."""
    from tandem.engine_service.sequence import SamplingParams as SeqParams
    from tandem.engine_service.sequence import Sequence

    consumer, producer = hybrid.consumer, hybrid.producer
    base = prompt(230, 5 * BLOCK)  # five full blocks, two checkpoint positions (8, 16)
    # A local request on the consumer caches the base's blocks and its state checkpoints.
    run(consumer, [request("local", base + prompt(231, 3), 2)])
    second = {"hb": base + prompt(232, 9)}
    legs = prefill_leg(producer, second)
    cbm = consumer.engine.block_manager
    probe = Sequence("probe", second["hb"] + [legs["hb"].tokens[0]], SeqParams(max_tokens=1))
    assert cbm.match_prefix(probe) == 2 * STRIDE  # a local hit would restore the checkpoint at 16
    assert cbm.match_prefix(probe, state_loaded=True) == 5 * BLOCK  # the pulled state needs K/V only
    restored = cbm.checkpoints.num_restored
    pulled = consumer.engine.stats().kv_remote_blocks_pulled
    frames = producer.engine.kv.server.frames_sent
    decoded = decode_leg(consumer, second, legs, 5)
    ref = run(hybrid.ref, [request("hb", second["hb"], 5)])
    assert legs["hb"].tokens + decoded["hb"].tokens == ref["hb"].tokens
    assert cbm.checkpoints.num_restored == restored
    new_blocks = -(-len(second["hb"]) // BLOCK) - 5
    assert consumer.engine.stats().kv_remote_blocks_pulled - pulled == new_blocks
    assert producer.engine.kv.server.frames_sent - frames == new_blocks + 1  # the blocks, then the state
    assert decoded["hb"].final.num_cached_prompt_tokens == 5 * BLOCK
    # A prompt the consumer holds whole: no block to pull, the state still comes.
    third = {"hc": second["hb"][:6 * BLOCK]}
    legs = prefill_leg(producer, third)
    pulled = consumer.engine.stats().kv_remote_blocks_pulled
    frames = producer.engine.kv.server.frames_sent
    decoded = decode_leg(consumer, third, legs, 4)
    ref = run(hybrid.ref, [request("hc", third["hc"], 4)])
    assert legs["hc"].tokens + decoded["hc"].tokens == ref["hc"].tokens
    assert consumer.engine.stats().kv_remote_blocks_pulled == pulled
    assert producer.engine.kv.server.frames_sent - frames == 1
    assert decoded["hc"].final.num_cached_prompt_tokens == 6 * BLOCK
    assert_all_free(producer, consumer, hybrid.ref)
    assert producer.engine.stats().kv_leases_expired == 0


def test_hybrid_cuda_ipc_path_through_the_cpu_stand_in(hybrid):
    """The state tensors are exported with the cache tensors and the slot copied device to device."""
    producer = make_core("producer", model=hybrid.model, transport="cuda_ipc", ipc=InProcessChannel(),
                         checkpoint_stride=STRIDE)
    consumer = make_core("consumer", model=hybrid.model, ipc=InProcessChannel(), checkpoint_stride=STRIDE)
    try:
        prompts = {f"hi{i}": prompt(240 + i, n) for i, n in enumerate([7, 16, 26])}
        legs = prefill_leg(producer, prompts)
        assert all(res.final.kv_transfer_params.remote_transport == "cuda_ipc" for res in legs.values())
        decoded = decode_leg(consumer, prompts, legs, 5)
        ref = run(hybrid.ref, [request(rid, t, 5) for rid, t in prompts.items()])
        for rid in prompts:
            assert decoded[rid].final.error is None, decoded[rid].final.error
            assert legs[rid].tokens + decoded[rid].tokens == ref[rid].tokens
        assert producer.engine.kv.server.frames_sent == 0  # nothing went over the byte stream
        assert_all_free(producer, consumer, hybrid.ref)
    finally:
        producer.engine.close()
        consumer.engine.close()


def test_hybrid_overlapped_scheduling_never_feeds_the_first_token_on_the_producer(hybrid):
    """Overlap on: a prefill leg of max_tokens 1 is not scheduled again while its token is
    pending, so its slot holds the state after exactly the prompt; a leg that fed a generated
    token (max_tokens 2) gets no lease, and its decode leg would compute the prompt itself."""
    producer = make_core("producer", model=hybrid.model, overlap="on", checkpoint_stride=STRIDE)
    consumer = make_core("consumer", model=hybrid.model, overlap="on", checkpoint_stride=STRIDE)
    try:
        prompts = {f"ho{i}": prompt(250 + i, n) for i, n in enumerate([9, 24])}
        ref = run(hybrid.ref, [request(rid, t, 5) for rid, t in prompts.items()])
        legs = prefill_leg(producer, prompts)
        decoded = decode_leg(consumer, prompts, legs, 5)
        for rid in prompts:
            assert legs[rid].tokens + decoded[rid].tokens == ref[rid].tokens
        two = run(producer, [request("ho-2", prompt(252, 11), 2, KVTransferParams(do_remote_decode=True))])
        final = two["ho-2"].final
        assert final.finish_reason == FinishReason.LENGTH and len(two["ho-2"].tokens) == 2
        assert final.kv_transfer_params.lease_id is None and not final.kv_transfer_params.do_remote_prefill
        assert producer.engine.stats().kv_leases_active == 0
        assert_all_free(producer, consumer, hybrid.ref)
    finally:
        producer.engine.close()
        consumer.engine.close()


@pytest.fixture(scope="module")
def hybrid_next() -> Hybrid:
    h = Hybrid(HYBRID_MODELS[0])
    yield h
    h.close()


def test_hybrid_lease_expiry_frees_blocks_and_the_state_slot(hybrid_next):
    producer = make_core("producer", model=hybrid_next.model, lease_seconds=0.3)
    try:
        prompts = {"he": prompt(260, 18)}
        legs = prefill_leg(producer, prompts)
        bm = producer.engine.block_manager
        assert producer.engine.stats().kv_blocks_used > 0 and bm.state_slots.num_used == 1  # the lease's
        time.sleep(0.4)
        producer.tick()
        st = producer.engine.stats()
        assert (st.kv_blocks_used, st.kv_leases_active, st.kv_leases_expired, bm.state_slots.num_used) == (0, 0, 1, 0)
        decoded = decode_leg(hybrid_next.consumer, prompts, legs, 4)
        final = decoded["he"].final
        assert final.finish_reason == FinishReason.ERROR
        assert "kv_transfer_refused" in final.error and "expired" in final.error
        assert_all_free(producer, hybrid_next.consumer)
    finally:
        producer.engine.close()


def test_hybrid_aborts_free_blocks_and_state_slots_on_both_sides(hybrid_next):
    producer, consumer = hybrid_next.producer, hybrid_next.consumer
    # Abort of the prefill id: the lease, its blocks and its slot go.
    prefill_leg(producer, {"ha": prompt(270, 21)})
    assert producer.engine.block_manager.state_slots.num_used == 1
    producer.apply(CoreAbort(["ha-p"]))
    assert_all_free(producer)
    # Abort of the decode leg while the blocks are on the wire: both sides free everything.
    prompts = {"hd": prompt(271, 40)}
    legs = prefill_leg(producer, prompts)
    sending = threading.Event()

    def slow(data: bytes) -> bytes:
        sending.set()
        time.sleep(0.05)
        return data

    producer.engine.kv.server.tamper = slow

    def abort_once_sending(core: EngineCore, step: int) -> None:
        if step == 1:
            assert sending.wait(10)
            assert core.engine.block_manager.state_slots.num_used == 1  # taken for the load
            core.apply(CoreAbort(["hd-d"]))

    try:
        decoded = decode_leg(consumer, prompts, legs, 4, during=abort_once_sending)
    finally:
        producer.engine.kv.server.tamper = None
    assert decoded["hd"].final.finish_reason == FinishReason.ABORT
    consumer.step()  # the plan that tells the worker to drop the load
    assert consumer.engine.kv.worker.num_loading == 0
    assert_all_free(producer, consumer)
    assert producer.engine.stats().kv_leases_expired == 0


def test_hybrid_corrupted_state_frame_fails_the_decode_leg_and_frees_both_sides(hybrid_next):
    producer, consumer = hybrid_next.producer, hybrid_next.consumer
    prompts = {"hk": prompt(280, 17)}
    legs = prefill_leg(producer, prompts)
    producer.engine.kv.server.tamper_state = lambda data: data[:-1] + bytes([data[-1] ^ 0xFF])
    try:
        decoded = decode_leg(consumer, prompts, legs, 4)
    finally:
        producer.engine.kv.server.tamper_state = None
    final = decoded["hk"].final
    assert final.finish_reason == FinishReason.ERROR
    assert "kv_producer_unavailable" in final.error and "checksum mismatch in the state" in final.error
    assert decoded["hk"].tokens == []
    assert_all_free(producer, consumer)


def test_hybrid_decode_leg_without_a_state_slot_is_refused(hybrid_next):
    producer, consumer = hybrid_next.producer, hybrid_next.consumer
    prompts = {"hn": prompt(290, 14)}
    legs = prefill_leg(producer, prompts)
    params = legs["hn"].final.kv_transfer_params
    params.remote_state_slot = None  # e.g. a producer that does not offer state
    decoded = decode_leg(consumer, prompts, legs, 4)
    final = decoded["hn"].final
    assert final.finish_reason == FinishReason.ERROR
    assert "kv_transfer_refused" in final.error and "remote_state_slot" in final.error
    assert decoded["hn"].tokens == []
    producer.apply(CoreAbort(["hn-p"]))  # the refused leg never contacted the producer
    assert_all_free(producer, consumer)
