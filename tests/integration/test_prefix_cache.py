"""Acceptance 5: a shared long prefix is served from the cache and changes nothing."""

from __future__ import annotations

LONG_PREFIX = (
    "The following is a detailed description of the solar system. The Sun is the star at the centre. "
    "Mercury is the smallest planet and closest to the Sun. Venus has a thick toxic atmosphere. "
    "Earth is the only planet known to support life. Mars is called the red planet. Jupiter is the "
    "largest planet, a gas giant with a great red spot. Saturn is famous for its rings. Uranus rotates "
    "on its side. Neptune is the farthest planet and has strong winds. "
)


def test_shared_prefix_reports_cached_tokens_and_same_output(client):
    q_a = LONG_PREFIX + "Question: which planet has rings? Answer:"
    q_b = LONG_PREFIX + "Question: which planet is red? Answer:"
    kwargs = dict(max_tokens=12, temperature=0.0)
    client.utility("flush_prefix_cache")
    cold_b = client.generate(q_b, **kwargs)
    client.utility("flush_prefix_cache")
    a = client.generate(q_a, **kwargs)
    warm_b = client.generate(q_b, **kwargs)
    assert a.usage.cached_prompt_tokens == 0
    assert warm_b.usage.cached_prompt_tokens >= 96  # most of the ~120-token shared prefix, block-aligned
    assert warm_b.usage.cached_prompt_tokens < warm_b.usage.prompt_tokens
    assert list(warm_b.choices[0].token_ids) == list(cold_b.choices[0].token_ids)
    stats = client.utility("stats")
    engine = next(iter(stats["engines"].values()))
    assert engine["prefix_cache_hits"] >= warm_b.usage.cached_prompt_tokens
