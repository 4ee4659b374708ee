"""Issue #12, acceptance 1: `tandem serve --disaggregated` (a prefill engine, a decode engine and a
frontend) gives the single-engine greedy outputs, streaming and unary, through the two-leg path."""

from __future__ import annotations

import grpc
import pytest

from tandem.client import TandemClient
from tandem.v1 import common_pb2, engine_pb2, engine_pb2_grpc

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "Once upon a time, in a small village,",
    "The quick brown fox",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "My favourite colour is",
    "Translate to French: good morning",
]
LONG_PREFIX = (
    "The following is a detailed description of the solar system. The Sun is the star at the centre. "
    "Mercury is the smallest planet and closest to the Sun. Venus has a thick toxic atmosphere. "
    "Earth is the only planet known to support life. Mars is called the red planet. "
)


@pytest.fixture(scope="module")
def disagg(launch_serve, get_free_port):
    decode_port = get_free_port()
    server, frontend, prefill = launch_serve(["--disaggregated", "--decode-engine-port", str(decode_port),
                                              "--allow-admin-commands", "--frontend-workers", "1",
                                              # fixed pools: two engines on one GPU cannot each size by free memory
                                              "--num-kv-blocks", "1024"])
    decode = f"127.0.0.1:{decode_port}"
    with TandemClient(frontend) as client:
        yield {"client": client, "prefill": prefill, "decode": decode, "process": server}


def engine_generate(address: str, request_id: str, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """The single-engine answer: the same prompt straight to one engine, no transfer."""
    with grpc.insecure_channel(address) as channel:
        req = engine_pb2.EngineRequest(request_id=request_id, prompt_token_ids=prompt_ids)
        req.sampling.max_tokens = max_tokens
        req.sampling.temperature = 0.0
        return list(engine_pb2_grpc.EngineStub(channel).Generate(req, timeout=60).token_ids)


def engine_stats(client: TandemClient, address: str) -> dict:
    return client.utility("stats")["engines"][address]


def test_greedy_outputs_equal_the_single_engine_outputs(disagg):
    client = disagg["client"]
    replies = [client.generate(p, max_tokens=12, temperature=0.0, return_prompt_token_ids=True) for p in PROMPTS]
    for i, reply in enumerate(replies):
        choice = reply.choices[0]
        expected = engine_generate(disagg["prefill"], f"ref-{i}", list(reply.prompt_token_ids), 12)
        assert list(choice.token_ids) == expected, PROMPTS[i]
        assert choice.finish_reason in (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP)
        # Usage counts the prompt once and every completion token (first token + decode leg's).
        assert reply.usage.prompt_tokens == len(reply.prompt_token_ids)
        assert reply.usage.completion_tokens == len(choice.token_ids)
        assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
        assert 0 < reply.timings.ttft <= reply.timings.latency


def test_streaming_gives_the_same_tokens_first_token_first(disagg):
    client = disagg["client"]
    prompt = PROMPTS[3]
    unary = client.generate(prompt, max_tokens=10, temperature=0.0)
    msgs = list(client.stream(prompt, max_tokens=10, temperature=0.0))
    streamed = [t for m in msgs for c in m.choices for t in c.token_ids]
    assert streamed == list(unary.choices[0].token_ids)
    assert list(msgs[0].choices[0].token_ids) == streamed[:1]  # the prefill leg's token, alone
    assert "".join(c.text for m in msgs for c in m.choices) == unary.choices[0].text
    final = msgs[-1]
    assert final.usage.completion_tokens == len(streamed) and final.choices[-1].finish_reason


def test_n_choices_stop_strings_and_one_token(disagg):
    client = disagg["client"]
    reply = client.generate(PROMPTS[0], max_tokens=8, temperature=0.0, n=2)
    assert len(reply.choices) == 2 and reply.choices[0].token_ids == reply.choices[1].token_ids
    assert reply.usage.completion_tokens == 2 * len(reply.choices[0].token_ids)
    full = client.generate(PROMPTS[4], max_tokens=12, temperature=0.0).choices[0].text
    stop = full.strip().split()[2]  # a word the decode leg produces
    cut = client.generate(PROMPTS[4], max_tokens=12, temperature=0.0, stop=[stop]).choices[0]
    assert cut.finish_reason == common_pb2.FINISH_REASON_STOP and cut.stop_str == stop
    assert stop not in cut.text and full.startswith(cut.text)
    one = client.generate(PROMPTS[0], max_tokens=1, temperature=0.0)  # prefill leg only
    assert len(one.choices[0].token_ids) == 1 and one.choices[0].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert one.usage.completion_tokens == 1


def test_prompt_logprobs_come_from_the_prefill_leg(disagg):
    client = disagg["client"]
    prompt = LONG_PREFIX + PROMPTS[1]
    for stream in (False, True):
        if stream:
            msgs = list(client.stream(prompt, max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=2,
                                      return_prompt_token_ids=True))
            entries = [e for m in msgs for e in m.prompt_logprobs]
            ids = list(msgs[-1].prompt_token_ids)
            tokens = [t for m in msgs for c in m.choices for t in c.token_ids]
        else:
            reply = client.generate(prompt, max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=2,
                                    return_prompt_token_ids=True)
            entries, ids = list(reply.prompt_logprobs), list(reply.prompt_token_ids)
            tokens = list(reply.choices[0].token_ids)
        assert [e.token_id for e in entries] == ids[1:] and all(e.text for e in entries)
        assert len(tokens) == 6  # the decode leg ran (it was not asked for prompt logprobs)
        # The same numbers as one engine computing the whole prompt itself.
        request = engine_pb2.EngineRequest(request_id=f"ref-prompt-logprobs-{stream}", prompt_token_ids=ids)
        request.sampling.max_tokens = 1
        request.sampling.prompt_logprobs = 2
        with grpc.insecure_channel(disagg["prefill"]) as channel:
            ref = engine_pb2_grpc.EngineStub(channel).Generate(request, timeout=60)
        assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in ref.prompt_logprobs], abs=1e-5)


