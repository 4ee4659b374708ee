"""Sampler tests against naive per-row Python references (float64, plain loops)."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from tandem.engine_service.worker.sampler import Sampler, SamplerOutput, TokenLogprobs
from tandem.engine_service.sequence import SamplingParams, Sequence

# -- naive references --------------------------------------------------------------------------


def make_seq(
    params: SamplingParams,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    eos: tuple[int, ...] = (),
    name: str = "r",
) -> Sequence:
    seq = Sequence(name, prompt or [0], params, eos_token_ids=eos)
    for t in output or []:
        seq.append_token(t)
    return seq


def naive_softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    e = [math.exp(x - m) if x != -math.inf else 0.0 for x in xs]
    s = sum(e)
    return [v / s for v in e]


def naive_log_softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    lse = m + math.log(sum(math.exp(x - m) for x in xs))
    return [x - lse for x in xs]


def naive_penalised(
    logits: list[float], prompt: list[int], output: list[int], rep: float, pres: float, freq: float
) -> list[float]:
    out = list(logits)
    if rep != 1.0:
        for t in set(prompt) | set(output):
            out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in set(output):
        out[t] -= pres + freq * output.count(t)
    return out


def naive_distribution(
    logits: list[float], temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> dict[int, float]:
    """The exact distribution the sampler should draw from: token -> probability."""
    scaled = [x / temperature for x in logits]
    order = sorted(range(len(scaled)), key=lambda t: -scaled[t])
    if top_k > 0:
        order = order[:top_k]
    probs = dict(zip(order, naive_softmax([scaled[t] for t in order])))
    if top_p < 1.0:
        kept, mass = [], 0.0
        for t in order:
            kept.append(t)
            mass += probs[t]
            if mass >= top_p:
                break
        total = sum(probs[t] for t in kept)
        probs = {t: probs[t] / total for t in kept}
    if min_p > 0.0:
        top = max(probs.values())
        kept_p = {t: p for t, p in probs.items() if p >= min_p * top}
        total = sum(kept_p.values())
        probs = {t: p / total for t, p in kept_p.items()}
    return probs


def chi_square(counts: Counter, probs: dict[int, float], n: int) -> float:
    return sum((counts.get(t, 0) - n * p) ** 2 / (n * p) for t, p in probs.items())


def chi_square_critical(df: int, z: float = 3.29) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z=3.29: alpha ~ 5e-4)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def draw_many(sampler: Sampler, row: torch.Tensor, params: SamplingParams, n: int) -> list[int]:
    """n independent draws from one logits row: one batch of n identical rows."""
    seqs = [make_seq(params) for _ in range(n)]
    return sampler.sample(row.unsqueeze(0).expand(n, -1).contiguous(), seqs).token_ids


# -- greedy ------------------------------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 50, generator=gen)
    seqs = [make_seq(SamplingParams(temperature=0.0)) for _ in range(7)]
    out = Sampler(seed=1).sample(logits, seqs)
    expected = [max(range(50), key=lambda t: row[t]) for row in logits.tolist()]
    assert out.token_ids == expected
    assert out.logprobs == [None] * 7


def test_top_k_one_equals_greedy() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 40, generator=gen) * 0.3  # flat: sampling would rarely hit the argmax
    greedy = Sampler().sample(logits, [make_seq(SamplingParams(temperature=0.0)) for _ in range(64)])
    for seed in range(5):
        seqs = [make_seq(SamplingParams(temperature=1.5, top_k=1)) for _ in range(64)]
        assert Sampler(seed=seed).sample(logits, seqs).token_ids == greedy.token_ids


# -- temperature, top-k, top-p, min-p: distributions -------------------------------------------


def test_temperature_scales_distribution() -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, -1.0])
    n = 6000
    for temperature in (0.5, 2.0):
        tokens = draw_many(Sampler(seed=3), logits, SamplingParams(temperature=temperature), n)
        counts = Counter(tokens)
        right = naive_distribution(logits.tolist(), temperature)
        wrong = naive_distribution(logits.tolist(), 1.0)
        crit = chi_square_critical(df=3)
        assert chi_square(counts, right, n) < crit
        # The check has power: the untempered distribution is rejected.
        assert chi_square(counts, wrong, n) > 5 * crit


@pytest.mark.parametrize(
    "top_k,top_p,min_p",
    [(0, 0.3, 0.0), (0, 0.6, 0.0), (0, 0.9, 0.0), (4, 0.0 + 0.8, 0.0), (5, 1.0, 0.0), (0, 1.0, 0.2), (6, 0.85, 0.1)],
)
def test_truncation_keeps_exactly_the_allowed_set(top_k: int, top_p: float, min_p: float) -> None:
    gen = torch.Generator().manual_seed(10 + top_k)
    n = 2500
    for row in torch.randn(3, 12, generator=gen):
        allowed = naive_distribution(row.tolist(), 0.8, top_k, top_p, min_p)
        # Precondition so that "every allowed token appears" is a sound requirement.
        assert min(allowed.values()) * n > 20
        assert len(allowed) < 12  # the setting really truncates
        counts = Counter()
        for seed in range(2):
            params = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p, min_p=min_p)
            counts.update(draw_many(Sampler(seed=seed), row, params, n))
        assert set(counts) == set(allowed)
        assert chi_square(counts, allowed, 2 * n) < chi_square_critical(max(len(allowed) - 1, 1))


def test_top_p_is_relative_to_top_k_renormalised_mass() -> None:
    # Top-2 of [2, 1.9, 1.8, ...]: renormalised masses ~0.525/0.475, so top_p=0.5 keeps only
    # token 0 — over the full distribution token 0 alone would be far below 0.5.
    logits = torch.tensor([2.0, 1.9, 1.8, 1.7, 1.6, 1.5])
    allowed = naive_distribution(logits.tolist(), 1.0, top_k=2, top_p=0.5)
    assert set(allowed) == {0}
    tokens = draw_many(Sampler(seed=0), logits, SamplingParams(top_k=2, top_p=0.5), 500)
    assert set(tokens) == {0}


def test_seeded_sampling_follows_the_distribution() -> None:
    # Seeded rows draw CPU noise from their own generator; check that path is unbiased too.
    logits = torch.tensor([0.3, -0.2, 1.1, 0.0, -1.5])
    n = 4000
    seqs = [make_seq(SamplingParams(temperature=0.9, seed=s)) for s in range(n)]
    tokens = Sampler().sample(logits.unsqueeze(0).expand(n, -1).contiguous(), seqs).token_ids
    expected = naive_distribution(logits.tolist(), 0.9)
    assert chi_square(Counter(tokens), expected, n) < chi_square_critical(df=4)


# -- penalties ---------------------------------------------------------------------------------


def test_penalties_match_naive_reference() -> None:
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    vocab, batch = 30, 8
    changed = 0
    for _ in range(150):
        logits = torch.randn(batch, vocab, generator=gen) * 2 + rng.uniform(-3, 3)
        seqs, expected = [], []
        for row in logits.tolist():
            top = max(range(vocab), key=lambda t: row[t])
            prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
            # Make the raw argmax a likely penalty target so the penalties matter.
            output = [rng.choice([top, rng.randrange(vocab)]) for _ in range(rng.randrange(0, 10))]
            rep = rng.choice([1.0, 1.0, 1.3, 2.0, 0.8])
            pres = rng.choice([0.0, 0.5, -0.4, 1.5])
            freq = rng.choice([0.0, 0.3, 1.0, -0.2])
            # Greedy rows and top_k=1 sampled rows share one batch: both must see the penalties.
            mode = rng.choice([dict(temperature=0.0), dict(temperature=0.7, top_k=1)])
            seqs.append(
                make_seq(
                    SamplingParams(repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq, **mode),
                    prompt,
                    output,
                )
            )
            pen = naive_penalised(row, prompt, output, rep, pres, freq)
            expected.append(max(range(vocab), key=lambda t: pen[t]))
            changed += expected[-1] != top
        before = logits.clone()
        assert Sampler().sample(logits, seqs).token_ids == expected
        assert torch.equal(logits, before)  # the caller's logits are not modified
    assert changed > 100  # the penalties really decided many of the outcomes


def test_penalties_then_temperature_for_sampled_rows() -> None:
    # Sampled rows: penalised logits are then temperature-scaled; compare the distributions.
    logits = torch.tensor([1.0, 0.8, -0.5, 0.2, -1.0])
    prompt, output = [2, 3], [0, 0, 1, 4]
    params = SamplingParams(temperature=0.7, repetition_penalty=1.5, presence_penalty=0.3, frequency_penalty=0.2)
    n = 5000
    seqs = [make_seq(params, prompt, output) for _ in range(n)]
    tokens = Sampler(seed=5).sample(logits.unsqueeze(0).expand(n, -1).contiguous(), seqs).token_ids
    expected = naive_distribution(naive_penalised(logits.tolist(), prompt, output, 1.5, 0.3, 0.2), 0.7)
    assert chi_square(Counter(tokens), expected, n) < chi_square_critical(df=4)


# -- mixed batches -----------------------------------------------------------------------------


def test_mixed_parameters_in_one_batch() -> None:
    gen = torch.Generator().manual_seed(4)
    vocab = 16
    configs = [
        dict(temperature=0.0),
        dict(temperature=0.0, repetition_penalty=1.8, frequency_penalty=0.5),
        dict(temperature=1.0, top_k=3),
        dict(temperature=0.7, top_p=0.5),
        dict(temperature=1.2, min_p=0.3),
        dict(temperature=0.9, top_k=5, top_p=0.8, min_p=0.05),
        dict(temperature=1.0),
        dict(temperature=1.0, top_k=2, seed=1234),
    ]
    prompt, output = [1, 2, 3], [3, 3, 5]
    logits = torch.randn(len(configs), vocab, generator=gen)
    rows = logits.tolist()
    # Reference per row: the greedy token, or the distribution a sampled row must draw from.
    references: list[int | dict[int, float]] = []
    for row, c in zip(rows, configs):
        p = SamplingParams(**c)
        pen = naive_penalised(row, prompt, output, p.repetition_penalty, p.presence_penalty, p.frequency_penalty)
        if p.greedy:
            references.append(max(range(vocab), key=lambda t: pen[t]))
        else:
            references.append(naive_distribution(pen, p.temperature, p.top_k, p.top_p, p.min_p))
    seen: list[set[int]] = [set() for _ in configs]
    for seed in range(200):
        seqs = [make_seq(SamplingParams(**c), prompt, output) for c in configs]
        tokens = Sampler(seed=seed).sample(logits, seqs).token_ids
        for i, (ref, tok) in enumerate(zip(references, tokens)):
            if isinstance(ref, int):
                assert tok == ref
            else:
                assert tok in ref, (configs[i], tok, ref)
            seen[i].add(tok)
    for i, (c, ref) in enumerate(zip(configs, references)):
        if isinstance(ref, dict) and "seed" not in c:
            assert {t for t, pr in ref.items() if pr > 0.05} <= seen[i]
    # A fresh seeded sequence always starts with the same token, whatever the sampler's seed.
    assert len(seen[-1]) == 1


# -- seeds -------------------------------------------------------------------------------------


def _step_logits(step: int, vocab: int) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(1000 + step))


def _run_alone(params: SamplingParams, steps: int, vocab: int, sampler_seed: int) -> list[int]:
    seq = make_seq(params, [1, 2, 3], name="target")
    sampler = Sampler(seed=sampler_seed)
    for s in range(steps):
        seq.append_token(sampler.sample(_step_logits(s, vocab).unsqueeze(0), [seq]).token_ids[0])
    return seq.output_token_ids


def test_same_seed_same_tokens() -> None:
    params = dict(temperature=1.0, top_p=0.95, seed=42)
    a = _run_alone(SamplingParams(**params), 25, 64, sampler_seed=0)
    b = _run_alone(SamplingParams(**params), 25, 64, sampler_seed=99)
    assert a == b


def test_seeded_row_independent_of_batch_composition() -> None:
    vocab, steps = 64, 20
    target_params = dict(temperature=1.1, top_k=20, repetition_penalty=1.2, seed=7)
    alone = _run_alone(SamplingParams(**target_params), steps, vocab, sampler_seed=0)

    rng = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    target = make_seq(SamplingParams(**target_params), [1, 2, 3], name="target")
    others = [
        make_seq(SamplingParams(temperature=1.0), name="u1"),
        make_seq(SamplingParams(temperature=0.8, top_p=0.7, seed=99), name="s2"),
        make_seq(SamplingParams(temperature=0.0), name="g"),
        make_seq(SamplingParams(temperature=1.0, seed=7), name="same-seed-other-logits"),
        make_seq(SamplingParams(temperature=1.3, min_p=0.1), name="u2"),
    ]
    sampler = Sampler(seed=12345)
    for s in range(steps):
        batch = [target] + rng.sample(others, rng.randrange(0, len(others) + 1))
        rng.shuffle(batch)
        logits = torch.randn(len(batch), vocab, generator=gen)
        logits[batch.index(target)] = _step_logits(s, vocab)
        out = sampler.sample(logits, batch)
        for seq, tok in zip(batch, out.token_ids):
            seq.append_token(tok)
    assert target.output_token_ids == alone


def test_different_seeds_give_different_sequences() -> None:
    sequences = {tuple(_run_alone(SamplingParams(temperature=1.0, seed=seed), 30, 100, 0)) for seed in range(20)}
    assert len(sequences) == 20


def test_unseeded_rows_vary_and_sampler_seed_reproduces() -> None:
    a = _run_alone(SamplingParams(temperature=1.0), 30, 100, sampler_seed=1)
    b = _run_alone(SamplingParams(temperature=1.0), 30, 100, sampler_seed=1)
    c = _run_alone(SamplingParams(temperature=1.0), 30, 100, sampler_seed=2)
    assert a == b
    assert a != c


# -- logprobs ----------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_with_rank_and_top() -> None:
    gen = torch.Generator().manual_seed(8)
    vocab = 20
    n_logprobs = [None, 0, 1, 3, 5, None, 50]
    saw_rank_above_one = False
    for trial in range(30):
        logits = torch.randn(len(n_logprobs), vocab, generator=gen) * 0.5
        seqs = [
            make_seq(
                SamplingParams(temperature=2.0, repetition_penalty=1.5, presence_penalty=0.5, logprobs=k),
                [1, 2],
                [3, 4, 4],
            )
            for k in n_logprobs
        ]
        out = Sampler(seed=trial).sample(logits, seqs)
        assert isinstance(out, SamplerOutput)
        for row, k, tok, lp in zip(logits.tolist(), n_logprobs, out.token_ids, out.logprobs):
            if k is None:
                assert lp is None
                continue
            assert isinstance(lp, TokenLogprobs)
            ref = naive_log_softmax(row)  # raw: no penalties, no temperature
            assert lp.token_id == tok
            assert lp.logprob == pytest.approx(ref[tok], abs=1e-5)
            assert lp.rank == 1 + sum(1 for x in ref if x > ref[tok])
            saw_rank_above_one |= lp.rank > 1
            expected_top = sorted(range(vocab), key=lambda t: -ref[t])[: min(k, vocab)]
            assert [t for t, _ in lp.top] == expected_top
            assert [v for _, v in lp.top] == pytest.approx([ref[t] for t in expected_top], abs=1e-5)
    assert saw_rank_above_one


# -- min_tokens, vocab padding, edge cases -----------------------------------------------------


def test_min_tokens_masks_eos_and_stop_tokens() -> None:
    vocab, eos, stop = 10, 9, 7
    logits = torch.zeros(1, vocab)
    logits[0, eos] = 50.0
    logits[0, stop] = 40.0
    logits[0, 2] = 1.0

    def sample(params: SamplingParams, num_out: int, seed: int = 0) -> int:
        seq = make_seq(params, output=[1] * num_out, eos=(eos,))
        return Sampler(seed=seed).sample(logits, [seq]).token_ids[0]

    greedy = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop])
    assert sample(greedy, 0) == 2
    assert sample(greedy, 2) == 2
    assert sample(greedy, 3) == eos  # the mask lifts once min_tokens outputs exist
    for seed in range(50):
        assert sample(SamplingParams(temperature=5.0, min_tokens=2, stop_token_ids=[stop]), 1, seed) not in (eos, stop)
    # With ignore_eos, EOS would not stop the sequence, so it is not masked; stop ids still are.
    ignoring = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop], ignore_eos=True)
    assert sample(ignoring, 0) == eos
    logits[0, eos] = -50.0
    assert sample(ignoring, 0) == 2


def test_vocab_padding_columns_are_never_sampled() -> None:
    vocab, padded = 12, 16
    logits = torch.randn(4, padded, generator=torch.Generator().manual_seed(2))
    logits[:, vocab:] = 100.0
    seqs = [
        make_seq(SamplingParams(temperature=0.0, logprobs=2)),
        make_seq(SamplingParams(temperature=1.0, logprobs=0)),
        make_seq(SamplingParams(temperature=1.0, top_p=0.9, seed=3)),
        make_seq(SamplingParams(temperature=1.0, top_k=3)),
    ]
    out = Sampler(vocab_size=vocab, seed=0).sample(logits, seqs)
    assert all(t < vocab for t in out.token_ids)
    ref = naive_log_softmax(logits[0, :vocab].tolist())
    assert out.logprobs[0] is not None
    assert out.logprobs[0].logprob == pytest.approx(ref[out.token_ids[0]], abs=1e-5)
    with pytest.raises(ValueError):
        Sampler(vocab_size=32).sample(logits, seqs)


def test_empty_batch_and_shape_errors() -> None:
    assert Sampler().sample(torch.zeros(0, 5), []) == SamplerOutput(token_ids=[], logprobs=[])
    with pytest.raises(ValueError):
        Sampler().sample(torch.zeros(2, 5), [make_seq(SamplingParams())])
    with pytest.raises(ValueError):
        Sampler().sample(torch.zeros(5), [make_seq(SamplingParams())])


def test_low_precision_logits_are_accepted() -> None:
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    seqs = [make_seq(SamplingParams(temperature=0.0, logprobs=1)) for _ in range(3)]
    out = Sampler().sample(logits, seqs)
    assert out.token_ids == logits.float().argmax(dim=-1).tolist()


# -- found by mutation testing (docs/testing.md) ------------------------------------------------


def test_error_messages_name_the_shapes() -> None:
    seq = make_seq(SamplingParams())
    with pytest.raises(ValueError) as err:
        Sampler(vocab_size=0)
    assert str(err.value) == "vocab_size must be >= 1"
    with pytest.raises(ValueError) as err:
        Sampler().sample(torch.zeros(5), [seq])
    assert str(err.value) == "logits must be [batch, vocab], got shape (5,)"
    with pytest.raises(ValueError) as err:
        Sampler().sample(torch.zeros(2, 5), [seq])
    assert str(err.value) == "2 logits rows for 1 sequences"
    with pytest.raises(ValueError) as err:
        Sampler(vocab_size=6).sample(torch.zeros(1, 5), [seq])
    assert str(err.value) == "logits have 5 columns, vocab_size is 6"


def test_vocab_size_bounds_are_inclusive() -> None:
    # A one-token vocabulary is valid, and logits exactly vocab_size wide need no padding.
    one = Sampler(vocab_size=1).sample(torch.zeros(2, 1), [make_seq(SamplingParams(temperature=1.0)) for _ in range(2)])
    assert one.token_ids == [0, 0]
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    out = Sampler(vocab_size=4).sample(logits, [make_seq(SamplingParams(temperature=0.0, logprobs=4))])
    assert out.token_ids == [1]
    assert out.logprobs[0] is not None
    assert [t for t, _ in out.logprobs[0].top] == [1, 3, 2, 0]


def test_min_tokens_masks_token_id_zero_and_ignores_ids_outside_the_logits() -> None:
    # Token 0 is a real token id (it can be a stop token); an EOS id at or beyond the real
    # vocabulary (a padded lm head cut by vocab_size) has no logit to mask and is skipped.
    logits = torch.tensor([[9.0, 1.0, 5.0, 2.0, 50.0, 50.0]])
    seq = make_seq(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[0]), eos=(4, 9))
    out = Sampler(vocab_size=4).sample(logits, [seq])
    assert out.token_ids == [2]
    seq = make_seq(SamplingParams(temperature=0.0, min_tokens=2), eos=(0, 4))
    assert Sampler(vocab_size=4).sample(logits, [seq]).token_ids == [2]
    assert logits[0, 0] == 9.0  # the caller's logits are left as they were


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, repetition_penalty=100.0),
    SamplingParams(temperature=0.0, presence_penalty=2.0),
    SamplingParams(temperature=0.0, frequency_penalty=2.0),
])
def test_each_penalty_alone_applies(params: SamplingParams) -> None:
    # Token 1 leads slightly and has been generated; any one penalty alone must demote it.
    logits = torch.tensor([[1.0, 1.5, 0.0]])
    seq = make_seq(params, prompt=[2], output=[1])
    assert Sampler().sample(logits.clone(), [seq]).token_ids == [0]
    # The same batch with a neutral row: penalties are per row.
    neutral = make_seq(SamplingParams(temperature=0.0), prompt=[2], output=[1])
    out = Sampler().sample(logits.repeat(2, 1), [seq, neutral])
    assert out.token_ids == [0, 1]


def test_min_tokens_mask_holds_together_with_penalties() -> None:
    eos = 3
    logits = torch.tensor([[1.0, 2.0, 0.5, 10.0]])
    params = SamplingParams(temperature=0.0, min_tokens=5, repetition_penalty=1.2, presence_penalty=0.1)
    seq = make_seq(params, prompt=[0], output=[1], eos=(eos,))
    out = Sampler().sample(logits, [seq])
    assert out.token_ids[0] != eos
    assert out.token_ids == [1]  # 2.0 / 1.2 - 0.1 still beats 1.0 / 1.2 and 0.5


def test_min_p_one_keeps_exactly_the_most_likely_token() -> None:
    # p_i < min_p * p_max removes; equality keeps, so min_p = 1 leaves the top token (and ties).
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    for seed in range(20):
        out = Sampler(seed=seed).sample(logits, [make_seq(SamplingParams(temperature=1.0, min_p=1.0))])
        assert out.token_ids == [1]
    tied = torch.tensor([[0.0, 3.0, 3.0, 2.0]])
    seen = {Sampler(seed=s).sample(tied, [make_seq(SamplingParams(temperature=1.0, min_p=1.0))]).token_ids[0]
            for s in range(40)}
    assert seen == {1, 2}


def test_seeded_sampler_draws_fresh_noise_every_step() -> None:
    # The sampler's own generator is created once per device and then advances: with a fixed
    # sampler seed, successive steps over the same logits must not repeat one draw.
    sampler = Sampler(seed=0)
    logits = torch.zeros(1, 50)
    tokens = [sampler.sample(logits, [make_seq(SamplingParams(temperature=1.0))]).token_ids[0] for _ in range(20)]
    assert len(set(tokens)) > 5
    again = Sampler(seed=0)
    assert [again.sample(logits, [make_seq(SamplingParams(temperature=1.0))]).token_ids[0] for _ in range(20)] == tokens


def test_logprobs_without_alternatives() -> None:
    # Every row asks for logprobs=0: the chosen token's logprob and rank, no alternatives.
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    out = Sampler().sample(logits, [make_seq(SamplingParams(temperature=0.0, logprobs=0)) for _ in range(2)])
    assert out.token_ids == [1, 0]
    for row, lp in zip(logits.tolist(), out.logprobs):
        assert lp is not None and lp.top == [] and lp.rank == 1
        assert lp.logprob == pytest.approx(max(naive_log_softmax(row)), abs=1e-6)


def test_logprobs_with_one_alternative() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    out = Sampler().sample(logits, [make_seq(SamplingParams(temperature=0.0, logprobs=1))])
    lp = out.logprobs[0]
    assert lp is not None and [t for t, _ in lp.top] == [1]
    assert lp.top[0][1] == pytest.approx(naive_log_softmax(logits[0].tolist())[1], abs=1e-6)


def test_pending_sample_keeps_the_tokens_on_the_device_and_is_ready_on_cpu() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0], [5.0, 0.0, 0.0]])
    pending = Sampler().sample_async(logits, [make_seq(SamplingParams(temperature=0.0)) for _ in range(2)])
    assert isinstance(pending.token_ids, torch.Tensor) and pending.token_ids.tolist() == [1, 0]
    assert pending.ready() is True  # CPU: nothing to wait for
    assert pending.result().token_ids == [1, 0]
    assert pending.result() is pending.result()  # built once


def test_top_k_alone_keeps_every_token_tied_with_the_kth() -> None:
    # The documented top-k-only path: ties with the k-th logit stay in (no full sort that
    # would cut between equal values).
    logits = torch.tensor([[3.0, 1.0, 1.0, 0.0]])
    seen = {Sampler(seed=s).sample(logits, [make_seq(SamplingParams(temperature=1.0, top_k=2))]).token_ids[0]
            for s in range(200)}
    assert seen == {0, 1, 2}


def test_top_p_keeps_ties_at_the_boundary_together() -> None:
    # Top-p keeps a token iff the tokens strictly more likely weigh < p: equal tokens are never
    # split by the order a sort happens to give them. Four equal tokens: none has a strictly more
    # likely one, so top_p = 0.5 keeps all four. Two pairs (0.366 each, then 0.134 each): the
    # second pair has 0.73 >= 0.5 above it and goes, both of the first pair stay.
    def seen(logits: torch.Tensor) -> set[int]:
        return {Sampler(seed=s).sample(logits, [make_seq(SamplingParams(temperature=1.0, top_p=0.5))]).token_ids[0]
                for s in range(100)}

    assert seen(torch.zeros(1, 4)) == {0, 1, 2, 3}
    assert seen(torch.tensor([[0.0, 0.0, -1.0, -1.0]])) == {0, 1}


def test_top_p_one_keeps_the_tail_that_cumsum_rounding_would_cut() -> None:
    # One dominant token: float32 cumsum reaches 1.0 before the tail, whose mass before then
    # rounds to >= 1. A row with top_p = 1 that is sorted anyway (it has a top-k, and another
    # row's top_p < 1 sends the batch down the sorting path) must keep those tokens possible.
    # Noise that favours token 5 (q tiny) makes it win if and only if it was kept.
    vocab = 8
    logits = torch.tensor([[30.0] + [-30.0 - i for i in range(1, vocab)]] * 2)
    seqs = [make_seq(SamplingParams(temperature=1.0, top_p=1.0, top_k=vocab - 1)),
            make_seq(SamplingParams(temperature=1.0, top_p=0.5))]
    probs = torch.softmax(logits[0], dim=-1)
    assert float(torch.cumsum(probs, dim=-1)[0]) == 1.0  # the rounding this guards against
    sampler = Sampler(seed=0)

    def noise(seqs_, vocab_, device):
        q = torch.ones(len(seqs_), vocab_)
        q[:, 5] = 1e-38
        return q

    sampler._exponential_noise = noise  # type: ignore[method-assign]
    out = sampler.sample(logits, seqs)
    assert out.token_ids == [5, 0]  # the top_p = 0.5 row keeps only the dominant token


# -- logit_bias ----------------------------------------------------------------------------------


def test_logit_bias_is_added_and_minus_100_bans() -> None:
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(4, 30, generator=gen)
    logits[:, 5] = 1000.0  # far above the rest: +(-100) alone would not dethrone it
    banned = SamplingParams(temperature=0.0, logit_bias={5: -100.0})
    nudged = SamplingParams(temperature=0.0, logit_bias={5: -99.0})
    boosted = SamplingParams(temperature=0.0, logit_bias={3: 100.0})
    plain = SamplingParams(temperature=0.0)
    out = Sampler(seed=1).sample(logits.clone(), [make_seq(p) for p in (banned, nudged, boosted, plain)])
    row0 = logits[0].clone()
    row0[5] = -math.inf
    assert out.token_ids[0] == int(row0.argmax())  # banned: the next best
    assert out.token_ids[1] == 5 and out.token_ids[3] == 5  # a bias, not a ban; and no bias at all
    assert out.token_ids[2] == 5  # +100 on token 3 stays below the 1000 of token 5


def test_banned_token_is_never_sampled_at_temperature_one() -> None:
    logits = torch.zeros(256, 8)
    logits[:, 2] = 5.0  # the favourite by far
    seqs = [make_seq(SamplingParams(temperature=1.0, seed=i, logit_bias={2: -100.0, 6: 3.0})) for i in range(256)]
    tokens = Sampler(seed=3).sample(logits, seqs).token_ids
    counts = Counter(tokens)
    assert 2 not in counts
    assert counts.most_common(1)[0][0] == 6  # +3 on a flat rest makes 6 the likeliest


def test_logit_bias_leaves_logprobs_raw() -> None:
    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(2))
    out = Sampler().sample(logits, [make_seq(SamplingParams(temperature=0.0, logprobs=0, logit_bias={0: 50.0}))])
    assert out.token_ids == [0]
    assert out.logprobs[0].logprob == pytest.approx(torch.log_softmax(logits[0], -1)[0].item(), abs=1e-5)
