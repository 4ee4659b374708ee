"""Acceptance 4: stop strings, stop token ids, max_tokens, n > 1 with seeds, logprobs."""

from __future__ import annotations

import pytest
import torch

from tandem.v1 import common_pb2

PROMPT = "List the days of the week, separated by commas:"


@pytest.fixture(scope="module")
def greedy(client_module):
    reply = client_module.generate(PROMPT, max_tokens=40, temperature=0.0, ignore_eos=True)
    return reply.choices[0]


@pytest.fixture(scope="module")
def client_module(serve):
    from tandem.client import TandemClient

    with TandemClient(serve["frontend"]) as c:
        yield c


def _boundary_stop(hf_tokenizer, token_ids):
    """A stop string made of the end of one token and the start of the next."""
    text = ""
    for k in range(2, len(token_ids) - 1):
        a = hf_tokenizer.decode(token_ids[:k])
        b = hf_tokenizer.decode(token_ids[: k + 1])
        if len(a) >= 2 and len(b) - len(a) >= 2 and b.startswith(a):
            stop = a[-2:] + b[len(a): len(a) + 2]
            full = hf_tokenizer.decode(token_ids)
            if stop.strip() and full.find(stop) == len(a) - 2:
                return stop, len(a) - 2
    raise AssertionError("no token boundary suitable for a spanning stop string")


def test_stop_string_spanning_tokens(client_module, greedy, hf_tokenizer):
    stop, where = _boundary_stop(hf_tokenizer, list(greedy.token_ids))
    reply = client_module.generate(PROMPT, max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop])
    c = reply.choices[0]
    assert c.text == greedy.text[:where]
    assert c.finish_reason == common_pb2.FINISH_REASON_STOP
    assert c.stop_str == stop
    # Streaming gives the same trimmed text, never leaking part of the stop string.
    streamed = "".join(ch.text for m in client_module.stream(PROMPT, max_tokens=40, temperature=0.0,
                                                              ignore_eos=True, stop=[stop]) for ch in m.choices)
    assert streamed == greedy.text[:where]


def test_stop_string_included_in_output(client_module, greedy, hf_tokenizer):
    stop, where = _boundary_stop(hf_tokenizer, list(greedy.token_ids))
    reply = client_module.generate(PROMPT, max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop],
                                   include_stop_str_in_output=True)
    assert reply.choices[0].text == greedy.text[: where + len(stop)]


def test_stop_token_ids(client_module, greedy):
    ids = list(greedy.token_ids)
    target = ids[5]
    first = ids.index(target)
    reply = client_module.generate(PROMPT, max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[target])
    c = reply.choices[0]
    assert list(c.token_ids) == ids[: first + 1]
    assert c.finish_reason == common_pb2.FINISH_REASON_STOP
    assert c.stop_token_id == target


def test_max_tokens_gives_length(client_module, greedy):
    reply = client_module.generate(PROMPT, max_tokens=7, temperature=0.0, ignore_eos=True)
    c = reply.choices[0]
    assert list(c.token_ids) == list(greedy.token_ids)[:7]
    assert c.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert reply.usage.completion_tokens == 7


def test_n_choices_distinct_and_reproducible(client_module):
    kwargs = dict(max_tokens=16, temperature=1.0, seed=99, n=4, ignore_eos=True)
    a = client_module.generate("Tell me a fun fact.", **kwargs)
    b = client_module.generate("Tell me a fun fact.", **kwargs)
    assert [c.index for c in a.choices] == [0, 1, 2, 3]
    texts = [c.text for c in a.choices]
    assert len(set(texts)) >= 3, texts
    assert texts == [c.text for c in b.choices]
    assert a.usage.completion_tokens == 4 * 16
    other = client_module.generate("Tell me a fun fact.", **{**kwargs, "seed": 100})
    assert [c.text for c in other.choices] != texts


def test_logprobs_match_transformers(client_module, hf_model):
    reply = client_module.generate(PROMPT, max_tokens=8, temperature=0.0, logprobs=5, ignore_eos=True,
                                   return_prompt_token_ids=True)
    c = reply.choices[0]
    prompt = list(reply.prompt_token_ids)
    out = list(c.token_ids)
    assert len(c.logprobs) == len(out)
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt + out])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)
    for i, lp in enumerate(c.logprobs):
        row = ref[len(prompt) - 1 + i]
        assert lp.token_id == out[i]
        assert lp.logprob == pytest.approx(row[out[i]].item(), abs=2e-3)
        assert lp.rank == 1  # greedy picks the top token
        top_vals, top_ids = row.topk(5)
        assert [t.token_id for t in lp.top] == top_ids.tolist()
        for t, v in zip(lp.top, top_vals.tolist()):
            assert t.logprob == pytest.approx(v, abs=2e-3)
        assert lp.text != "" or out[i] in (0, 1, 2)