def test_a_decode_leg_refuses_prompt_logprobs(disagg):
    request = engine_pb2.EngineRequest(request_id="decode-leg-prompt-logprobs", prompt_token_ids=[1, 2, 3])
    request.sampling.max_tokens = 2
    request.sampling.prompt_logprobs = 1
    request.kv_transfer_params.do_remote_prefill = True
    with grpc.insecure_channel(disagg["decode"]) as channel, pytest.raises(grpc.RpcError) as err:
        engine_pb2_grpc.EngineStub(channel).Generate(request, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_logprobs" in err.value.details()


def test_frontend_reports_both_pools(disagg):
    info = disagg["client"].server_info()
    assert info.disaggregated
    assert [(e.address, e.role, e.kv_role) for e in info.engines] == [
        (disagg["prefill"], "prefill", "producer"), (disagg["decode"], "decode", "consumer")]
    stats = disagg["client"].utility("stats")
    assert set(stats["engines"]) == {disagg["prefill"], disagg["decode"]}


def test_structured_output_across_the_two_legs(disagg):
    """The prefill leg samples the first token under the constraint, the decode leg's matcher
    consumes it (num_constrained_prompt_tokens) and continues: every answer matches."""
    import json
    import re

    import jsonschema

    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["color", "n"], "additionalProperties": False}
    client = disagg["client"]
    reply = client.generate(PROMPTS[7], max_tokens=30, temperature=1.0, seed=5, n=6, json_schema=json.dumps(schema))
    for c in reply.choices:
        assert c.finish_reason == common_pb2.FINISH_REASON_STOP, c.text
        jsonschema.validate(json.loads(c.text), schema)
    reply = client.generate(PROMPTS[2], max_tokens=12, temperature=1.0, seed=9, n=6, regex="[0-9]{2}(, [0-9]{2}){2}")
    for c in reply.choices:
        assert re.fullmatch("[0-9]{2}(, [0-9]{2}){2}", c.text) and len(c.token_ids) > 1, c.text


def _kv(client: TandemClient, address: str) -> dict:
    stats = engine_stats(client, address)
    return {k: int(stats.get(k, 0)) for k in ("kv_remote_tokens_loaded", "kv_remote_blocks_pulled",
                                               "prefix_cache_hits", "kv_leases_active", "kv_blocks_used")}


