"""Issue #10 failures 2, 3, 5 and 6 as the issue reproduced them, against a live `tandem serve`:
each request below was accepted with garbage, failed with UNKNOWN or RESOURCE_EXHAUSTED, or was
refused with an internal field name at 23644c4."""

from __future__ import annotations

import time

import grpc
import pytest


def test_tiny_temperature_generates_the_greedy_text(client):
    """Failure 3: temperature 1e-38 / 1e-45 is greedy (before: token 0 every step, empty text)."""
    greedy = client.generate("The capital of France is", max_tokens=6, temperature=0.0)
    for t in (1e-38, 1e-45):
        reply = client.generate("The capital of France is", max_tokens=6, temperature=t)
        assert reply.choices[0].text and list(reply.choices[0].token_ids) == list(greedy.choices[0].token_ids)


@pytest.mark.parametrize("field,kwargs,code", [
    ("repetition_penalty", dict(repetition_penalty=1e-40), "INVALID_ARGUMENT"),  # failure 3
    ("seed", dict(seed=2**63 - 1, n=2), "INVALID_ARGUMENT"),  # failure 5: before, UNKNOWN with a traceback
    ("model", dict(model="m" * 100_000), "NOT_FOUND"),  # failure 6: before, RESOURCE_EXHAUSTED
    ("kv_transfer_params", dict(kv_transfer_params={"blob": "x" * (1 << 20)}), "INVALID_ARGUMENT"),  # failure 6
], ids=["repetition_penalty", "seed", "model", "kv_transfer_params"])
def test_refused_with_the_field_named(client, field, kwargs, code):
    with pytest.raises(grpc.RpcError) as err:
        client.generate("Hello", max_tokens=2, **kwargs)
    assert err.value.code() == grpc.StatusCode[code], err.value.details()
    assert err.value.details().startswith(field) and len(err.value.details()) < 300


def test_stop_string_within_the_documented_limit_is_accepted(client):
    """Failure 6: 100 emoji (within 256 characters) is a valid stop string (before: refused as
    `stop_token_sequences: each needs 1..64 tokens`)."""
    reply = client.generate("Hello", max_tokens=4, temperature=0.0, stop=["🙂" * 100])
    assert len(reply.choices[0].token_ids) == 4


def test_oversized_prompt_is_refused_without_tokenizing(client):
    """Failure 2: a 4 MiB prompt is refused by size at once (before: ~1.8 s of tokenizing first)."""
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        client.generate("a" * (4 * 1024 * 1024 - 64), max_tokens=2)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("prompt")
    assert time.monotonic() - started < 1.0  # tokenizing it alone took ~1.8 s
