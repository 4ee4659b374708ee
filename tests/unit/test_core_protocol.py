"""The torch-free core protocol: import hygiene, msgpack round trips, typed KV transfer params,
and `EngineCore` / both core clients over a tiny dummy model (no servers)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from tandem.core_protocol import (
    CoreAbort,
    CoreCodec,
    CoreFailed,
    CoreOutputs,
    CoreRequest,
    CoreShutdown,
    EngineStats,
    FinishReason,
    FlushResult,
    KVTransferParams,
    RequestOutput,
    SamplingParams,
    SchedulerReason,
    SchedulerStop,
    StopSequence,
    StopToken,
    TokenLogprobs,
    UtilityCall,
    UtilityCommand,
    UtilityResult,
)

TORCH_FREE_MODULES = [
    "tandem.frontend.server",  # the frontend (acceptance: importing it never imports torch)
    "tandem.frontend.app",
    "tandem.proto_wire",
    "tandem.core_protocol",
    "tandem.engine_service.api.server",  # the gRPC side of the engine service
    "tandem.engine_service.api.app",
    "tandem.engine_service.api.mp_client",
    "tandem.engine_service.api.metrics",
]


@pytest.mark.parametrize("module", TORCH_FREE_MODULES)
def test_module_imports_without_torch(module):
    # A fresh interpreter: this test process has torch loaded already.
    code = f"import sys, {module}; bad = sorted(m for m in ('torch', 'transformers.configuration_utils') if m in sys.modules); print(bad)"
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"importing {module} imported {out.stdout.strip()}"


def test_every_input_message_round_trips():
    codec = CoreCodec()
    kv = KVTransferParams(do_remote_decode=True, remote_block_ids=[3, 4], remote_host="10.0.0.2", remote_port=7000,
                          extra={"transfer_id": "x"})
    messages = [
        CoreRequest(request_id="r", prompt_token_ids=[1, 2], sampling=SamplingParams(max_tokens=4, temperature=0.0,
                    stop_token_sequences=[[5, 6]]), arrival_time=12.5, channel="ch", kv_transfer_params=kv),
        CoreAbort(["a", "b"]),
        UtilityCall(7, UtilityCommand.FLUSH_PREFIX_CACHE),
        CoreShutdown(),
    ]
    for msg in messages:
        assert codec.input_decoder.decode(codec.encoder.encode(msg)) == msg


def test_every_core_message_round_trips_with_typed_stop_reasons():
    codec = CoreCodec()
    outputs = [
        RequestOutput("a", [5], [TokenLogprobs(5, -0.1, 1, [(5, -0.1), (6, -2.0)])], True, FinishReason.STOP,
                      StopToken(5)),
        RequestOutput("b", [6, 7], [None, None], True, FinishReason.STOP, StopSequence(1)),
        RequestOutput("c", finished=True, finish_reason=FinishReason.ERROR,
                      stop_reason=SchedulerStop(SchedulerReason.KV_CACHE_TOO_SMALL), error="kv_cache_too_small"),
        RequestOutput("d", [8]),
    ]
    messages = [
        CoreOutputs(outputs=outputs, stats=EngineStats(num_running=2, steps_total=9), step_time=0.01, stepped=True,
                    added_requests=1, added_tokens=3, timestamp=5.0),
        UtilityResult(1, EngineStats(kv_blocks_total=10)),
        UtilityResult(2, FlushResult(True)),
        UtilityResult(3, error="boom"),
        CoreFailed("engine core failed: x"),
    ]
    for msg in messages:
        back = codec.message_decoder.decode(codec.encoder.encode(msg))
        assert back == msg
    back = codec.message_decoder.decode(codec.encoder.encode(messages[0]))
    assert isinstance(back.outputs[1].stop_reason, StopSequence) and back.outputs[1].stop_reason.index == 1


def test_kv_transfer_params_from_a_struct_dict():
    # A protobuf Struct carries numbers as doubles; unnamed keys land in `extra`.
    params = KVTransferParams.from_dict({"do_remote_prefill": True, "remote_engine_id": "e1", "remote_port": 5600.0,
                                         "remote_block_ids": [1.0, 2.0], "remote_host": "h", "tp_size": 2.0})
    assert params.remote_port == 5600 and params.remote_block_ids == [1, 2] and params.do_remote_prefill
    assert params.extra == {"tp_size": 2.0}
    assert params.to_dict() == {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_port": 5600,
                                "remote_block_ids": [1, 2], "remote_host": "h", "tp_size": 2.0}
    for bad in ({"remote_port": 1.5}, {"remote_port": "x"}, {"remote_block_ids": "1,2"}, {"remote_engine_id": 3.0}):
        with pytest.raises(ValueError):
            KVTransferParams.from_dict(bad)


# -- EngineCore and the two clients over a tiny dummy model ----------------------------------------


def _config(fail_after_steps=None):
    from tandem.engine_service.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

    return EngineConfig(ModelConfig(model="dummy:tiny-qwen3", attention_backend="torch", max_model_len=128),
                        CacheConfig(block_size=4, num_blocks=64), SchedulerConfig(max_num_seqs=8))


@pytest.fixture(scope="module")
def engine():
    from tandem.engine_service.core.engine import LLMEngine

    return LLMEngine(_config())


def _request(rid: str, max_tokens: int = 5, kv=None) -> CoreRequest:
    return CoreRequest(request_id=rid, prompt_token_ids=[11, 12, 13, 14, 15], arrival_time=1.0,
                       sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                       kv_transfer_params=kv)


def test_engine_core_batches_one_message_per_step_and_returns_kv_params(engine):
    from tandem.engine_service.core.engine_core import EngineCore

    core = EngineCore(engine)
    steps0 = engine.counters.steps
    kv = KVTransferParams(do_remote_decode=True, extra={"k": "v"})
    core.apply(_request("a", kv=kv))
    core.apply(_request("b"))
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    finals: dict[str, RequestOutput] = {}
    batches = 0
    last = None
    while core.has_work():
        batch = core.step()
        if batch is None:  # a call that only told the worker of endings: no step, no message
            continue
        last = batch
        batches += 1
        assert len({o.request_id for o in batch.outputs}) == len(batch.outputs)  # one delta per request
        for o in batch.outputs:
            tokens[o.request_id] += o.new_token_ids
            if o.finished:
                finals[o.request_id] = o
    assert batches == engine.counters.steps - steps0 == last.stats.steps_total - steps0  # one message per step
    assert tokens["a"] == tokens["b"] and len(tokens["a"]) == 5  # same prompt, greedy
    assert finals["a"].kv_transfer_params == kv and finals["b"].kv_transfer_params is None
    assert finals["a"].finish_reason == FinishReason.LENGTH
    stats = core.apply(UtilityCall(1, UtilityCommand.STATS)).result
    assert stats.num_running == 0 and stats.generation_tokens_total >= 10


def test_engine_core_abort_and_fault_hook(engine):
    from tandem.engine_service.core.engine_core import EngineCore, InjectedFault

    core = EngineCore(engine)
    core.apply(_request("x", max_tokens=50))
    core.step()
    core.apply(CoreAbort(["x", "never-seen"]))
    batch = core.step()
    aborted = {o.request_id: o for o in batch.outputs if o.finished}
    assert aborted["x"].finish_reason == FinishReason.ABORT and aborted["x"].num_prompt_tokens == 5
    # It was in a step: its stamp goes out with the abort (queue time, the engine's spans).
    assert aborted["x"].first_scheduled_time is not None and aborted["x"].first_scheduled_time >= 1.0
    assert aborted["never-seen"].first_scheduled_time is None
    assert aborted["never-seen"].finish_reason == FinishReason.ABORT and aborted["never-seen"].arrival_time == 0.0
    core = EngineCore(engine, fail_after_steps=engine.counters.steps + 2)
    core.apply(_request("y", max_tokens=50))
    with pytest.raises(InjectedFault):
        for _ in range(5):
            core.step()
    engine.abort("y")
    while engine.has_work():
        engine.step()


async def _drive(client, rid: str, max_tokens: int = 6) -> tuple[list[int], RequestOutput]:
    stream = client.submit(rid, [11, 12, 13, 14, 15], SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                       ignore_eos=True))
    tokens = []
    while True:
        for o in await stream.next_batch():
            tokens += o.new_token_ids
            if o.finished:
                return tokens, o


def test_in_process_client_serves_and_answers_utility(engine):
    from tandem.engine_service.api.inproc_client import InProcessCoreClient

    async def main():
        client = InProcessCoreClient(engine)
        client.start()
        try:
            (ta, fa), (tb, fb) = await asyncio.gather(_drive(client, "p"), _drive(client, "q"))
            assert ta == tb and len(ta) == 6 and fa.finish_reason == FinishReason.LENGTH
            stats = await client.utility(UtilityCommand.STATS)
            assert isinstance(stats, EngineStats) and stats.num_running == 0
            assert (await client.utility(UtilityCommand.FLUSH_PREFIX_CACHE)).flushed is True
            assert client.num_in_flight == 0 and client.queue_depth() == (0, 0)
        finally:
            client.stop()

    asyncio.run(main())


def test_multiprocess_client_matches_in_process_and_reports_core_death(engine):
    import os
    import signal

    from tandem.engine_service.api.mp_client import MultiprocessCoreClient

    expected = None

    async def reference():
        from tandem.engine_service.api.inproc_client import InProcessCoreClient

        client = InProcessCoreClient(engine)
        client.start()
        try:
            return (await _drive(client, "ref", 8))[0]
        finally:
            client.stop()

    expected = asyncio.run(reference())

    async def main():
        client = await MultiprocessCoreClient.launch(_config(), log_level="warning")
        deaths = []
        client.on_fatal = deaths.append
        client.start()
        try:
            tokens, final = await _drive(client, "m", 8)
            assert tokens == expected  # same weights (dummy seed), same greedy tokens
            assert isinstance(await client.utility(UtilityCommand.STATS), EngineStats)
            # kill -9 the core while a request is in flight: it ends with ERROR, once.
            stream = client.submit("long", [11, 12, 13], SamplingParams(max_tokens=100, temperature=0.0,
                                                                         ignore_eos=True))
            await stream.next_batch()
            os.kill(client.core_pid, signal.SIGKILL)
            ending = None
            while ending is None:
                for o in await asyncio.wait_for(stream.next_batch(), 30):
                    if o.finished:
                        ending = o
            assert ending.finish_reason == FinishReason.ERROR and "engine core" in ending.error
            assert "died" in ending.error and deaths and not client.alive
            assert client.num_in_flight == 0
        finally:
            client.stop()

    asyncio.run(main())


def test_core_process_dies_with_its_parent(tmp_path):
    # A gRPC process killed with -9 must not leave its core (and its GPU memory) or the IPC
    # socket directory behind.
    import os
    import signal
    import time

    script = tmp_path / "parent.py"
    script.write_text(
        "import asyncio, sys\n"
        "from tandem.engine_service.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig\n"
        "from tandem.engine_service.api.mp_client import MultiprocessCoreClient\n"
        "async def main():\n"
        "    cfg = EngineConfig(ModelConfig(model='dummy:tiny-qwen3', attention_backend='torch', max_model_len=128),\n"
        "                       CacheConfig(block_size=4, num_blocks=16), SchedulerConfig())\n"
        "    client = await MultiprocessCoreClient.launch(cfg, log_level='warning')\n"
        "    print('CORE_PID', client.core_pid, flush=True)\n"
        "    await asyncio.sleep(600)\n"
        "asyncio.run(main())\n")
    parent = subprocess.Popen([sys.executable, "-P", str(script)], stdout=subprocess.PIPE, text=True)
    try:
        line = ""
        while not line.startswith("CORE_PID"):  # skip log lines
            line = parent.stdout.readline()
            assert line, "the parent exited before its core was ready"
        core_pid = int(line.split()[1])
        os.kill(core_pid, 0)  # alive
        argv = open(f"/proc/{core_pid}/cmdline").read().split("\0")
        socket_dir = os.path.dirname(argv[argv.index("--input") + 1][len("ipc://"):])
        assert os.path.isdir(socket_dir)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 15
        gone = False
        while time.monotonic() < deadline and not gone:
            try:
                os.kill(core_pid, 0)
                # A zombie (dead, not yet reaped by init) counts as gone.
                with open(f"/proc/{core_pid}/stat") as f:
                    gone = f.read().split(")")[-1].split()[0] == "Z"
            except (ProcessLookupError, FileNotFoundError):
                gone = True
            time.sleep(0.1)
        assert gone, f"core process {core_pid} outlived its parent"
        # ... and it took the socket directory its killed parent could not remove.
        assert not os.path.exists(socket_dir)
    finally:
        if parent.poll() is None:
            parent.kill()


def test_idle_spin_setting_and_spin_for_input(monkeypatch):
    import time

    import zmq

    from tandem.engine_service.core.core_process import idle_spin_seconds, spin_for_input

    monkeypatch.delenv("TANDEM_CORE_IDLE_SPIN_MS", raising=False)
    assert idle_spin_seconds() == 0.0  # off by default
    monkeypatch.setenv("TANDEM_CORE_IDLE_SPIN_MS", "2.5")
    assert idle_spin_seconds() == pytest.approx(0.0025)
    monkeypatch.setenv("TANDEM_CORE_IDLE_SPIN_MS", "-1")
    assert idle_spin_seconds() == 0.0
    monkeypatch.setenv("TANDEM_CORE_IDLE_SPIN_MS", "fast")
    with pytest.raises(ValueError, match="TANDEM_CORE_IDLE_SPIN_MS"):
        idle_spin_seconds()

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        pull.bind("inproc://spin")
        push.connect("inproc://spin")
        assert spin_for_input(pull, 0.0) is False  # off: returns at once
        t0 = time.monotonic()
        assert spin_for_input(pull, 0.05) is False  # nothing came: gives up after the window
        assert time.monotonic() - t0 >= 0.05
        push.send(b"x")
        t0 = time.monotonic()
        assert spin_for_input(pull, 5.0) is True  # a waiting message ends the spin at once
        assert time.monotonic() - t0 < 1.0
        assert pull.recv() == b"x"  # and is left for the loop to read
    finally:
        pull.close(0)
        push.close(0)
        ctx.term()


def test_core_process_with_idle_spin_serves_requests_that_come_during_and_after_it(engine, monkeypatch):
    from tandem.engine_service.api.inproc_client import InProcessCoreClient
    from tandem.engine_service.api.mp_client import MultiprocessCoreClient

    async def reference():
        client = InProcessCoreClient(engine)
        client.start()
        try:
            return (await _drive(client, "spin-ref", 6))[0]
        finally:
            client.stop()

    expected = asyncio.run(reference())
    monkeypatch.setenv("TANDEM_CORE_IDLE_SPIN_MS", "100")

    async def main():
        client = await MultiprocessCoreClient.launch(_config(), log_level="warning")
        client.start()
        try:
            # The second request lands while the core spins, the third after it blocked again.
            for i, pause in enumerate((0.0, 0.01, 0.3)):
                await asyncio.sleep(pause)
                tokens, final = await asyncio.wait_for(_drive(client, f"spin-{i}", 6), 30)
                assert tokens == expected and final.finish_reason == FinishReason.LENGTH
        finally:
            client.stop()

    asyncio.run(main())


def test_kv_transfer_tandem_fields_round_trip_through_a_struct_dict():
    """Tandem's own transfer fields survive the Struct's doubles and come back as ints."""
    data = {"do_remote_prefill": True, "remote_group_block_ids": [[1.0, 2.0], [7.0]], "remote_state_slot": 3.0,
            "num_prompt_tokens": 40.0, "first_token_id": 1234.0, "lease_id": "L1", "lease_expiry_unix": 1.5e9,
            "remote_transport": "tcp", "block_size": 16.0}
    params = KVTransferParams.from_dict(data)
    assert params.remote_group_block_ids == [[1, 2], [7]]
    assert (params.remote_state_slot, params.num_prompt_tokens, params.first_token_id, params.block_size) == (3, 40, 1234, 16)
    assert params.extra == {}
    assert KVTransferParams.from_dict(params.to_dict()) == params
    with pytest.raises(ValueError, match="remote_group_block_ids"):
        KVTransferParams.from_dict({"remote_group_block_ids": [[1.5]]})
    with pytest.raises(ValueError, match="first_token_id"):
        KVTransferParams.from_dict({"first_token_id": 2.5})


def test_deadlines_travel_into_the_core_and_end_requests_deadline_exceeded(engine):
    """Deadlines in the core protocol: a CoreRequest's deadline survives the codec; an expired
    request is ended without running (deadline_exceeded, mapped to DEADLINE_EXCEEDED) and holds
    nothing; one whose deadline is not reached runs as usual. (A running request stopped at its
    deadline: tests/unit/test_scheduler.py.)"""
    import time

    import grpc

    from tandem.core_protocol import CoreCodec, CoreRequest, SchedulerReason, SchedulerStop
    from tandem.engine_service.api.inproc_client import InProcessCoreClient
    from tandem.engine_service.api.server import error_status

    codec = CoreCodec()
    req = CoreRequest(request_id="d", prompt_token_ids=[1], sampling=SamplingParams(), arrival_time=1.0, deadline=2.5)
    assert codec.input_decoder.decode(codec.encoder.encode(req)).deadline == 2.5

    async def collect(stream):
        tokens = []
        while True:
            for o in await stream.next_batch():
                tokens += o.new_token_ids
                if o.finished:
                    return tokens, o

    async def main():
        client = InProcessCoreClient(engine)
        client.start()
        try:
            params = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
            expired = client.submit("expired", [11, 12, 13], params, deadline=time.monotonic() - 1)
            tokens, final = await collect(expired)
            assert tokens == [] and final.finish_reason == FinishReason.ERROR
            assert final.stop_reason == SchedulerStop(SchedulerReason.DEADLINE_EXCEEDED)
            assert error_status(final) == grpc.StatusCode.DEADLINE_EXCEEDED
            tokens, final = await collect(client.submit("later", [11, 12, 13], params, deadline=time.monotonic() + 60))
            assert final.finish_reason == FinishReason.LENGTH and tokens  # a deadline not reached changes nothing
            stats = await client.utility(UtilityCommand.STATS)
            assert (stats.num_running, stats.num_waiting, stats.kv_blocks_used) == (0, 0, 0)
        finally:
            client.stop()

    asyncio.run(main())
