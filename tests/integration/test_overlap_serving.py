"""Overlapped scheduling through the real path: `tandem serve --overlap-scheduling on` (the GPU
default, forced on here on CPU) answers exactly as the default CPU server, which runs each step
to completion: greedy chat replies all at once (they also equal transformers), seeded sampling
with n > 1 and logprobs, streaming with a stop string, and a penalty request that makes the
engine finish the step in flight before sampling. Nothing is left allocated afterwards."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "How many legs does a spider have?",
    "Give me a synonym for happy.",
]


@pytest.fixture(scope="module")
def overlapped(launch_serve):
    from tandem.client import TandemClient

    _, frontend, _ = launch_serve(["--overlap-scheduling", "on"])
    with TandemClient(frontend) as c:
        yield c


def _chat(c, q, **kwargs):
    return c.chat([{"role": "user", "content": q}], **kwargs)


def test_greedy_batch_matches_the_step_by_step_server(client, overlapped):
    kwargs = dict(max_tokens=24, temperature=0.0)
    want = [list(_chat(client, q, **kwargs).choices[0].token_ids) for q in QUESTIONS]
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        got = list(pool.map(lambda q: _chat(overlapped, q, **kwargs), QUESTIONS))
    assert [list(r.choices[0].token_ids) for r in got] == want
    assert "Paris" in got[0].choices[0].text


def test_seeded_n2_logprobs_and_penalties_match(client, overlapped):
    for kwargs in (
        dict(max_tokens=16, temperature=0.9, top_p=0.9, seed=11, n=2, logprobs=2),
        dict(max_tokens=16, temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5),
    ):
        want = client.generate("Once upon a time", **kwargs)
        got = overlapped.generate("Once upon a time", **kwargs)
        assert len(got.choices) == len(want.choices)
        for a, b in zip(want.choices, got.choices):
            assert list(b.token_ids) == list(a.token_ids), kwargs
            assert b.text == a.text and b.finish_reason == a.finish_reason
            for la, lb in zip(a.logprobs, b.logprobs):
                assert lb.token_id == la.token_id and abs(lb.logprob - la.logprob) < 1e-4


def test_stream_with_stop_string_matches(client, overlapped):
    kwargs = dict(max_tokens=40, temperature=0.0, ignore_eos=True)
    full = client.generate("The history of Rome", **kwargs).choices[0].text
    stop = full.split()[5]
    want = client.generate("The history of Rome", stop=[stop], **kwargs).choices[0]
    texts = [c.text for msg in overlapped.stream("The history of Rome", stop=[stop], **kwargs) for c in msg.choices]
    assert "".join(texts) == want.text and stop not in want.text
    stats = next(iter(overlapped.utility("stats")["engines"].values()))
    assert stats["overlap_scheduling"] is True
    assert not next(iter(client.utility("stats")["engines"].values()))["overlap_scheduling"]
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_cancel_mid_stream_frees_the_in_flight_step(overlapped):
    """Cancelling while a step is in flight: the engine frees the blocks that step still writes
    and drops its token; nothing stays allocated and the ID can be reused."""
    import time

    call = overlapped.stream("Count from one to one thousand:", max_tokens=300, temperature=0.0, ignore_eos=True,
                             n=2, request_id="overlap-cancel")
    received = 0
    for msg in call:
        received += sum(len(c.token_ids) for c in msg.choices)
        if received >= 6:
            break
    call.cancel()
    deadline = time.monotonic() + 10.0
    while True:
        stats = overlapped.utility("stats")
        engine, frontend = next(iter(stats["engines"].values())), stats["frontend"]
        if engine["kv_blocks_used"] == 0 and engine["num_running"] == 0 and frontend["in_flight"] == 0:
            break
        assert time.monotonic() < deadline, f"not released: engine={engine} frontend={frontend}"
        time.sleep(0.05)
    assert engine["aborted_requests_total"] >= 2
    assert overlapped.generate("Hi", max_tokens=2, request_id="overlap-cancel").request_id == "overlap-cancel"
