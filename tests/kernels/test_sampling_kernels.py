"""Top-k / top-p / min-p filtering: the sort-free Triton kernel (CPU interpreter) vs the
sort-based reference and vs a naive float64 per-token definition written here."""

import os

# Triton reads this when triton.language is first imported (kernels import it lazily, at launch).
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from tandem.kernels.sampling import (  # noqa: E402
    apply_top_k_top_p_min_p,
    apply_top_k_top_p_min_p_reference,
)


def naive_filter(row: torch.Tensor, k: int, p: float, min_p: float) -> torch.Tensor:
    """The definitions, token by token (O(V^2), float64): top-k keeps tokens with fewer than k
    strictly larger logits; top-p (over the top-k survivors) keeps tokens whose strictly more
    likely survivors weigh < p; min-p keeps probability >= min_p * top probability."""
    x = row.double()
    vocab = x.shape[0]
    greater = x[None, :] > x[:, None]  # [i, j]: token j strictly more likely than token i
    keep = torch.ones(vocab, dtype=torch.bool)
    if 0 < k < vocab:
        keep &= greater.sum(dim=1) < k
    if p < 1.0:
        weights = torch.where(keep, torch.exp(x - x.max()), 0.0)
        mass_above = (greater.double() * weights[None, :]).sum(dim=1)
        keep &= mass_above < p * weights.sum()
    if min_p > 0:
        keep &= torch.exp(x - x.max()) >= min_p
    return torch.where(keep, x, float("-inf")).float()


def check_rows(logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> None:
    k_t = torch.tensor(top_k)
    p_t = torch.tensor(top_p)
    m_t = torch.tensor(min_p)
    out = torch.full_like(logits, float("nan"))
    apply_top_k_top_p_min_p(logits, k_t, p_t, m_t, out=out)
    assert not out.isnan().any()
    reference = apply_top_k_top_p_min_p_reference(logits, k_t, p_t, m_t)
    assert torch.equal(out, reference)
    for r in range(logits.shape[0]):
        assert torch.equal(out[r], naive_filter(logits[r], top_k[r], top_p[r], min_p[r])), r


def test_each_filter_alone_and_combined() -> None:
    gen = torch.Generator().manual_seed(51)
    logits = torch.randn(8, 700, generator=gen) * 3
    top_k = [0, 1, 20, 0, 0, 0, 50, 700]  # 700 == V: off
    top_p = [1.0, 1.0, 1.0, 0.5, 0.95, 1.0, 0.8, 0.3]
    min_p = [0.0, 0.0, 0.0, 0.0, 0.0, 0.2, 0.01, 0.0]
    check_rows(logits, top_k, top_p, min_p)


def test_ties_are_kept_together() -> None:
    gen = torch.Generator().manual_seed(52)
    # Logits on a coarse grid: many exact ties, including at the top-k / top-p boundaries.
    logits = torch.round(torch.randn(6, 300, generator=gen) * 2) / 2
    logits[0, :10] = 5.0  # the 10 best tokens tie: top-k 3 keeps all 10
    check_rows(logits, [3, 7, 0, 25, 0, 2], [1.0, 1.0, 0.6, 0.9, 0.99, 0.5], [0.0, 0.0, 0.0, 0.0, 0.3, 0.0])
    out = apply_top_k_top_p_min_p(logits[:1], torch.tensor([3]))
    assert torch.isfinite(out).sum() == 10


def test_masked_vocab_and_extreme_values() -> None:
    gen = torch.Generator().manual_seed(53)
    logits = torch.randn(5, 2100, generator=gen) * 10  # spans two 2048-wide chunks
    logits[0, 100:] = float("-inf")  # banned tokens (e.g. by a grammar)
    logits[1] = -logits[1].abs() - 50  # all very negative
    logits[2, 5] = 1e30
    # the last row's k exceeds the kernel's chunk width (no lane-maximum bound)
    check_rows(logits, [150, 3, 5, 0, 2090], [0.9, 0.7, 0.9, 0.999, 1.0], [0.0, 0.1, 0.0, 0.0, 0.0])


def test_disabled_filters_return_logits_unchanged() -> None:
    gen = torch.Generator().manual_seed(54)
    logits = torch.randn(3, 333, generator=gen)
    assert torch.equal(apply_top_k_top_p_min_p(logits), logits)
    assert torch.equal(
        apply_top_k_top_p_min_p(logits, torch.tensor([0, -1, 333]), torch.ones(3), torch.zeros(3)),
        logits,
    )


def test_in_place_and_validation() -> None:
    gen = torch.Generator().manual_seed(55)
    logits = torch.randn(2, 257, generator=gen)
    expected = apply_top_k_top_p_min_p_reference(logits, torch.tensor([4, 9]))
    apply_top_k_top_p_min_p(logits, torch.tensor([4, 9]), out=logits)
    assert torch.equal(logits, expected)
    with pytest.raises(TypeError):
        apply_top_k_top_p_min_p(logits.double())
    with pytest.raises(ValueError):
        apply_top_k_top_p_min_p(logits, torch.tensor([1, 2, 3]))