def test_decode_engine_loads_the_prompt_remotely_and_only_new_blocks_later(disagg):
    client = disagg["client"]
    client.utility("flush_prefix_cache")  # both pools: nothing cached on either engine
    with grpc.insecure_channel(disagg["decode"]) as ch:
        info = engine_pb2_grpc.EngineStub(ch).GetModelInfo(engine_pb2.EngineModelInfoRequest(), timeout=10)
    block_size = info.block_size
    assert info.kv_transfer.role == "consumer"
    kwargs = dict(max_tokens=6, temperature=0.0, return_prompt_token_ids=True)
    before = _kv(client, disagg["decode"])
    first = client.generate(LONG_PREFIX + "Question: which planet has rings? Answer:", **kwargs)
    after_first = _kv(client, disagg["decode"])
    n1 = len(first.prompt_token_ids)
    # A cold decode engine pulls the whole prompt: every token the producer's KV covers.
    assert after_first["kv_remote_tokens_loaded"] - before["kv_remote_tokens_loaded"] == n1
    assert after_first["kv_remote_blocks_pulled"] - before["kv_remote_blocks_pulled"] == -(-n1 // block_size)
    second = client.generate(LONG_PREFIX + "Question: which planet is red? Answer:", **kwargs)
    after_second = _kv(client, disagg["decode"])
    n2 = len(second.prompt_token_ids)
    own_hit = after_second["prefix_cache_hits"] - after_first["prefix_cache_hits"]
    assert own_hit >= 3 * block_size  # the shared prefix's full blocks, from the first decode leg
    loaded = after_second["kv_remote_tokens_loaded"] - after_first["kv_remote_tokens_loaded"]
    assert loaded == n2 - own_hit  # only what the decode engine did not hold
    assert after_second["kv_remote_blocks_pulled"] - after_first["kv_remote_blocks_pulled"] == -(-loaded // block_size)
    # The outputs are the single-engine ones, and nothing is left held on either engine.
    expected = engine_generate(disagg["prefill"], "ref-prefix", list(second.prompt_token_ids), 6)
    assert list(second.choices[0].token_ids) == expected
    for address in (disagg["prefill"], disagg["decode"]):
        left = _kv(client, address)
        assert left["kv_leases_active"] == 0 and left["kv_blocks_used"] == 0, (address, left)


# -- a hybrid model (Gated DeltaNet state slots travel with the blocks) -------------------------------


@pytest.fixture(scope="module")
def disagg_hybrid(launch_serve, get_free_port, smollm2_dir):
    """The same topology over dummy tiny Qwen3.5 (random weights, a 320-token vocabulary: prompts
    go as token ids; the embedded model's tokenizer only renders the output)."""
    decode_port = get_free_port()
    server, frontend, prefill = launch_serve(["--disaggregated", "--decode-engine-port", str(decode_port),
                                              "--model", "dummy:tiny-qwen3.5", "--tokenizer", str(smollm2_dir),
                                              "--allow-admin-commands", "--frontend-workers", "1",
                                              "--num-kv-blocks", "256", "--max-model-len", "256"])
    with TandemClient(frontend) as client:
        yield {"client": client, "prefill": prefill, "decode": f"127.0.0.1:{decode_port}"}


def test_hybrid_model_two_legs_equal_the_single_engine_and_free_every_slot(disagg_hybrid):
    import random

    client = disagg_hybrid["client"]
    rng = random.Random(5)
    before = _kv(client, disagg_hybrid["decode"])
    lengths = [13, 32, 70]  # 32: an exact multiple of the block size
    for i, n in enumerate(lengths):
        ids = [rng.randrange(3, 300) for _ in range(n)]
        reply = client.generate(prompt_token_ids=ids, max_tokens=6, temperature=0.0)
        expected = engine_generate(disagg_hybrid["prefill"], f"ref-h{i}", ids, 6)
        assert list(reply.choices[0].token_ids) == expected
    after = _kv(client, disagg_hybrid["decode"])
    # Every prompt's KV (and state) came from the producer: the decode engine computed none of it.
    assert after["kv_remote_tokens_loaded"] - before["kv_remote_tokens_loaded"] == sum(lengths)
    for address in (disagg_hybrid["prefill"], disagg_hybrid["decode"]):
        left = _kv(client, address)
        slots = int(engine_stats(client, address).get("state_slots_used", 0))
        assert left["kv_leases_active"] == 0 and left["kv_blocks_used"] == 0 and slots == 0, (address, left, slots)
