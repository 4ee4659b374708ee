"""Acceptance 7: cancelling a stream mid-way frees every engine block and every ID mapping."""

from __future__ import annotations

import time

import grpc
import pytest


def _idle(client) -> tuple[dict, dict]:
    stats = client.utility("stats")
    return next(iter(stats["engines"].values())), stats["frontend"]


def _wait_idle(client, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        engine, front = _idle(client)
        if (engine["num_running"] == 0 and engine["kv_blocks_used"] == 0 and engine["in_flight"] == 0
                and front["in_flight"] == 0 and front["in_flight_choices"] == 0):
            return engine, front
        if time.monotonic() > deadline:
            raise AssertionError(f"resources not released: engine={engine} frontend={front}")
        time.sleep(0.05)


def test_cancel_stream_midway_frees_everything(client):
    _wait_idle(client)
    call = client.stream("Count from one to one thousand:", max_tokens=400, temperature=0.0, ignore_eos=True, n=2,
                         request_id="cancel-me")
    received = 0
    for msg in call:
        received += sum(len(c.token_ids) for c in msg.choices)
        if received >= 4:
            break
    engine, front = _idle(client)
    assert engine["num_running"] + engine["num_waiting"] >= 1  # still generating before the cancel
    call.cancel()
    _wait_idle(client)
    # The external ID is free again: reusing it is accepted.
    reply = client.generate("Hi", max_tokens=2, temperature=0.0, request_id="cancel-me")
    assert reply.request_id == "cancel-me"


def test_abort_by_request_id(client):
    _wait_idle(client)
    call = client.stream("Count from one to one thousand:", max_tokens=400, temperature=0.0, ignore_eos=True,
                         request_id="abort-me")
    it = iter(call)
    next(it)
    client.utility("abort", request_id="abort-me")
    finals = []
    tokens_after = 0
    for msg in it:
        for c in msg.choices:
            tokens_after += len(c.token_ids)
            if c.finish_reason:
                finals.append(c.finish_reason)
    from tandem.v1 import common_pb2

    assert finals == [common_pb2.FINISH_REASON_ABORT]
    assert tokens_after < 400
    _wait_idle(client)


def test_duplicate_in_flight_request_id_refused(client):
    call = client.stream("Count slowly:", max_tokens=200, temperature=0.0, ignore_eos=True, request_id="dup-1")
    next(iter(call))
    with pytest.raises(grpc.RpcError) as err:
        client.generate("Hi", max_tokens=2, request_id="dup-1")
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    call.cancel()
    _wait_idle(client)
