"""Issue 21, acceptance 3: prompt logprobs match transformers' over the real gRPC path.

The shared `tandem serve` (embedded SmolLM2, CPU: at most 16 prompt tokens of a request per
step) computes the prompt in chunks; transformers' AutoModelForCausalLM on the same weights
(float32) is the reference for every position's logprob, rank and top alternatives.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from tandem.v1 import engine_pb2, engine_pb2_grpc

PROMPT = ("The lighthouse keeper climbed the spiral stairs every evening to light the lamp. Ships passing "
          "the rocky coast relied on its beam to find the harbour, and in forty years not one of them had "
          "run aground while he kept watch over the sea.")
TOP = 5
TOL = 2e-3  # float32 on both sides; the engine's paged attention sums in another order


@pytest.fixture(scope="module")
def reference(serve, hf_model):
    """The served answer with prompt logprobs, and transformers' log-softmax over the prompt."""
    from tandem.client import TandemClient

    with TandemClient(serve["frontend"]) as client:
        reply = client.generate(PROMPT, max_tokens=1, temperature=0.0, prompt_logprobs=TOP,
                                return_prompt_token_ids=True)
    ids = list(reply.prompt_token_ids)
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return reply, ids, torch.log_softmax(logits, dim=-1)


def test_prompt_logprobs_match_transformers(reference, hf_tokenizer):
    reply, ids, hf = reference
    assert len(ids) > 2 * 16  # three chunks or more at 16 tokens a step
    entries = list(reply.prompt_logprobs)
    assert [e.token_id for e in entries] == ids[1:]  # position 0 has none; one entry per later position
    for t, e in enumerate(entries, start=1):
        row = hf[t - 1]  # the distribution after tokens 0 .. t-1
        expected = row[ids[t]].item()
        assert e.logprob == pytest.approx(expected, abs=TOL), t
        # The rank up to tokens within the tolerance of the prompt token (near-ties may swap).
        above = int((row > expected + TOL).sum())
        near = int(((row - expected).abs() <= TOL).sum())
        assert above + 1 <= e.rank <= above + near, (t, e.rank, above, near)
        assert e.text == hf_tokenizer.decode([ids[t]])
        assert len(e.top) == TOP
        hf_top = torch.topk(row, TOP).values.tolist()
        assert [a.logprob for a in e.top] == pytest.approx(hf_top, abs=TOL)
        for alt in e.top:
            assert row[alt.token_id].item() == pytest.approx(alt.logprob, abs=TOL)
            assert alt.text == hf_tokenizer.decode([alt.token_id])


def test_the_engine_reports_them_chunk_by_chunk(reference, serve):
    reply, ids, _ = reference
    request = engine_pb2.EngineRequest(request_id="prompt-logprobs-chunks", prompt_token_ids=ids)
    request.sampling.max_tokens = 1
    request.sampling.temperature = 0.0
    request.sampling.prompt_logprobs = TOP
    with grpc.insecure_channel(serve["engine"]) as channel:
        messages = list(engine_pb2_grpc.EngineStub(channel).Stream(request, timeout=120))
    pieces = [list(m.prompt_logprobs) for m in messages if m.prompt_logprobs]
    assert len(pieces) >= 3, [len(p) for p in pieces]
    joined = [e for piece in pieces for e in piece]
    assert [e.token_id for e in joined] == ids[1:]
    assert [e.logprob for e in joined] == pytest.approx([e.logprob for e in reply.prompt_logprobs], abs=1e-5)
    assert all(e.text == "" for e in joined)  # the engine holds no text


def test_a_cached_prompt_is_computed_again_for_prompt_logprobs(reference, client):
    reply, ids, _ = reference
    plain = client.generate(prompt_token_ids=ids, max_tokens=1, temperature=0.0)
    assert plain.usage.cached_prompt_tokens > 0  # the blocks of the first request are cached
    again = client.generate(prompt_token_ids=ids, max_tokens=1, temperature=0.0, prompt_logprobs=TOP)
    assert again.usage.cached_prompt_tokens == 0
    assert [e.logprob for e in again.prompt_logprobs] == pytest.approx(
        [e.logprob for e in reply.prompt_logprobs], abs=1e-5)


def test_stream_and_n_choices(reference, client):
    reply, ids, _ = reference
    streamed = [e for msg in client.stream(prompt_token_ids=ids, max_tokens=3, temperature=0.0, prompt_logprobs=1)
                for e in msg.prompt_logprobs]
    assert [e.token_id for e in streamed] == ids[1:]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in reply.prompt_logprobs], abs=1e-5)
    two = client.generate(prompt_token_ids=ids, max_tokens=2, temperature=0.0, n=2, prompt_logprobs=0)
    assert len(two.choices) == 2 and [e.token_id for e in two.prompt_logprobs] == ids[1:]  # once per request
    assert all(len(e.top) == 0 for e in two.prompt_logprobs)


@pytest.mark.parametrize("value", [21, -1])
def test_out_of_range_is_invalid_argument(client, value):
    with pytest.raises(grpc.RpcError) as err:
        client.generate("Hello", max_tokens=1, prompt_logprobs=value)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_logprobs" in err.value.details()
