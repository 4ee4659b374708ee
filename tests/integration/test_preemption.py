"""Acceptance 6: with a tiny KV pool, concurrent requests preempt, recompute and still finish
with exactly the outputs they have without memory pressure."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

PROMPTS = [f"Write a short story about a robot number {i} who learns to paint." for i in range(8)]
KWARGS = dict(max_tokens=48, temperature=0.0, ignore_eos=True)


def test_tiny_kv_pool_preempts_and_matches(client, launch_serve):
    from tandem.client import TandemClient

    reference = [list(client.generate(p, **KWARGS).choices[0].token_ids) for p in PROMPTS]
    # 10 blocks x 16 tokens = 160 slots: one request (~16 + 48 tokens) fits, eight at once do not.
    _, frontend, _ = launch_serve(["--num-kv-blocks", "10", "--block-size", "16", "--max-num-seqs", "8"])
    with TandemClient(frontend) as small:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            replies = list(pool.map(lambda p: small.generate(p, **KWARGS), PROMPTS))
        stats = next(iter(small.utility("stats")["engines"].values()))
    for p, ref, reply in zip(PROMPTS, reference, replies):
        assert list(reply.choices[0].token_ids) == ref, p
    assert stats["num_preemptions"] > 0
    assert stats["kv_blocks_used"] == 0
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
