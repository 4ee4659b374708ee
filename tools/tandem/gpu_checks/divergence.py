"""Where two greedy runs of the same prompts first differ, and whether that is a near tie.

Two runs that compute the same tokens through different kernels or batch shapes (one engine
against a prefill and a decode engine; overlapped scheduling off against on, whose steps group
requests differently) round differently in bfloat16, and with random weights the top logits are
close, so greedy picks can flip. A divergence counts as a near tie when the token the second run
chose is within TIE_NATS of the first run's token in the first run's log-probabilities at that
position: rounding, not a wrong result. Anything else (a clear gap, a token outside the first
run's top TOP_LOGPROBS, a run that stopped early) is a mismatch.
"""

from __future__ import annotations

TOP_LOGPROBS = 20
TIE_NATS = 0.1


def judge_divergence(single: list[int], disaggregated: list[int], single_top: list[dict[int, float]]) -> dict | None:
    """None when the two token lists are equal; else where they first differ and whether that is a
    near tie: `single_top[i]` maps the first run's top tokens at position i to their
    log-probabilities."""
    if single == disaggregated:
        return None
    i = next((k for k, (a, b) in enumerate(zip(single, disaggregated)) if a != b), min(len(single), len(disaggregated)))
    verdict = {"position": i, "single": single, "disaggregated": disaggregated, "near_tie": False, "gap_nats": None}
    if i < min(len(single), len(disaggregated)) and i < len(single_top):
        top = single_top[i]
        if single[i] in top and disaggregated[i] in top:
            gap = top[single[i]] - top[disaggregated[i]]
            verdict.update(gap_nats=round(gap, 5), near_tie=gap <= TIE_NATS)
    return verdict
