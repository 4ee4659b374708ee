"""How the GPU checks judge two greedy runs (`tandem.gpu_checks.divergence`: one engine against
two in kv_transfer, overlap off against on in model_parity)."""

from __future__ import annotations

from tandem.gpu_checks.divergence import TIE_NATS, judge_divergence


def test_equal_tokens_have_no_divergence():
    assert judge_divergence([5, 6, 7], [5, 6, 7], [{5: -1.0}, {6: -1.0}, {7: -1.0}]) is None


def test_a_flip_between_nearly_equal_tokens_is_a_near_tie():
    top = [{5: -1.0}, {6: -2.0, 9: -2.0 - TIE_NATS / 2}, {7: -1.0}]
    verdict = judge_divergence([5, 6, 7], [5, 9, 1], top)
    assert verdict["position"] == 1 and verdict["near_tie"]
    assert abs(verdict["gap_nats"] - TIE_NATS / 2) < 1e-9


def test_a_clear_difference_or_an_unranked_token_is_a_mismatch():
    top = [{5: -1.0, 8: -1.0 - 3 * TIE_NATS}]
    clear = judge_divergence([5], [8], top)
    assert clear["position"] == 0 and not clear["near_tie"] and clear["gap_nats"] > TIE_NATS
    unranked = judge_divergence([5], [4], top)  # not among the single run's top tokens
    assert not unranked["near_tie"] and unranked["gap_nats"] is None


def test_a_shorter_run_is_a_mismatch_at_its_end():
    verdict = judge_divergence([5, 6], [5], [{5: -1.0}, {6: -1.0}])
    assert verdict["position"] == 1 and not verdict["near_tie"]
