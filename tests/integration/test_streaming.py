"""Acceptance 3: stream deltas add up to the unary answer; multi-byte characters stay whole."""

from __future__ import annotations

from tandem.v1 import common_pb2


def _collect(call):
    texts, ids, finals = [], [], []
    for msg in call:
        for c in msg.choices:
            texts.append(c.text)
            ids.extend(c.token_ids)
            if c.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                finals.append(c.finish_reason)
        last = msg
    return texts, ids, finals, last


def test_stream_concatenation_equals_unary_with_seed(client):
    kwargs = dict(max_tokens=40, temperature=0.9, top_p=0.95, seed=1234)
    unary = client.generate("Once upon a time", **kwargs)
    texts, ids, finals, last = _collect(client.stream("Once upon a time", **kwargs))
    assert "".join(texts) == unary.choices[0].text
    assert ids == list(unary.choices[0].token_ids)
    assert finals == [unary.choices[0].finish_reason]
    assert last.usage.completion_tokens == len(ids)
    assert len(texts) > 1  # really streamed


def test_multibyte_characters_never_split(client, hf_tokenizer):
    # A seeded, hot sampling over a prompt in Japanese and emoji yields many multi-byte
    # characters whose bytes span several byte-level BPE tokens.
    kwargs = dict(max_tokens=60, temperature=1.3, seed=7, ignore_eos=True)
    prompt = "日本語で猫についての短い詩を書いてください。🐱🌸"
    texts, ids, _, _ = _collect(client.stream(prompt, **kwargs))
    full = "".join(texts)
    assert full == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert any(len(ch.encode()) >= 3 for ch in full), full  # the test really covers multi-byte text
    for delta in texts:
        assert "\ufffd" not in delta
        delta.encode("utf-8")  # a lone surrogate or split character would fail here
