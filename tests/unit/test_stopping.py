"""check_stop tests: each rule, their precedence, and a naive full-scan reference."""

from __future__ import annotations

import random

from tandem.core_protocol import StopSequence, StopToken
from tandem.engine_service.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus
from tandem.engine_service.core.stopping import check_stop

EOS = 2
MAX_LEN = 1000


def run(
    params: SamplingParams,
    tokens: list[int],
    prompt: list[int] | None = None,
    eos: tuple[int, ...] = (EOS,),
    max_model_len: int = MAX_LEN,
) -> tuple[Sequence, int | None]:
    """Append tokens one at a time as the engine does; return the sequence and the stop step."""
    seq = Sequence("r", prompt or [100, 101], params, eos_token_ids=eos)
    for step, tok in enumerate(tokens):
        seq.append_token(tok)
        if check_stop(seq, max_model_len):
            assert seq.is_finished
            return seq, step
        assert not seq.is_finished and seq.finish_reason is None
    return seq, None


def test_eos_stops_with_its_token_id() -> None:
    seq, step = run(SamplingParams(max_tokens=50), [5, 6, EOS, 7])
    assert step == 2
    assert seq.status == SequenceStatus.FINISHED
    assert (seq.finish_reason, seq.stop_reason) == (FinishReason.STOP, StopToken(EOS))


def test_any_of_several_eos_ids() -> None:
    seq, step = run(SamplingParams(max_tokens=50), [5, 11, 7], eos=(10, 11))
    assert step == 1 and seq.stop_reason == StopToken(11)


def test_ignore_eos() -> None:
    seq, step = run(SamplingParams(max_tokens=5, ignore_eos=True), [EOS, EOS, 3, EOS, 4, 9])
    assert step == 4 and seq.finish_reason == FinishReason.LENGTH and seq.stop_reason is None


def test_stop_token_ids_apply_even_with_ignore_eos() -> None:
    for ignore_eos in (False, True):
        seq, step = run(SamplingParams(max_tokens=50, stop_token_ids=[8, 9], ignore_eos=ignore_eos), [5, 6, 9, 8])
        assert step == 2
        assert (seq.finish_reason, seq.stop_reason) == (FinishReason.STOP, StopToken(9))


def test_stop_sequence_spanning_several_tokens() -> None:
    params = SamplingParams(max_tokens=50, stop_token_sequences=[[4, 5, 6], [7, 7]])
    # Partial matches (4 5 then 4 5 7, a lone 7) do not stop; the full 4 5 6 does.
    seq, step = run(params, [4, 5, 4, 5, 7, 3, 4, 5, 6, 1])
    assert step == 8
    assert (seq.finish_reason, seq.stop_reason) == (FinishReason.STOP, StopSequence(0))
    seq, step = run(params, [7, 1, 7, 7])
    assert step == 3 and seq.stop_reason == StopSequence(1)


def test_stop_sequence_does_not_reach_into_the_prompt() -> None:
    params = SamplingParams(max_tokens=50, stop_token_sequences=[[4, 5, 6]])
    _, step = run(params, [5, 6, 1], prompt=[1, 4])
    assert step is None
    _, step = run(params, [6, 1], prompt=[4, 5])
    assert step is None


def test_first_listed_matching_stop_sequence_wins() -> None:
    seq, _ = run(SamplingParams(max_tokens=50, stop_token_sequences=[[], [3, 4], [4]]), [1, 3, 4])
    assert seq.stop_reason == StopSequence(1)
    seq, _ = run(SamplingParams(max_tokens=50, stop_token_sequences=[[4], [3, 4]]), [1, 3, 4])
    assert seq.stop_reason == StopSequence(0)


def test_max_tokens_and_max_model_len() -> None:
    seq, step = run(SamplingParams(max_tokens=3), [5, 6, 7, 8])
    assert step == 2 and seq.finish_reason == FinishReason.LENGTH and seq.num_output_tokens == 3
    # Context limit: prompt of 2, limit 6 -> at most 4 outputs even with a larger max_tokens.
    seq, step = run(SamplingParams(max_tokens=100), [5] * 10, max_model_len=6)
    assert step == 3 and seq.finish_reason == FinishReason.LENGTH and seq.num_tokens == 6


def test_precedence() -> None:
    # A stop on the last allowed token is a natural end: STOP beats LENGTH.
    seq, step = run(SamplingParams(max_tokens=3), [5, 6, EOS])
    assert step == 2 and (seq.finish_reason, seq.stop_reason) == (FinishReason.STOP, StopToken(EOS))
    seq, _ = run(SamplingParams(max_tokens=100, stop_token_sequences=[[5, 6]]), [5, 6], max_model_len=4)
    assert (seq.finish_reason, seq.stop_reason) == (FinishReason.STOP, StopSequence(0))
    # EOS before stop token ids before stop sequences, when one token triggers several.
    seq, _ = run(SamplingParams(stop_token_ids=[EOS, 9], stop_token_sequences=[[1, EOS]]), [1, EOS])
    assert seq.stop_reason == StopToken(EOS)
    seq, _ = run(SamplingParams(stop_token_ids=[9], stop_token_sequences=[[1, 9]]), [1, 9])
    assert seq.stop_reason == StopToken(9)


