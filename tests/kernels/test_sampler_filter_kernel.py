"""The sampler with its top-k / top-p / min-p filter on the Triton kernel (CPU interpreter) against
the same sampler on the PyTorch twin: the same kept sets, hence the same tokens for the same
sampler seed and the same per-request seeds (the noise does not depend on the filter)."""

import os

# Triton reads this when triton.language is first imported (kernels import it lazily, at launch).
os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from tandem.engine_service.sequence import SamplingParams, Sequence  # noqa: E402
from tandem.engine_service.worker.sampler import Sampler, _filter_top_k_top_p_min_p  # noqa: E402

VOCAB = 700

# Every filter alone and together, with and without a request seed, greedy rows between them.
PARAMS = [
    dict(temperature=0.0),
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=20),
    dict(temperature=1.0, top_p=0.9),
    dict(temperature=1.3, min_p=0.05),
    dict(temperature=0.6, top_k=20, top_p=0.95),
    dict(temperature=0.9, top_k=50, top_p=0.8, min_p=0.02),
    dict(temperature=1.0, top_k=1),
    dict(temperature=0.8, top_p=0.5, seed=11),
    dict(temperature=0.6, top_k=20, top_p=0.95, seed=12),
    dict(temperature=1.0, min_p=0.1, seed=13),
    dict(temperature=0.0, seed=14),
]


def tied_logits(rows: int, seed: int) -> torch.Tensor:
    """Model-like logits: bfloat16 values (so many exact ties, at the boundaries too) in float32."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, VOCAB, generator=gen) * 3).bfloat16().float()


def sequences(params: list[dict]) -> list[Sequence]:
    # Fresh sequences per sampler: a seeded one's generator advances as it samples.
    return [Sequence(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=8, **p)) for i, p in enumerate(params)]


def test_filter_kernel_keeps_the_same_set_as_the_twin() -> None:
    for seed in range(6):
        logits = tied_logits(len(PARAMS), seed)
        params = [SamplingParams(**{k: v for k, v in p.items() if k != "seed"}) for p in PARAMS]
        twin = _filter_top_k_top_p_min_p(logits.clone(), params, use_kernel=False)
        kernel = _filter_top_k_top_p_min_p(logits.clone(), params, use_kernel=True)
        assert torch.equal(kernel, twin), seed
        # The twin's sort-free branch (no row uses top-p) too.
        no_top_p = [p for p in params if p.top_p >= 1.0]
        rows = logits[: len(no_top_p)]
        assert torch.equal(_filter_top_k_top_p_min_p(rows.clone(), no_top_p, use_kernel=True),
                           _filter_top_k_top_p_min_p(rows.clone(), no_top_p, use_kernel=False)), seed


def test_sampler_tokens_are_the_same_with_the_kernel_on_and_off() -> None:
    for seed in range(8):
        logits = tied_logits(len(PARAMS), 100 + seed)
        on, off = Sampler(seed=seed, filter_kernel=True), Sampler(seed=seed, filter_kernel=False)
        seqs_on, seqs_off = sequences(PARAMS), sequences(PARAMS)
        for _ in range(3):  # successive steps: the shared and per-request generators advance alike
            assert on.sample(logits, seqs_on).token_ids == off.sample(logits, seqs_off).token_ids, seed


def test_seeded_request_with_the_kernel_does_not_depend_on_its_batch() -> None:
    logits = tied_logits(len(PARAMS), 7)
    seeded = 9  # dict(temperature=0.6, top_k=20, top_p=0.95, seed=12)
    alone = Sampler(seed=1, filter_kernel=True).sample(logits[seeded : seeded + 1], sequences([PARAMS[seeded]]))
    batch = Sampler(seed=2, filter_kernel=True).sample(logits, sequences(PARAMS))
    assert batch.token_ids[seeded] == alone.token_ids[0]