def test_min_tokens_defers_every_stop_but_length() -> None:
    params = SamplingParams(max_tokens=50, min_tokens=3, stop_token_ids=[9], stop_token_sequences=[[4, 5]])
    _, step = run(params, [EOS, 9, 1])
    assert step is None
    _, step = run(params, [4, 5, 1])
    assert step is None
    seq, step = run(params, [EOS, 1, EOS])
    assert step == 2 and seq.stop_reason == StopToken(EOS)  # the third output may stop it
    seq, step = run(params, [1, 4, 5])
    assert step == 2 and seq.stop_reason == StopSequence(0)  # a match may start before min_tokens
    # Length limits are not deferred.
    seq, step = run(params, [1, 1, 1], max_model_len=3)
    assert step == 0 and seq.finish_reason == FinishReason.LENGTH


def test_finished_sequence_is_left_alone() -> None:
    seq = Sequence("r", [1], SamplingParams(max_tokens=10), eos_token_ids=(EOS,))
    seq.append_token(5)
    seq.finish(FinishReason.ABORT)
    seq.append_token(EOS)
    assert check_stop(seq, MAX_LEN)
    assert seq.finish_reason == FinishReason.ABORT and seq.stop_reason is None


class _GuardedList(list):
    """An output list that fails on a full scan and records how many items slices read."""

    def __init__(self, items: list[int]) -> None:
        super().__init__(items)
        self.items_read = 0

    def __getitem__(self, key):  # type: ignore[override]
        result = super().__getitem__(key)
        self.items_read += len(result) if isinstance(key, slice) else 1
        return result

    def __iter__(self):
        raise AssertionError("check_stop scanned the whole output")

    def __contains__(self, item: object) -> bool:
        raise AssertionError("check_stop scanned the whole output")


def test_cost_is_bounded_by_stop_sequence_length() -> None:
    stop_seqs = [[7, 8, 9], [3, 9], [1, 2, 3, 4, 9]]
    params = SamplingParams(max_tokens=10**6, stop_token_sequences=stop_seqs, stop_token_ids=[11])
    seq = Sequence("r", [1], params, eos_token_ids=(EOS,))
    guarded = _GuardedList([5] * 100_000 + [2, 3, 9])  # ends with 3 9: seq:1 after a near miss
    seq.output_token_ids = guarded
    assert check_stop(seq, 10**7)
    assert seq.stop_reason == StopSequence(1)
    assert guarded.items_read <= 1 + sum(len(s) for s in stop_seqs)


def naive_stop(tokens: list[int], prompt_len: int, p: SamplingParams, eos: tuple[int, ...], max_model_len: int):
    """Full-scan reference: first step at which the sequence ends, and how."""
    for n in range(1, len(tokens) + 1):
        out = tokens[:n]
        if n >= p.min_tokens:
            if not p.ignore_eos and out[-1] in eos:
                return n - 1, FinishReason.STOP, StopToken(out[-1])
            if out[-1] in p.stop_token_ids:
                return n - 1, FinishReason.STOP, StopToken(out[-1])
            for i, s in enumerate(p.stop_token_sequences):
                if s and len(s) <= n and out[len(out) - len(s):] == s:
                    return n - 1, FinishReason.STOP, StopSequence(i)
        if n >= p.max_tokens or prompt_len + n >= max_model_len:
            return n - 1, FinishReason.LENGTH, None
    return None, None, None


def test_matches_naive_reference_on_random_streams() -> None:
    rng = random.Random(0)
    vocab = 6
    outcomes = set()
    for _ in range(3000):
        params = SamplingParams(
            max_tokens=rng.randrange(1, 30),
            min_tokens=rng.choice([0, 0, 2, 5]),
            ignore_eos=rng.random() < 0.3,
            stop_token_ids=rng.sample(range(vocab), rng.choice([0, 0, 1])),
            stop_token_sequences=[
                [rng.randrange(vocab) for _ in range(rng.randrange(1, 4))] for _ in range(rng.randrange(0, 3))
            ],
        )
        prompt = [0] * rng.randrange(1, 5)
        max_model_len = rng.randrange(5, 40)
        tokens = [rng.randrange(vocab) for _ in range(40)]
        seq, step = run(params, tokens, prompt=prompt, eos=(EOS,), max_model_len=max_model_len)
        ref_step, ref_reason, ref_stop = naive_stop(tokens, len(prompt), params, (EOS,), max_model_len)
        assert (step, seq.finish_reason, seq.stop_reason) == (ref_step, ref_reason, ref_stop), params
        outcomes.add((ref_reason, type(ref_stop)))
    # Every kind of ending was exercised.
    assert outcomes >= {(FinishReason.STOP, StopToken), (FinishReason.STOP, StopSequence),
                        (FinishReason.LENGTH, type(None))}


def test_no_output_yet_is_never_a_stop() -> None:
    # Found by mutation testing: with min_tokens 0 and no output, there is no newest token to
    # inspect; only the length rules apply.
    seq = Sequence("r", [EOS, 100], SamplingParams(max_tokens=5, stop_token_ids=[100]), eos_token_ids=(EOS,))
    assert check_stop(seq, MAX_LEN) is False and not seq.is_finished
    full = Sequence("f", [1, 2, 3], SamplingParams(max_tokens=5), eos_token_ids=(EOS,))
    assert check_stop(full, max_model_len=3) is True and full.finish_reason == FinishReason.LENGTH
