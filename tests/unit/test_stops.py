"""StopStringMatcher against a naive search over the whole text."""

from __future__ import annotations

import random

import pytest

from tandem.frontend.stops import StopStringMatcher


def naive(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Reference: grow the text one character at a time; the first stop to appear wins (the
    longest one if several complete at the same character). Returns (output, matched)."""
    for end in range(1, len(text) + 1):
        completed = [s for s in stops if text[:end].endswith(s)]
        if completed:
            stop = max(completed, key=len)
            cut = end if include else end - len(stop)
            return text[:cut], stop
    return text, None


def run(text: str, stops: list[str], include: bool, cuts: list[int]) -> tuple[str, str | None, list[str]]:
    m = StopStringMatcher(stops, include_stop_str_in_output=include)
    out: list[str] = []
    matched = None
    bounds = [0, *sorted(cuts), len(text)]
    for a, b in zip(bounds, bounds[1:]):
        r = m.feed(text[a:b])
        out.append(r.text)
        if r.finished:
            assert r.matched is not None
            matched = r.matched
            break
    else:
        out.append(m.flush())
    return "".join(out), matched, out


def random_splits(rng: random.Random, n: int) -> list[int]:
    return rng.sample(range(1, n), rng.randint(0, min(n - 1, 12))) if n > 1 else []


def test_random_texts_and_splits_match_naive_search() -> None:
    rng = random.Random(2024)
    alphabet = "ab c\n你🙂"
    for _ in range(600):
        stops = list({"".join(rng.choices(alphabet, k=rng.randint(1, 4))) for _ in range(rng.randint(1, 4))})
        text = "".join(rng.choices(alphabet, k=rng.randint(0, 40)))
        include = rng.random() < 0.5
        expected = naive(text, stops, include)
        for _ in range(5):
            got, matched, _ = run(text, stops, include, random_splits(rng, len(text)))
            assert (got, matched) == expected, (text, stops, include)


def test_self_overlapping_stops_over_a_tiny_alphabet() -> None:
    # Stops like "aab" or "abab" overlap themselves: the held part must be the longest
    # suffix that could still grow into a stop, not just any.
    rng = random.Random(7)
    for _ in range(400):
        stops = list({"".join(rng.choices("ab", k=rng.randint(2, 5))) for _ in range(rng.randint(1, 3))})
        text = "".join(rng.choices("ab", k=rng.randint(0, 30)))
        expected = naive(text, stops, False)
        for _ in range(3):
            got, matched, _ = run(text, stops, False, random_splits(rng, len(text)))
            assert (got, matched) == expected, (text, stops)


def test_longest_possible_start_is_held() -> None:
    m = StopStringMatcher(["aab"])
    assert m.feed("xaa").text == "x"
    r = m.feed("b")
    assert (r.text, r.matched) == ("", "aab")


def test_stop_across_many_deltas_is_never_partially_emitted() -> None:
    m = StopStringMatcher(["<|END|>"])
    emitted = ""
    for ch in "Hello <|EN":
        r = m.feed(ch)
        emitted += r.text
        assert not r.finished
    assert emitted == "Hello "  # "<|EN" is held back
    r = m.feed("D|> trailing")
    assert (r.text, r.matched, r.finished) == ("", "<|END|>", True)


def test_include_stop_str_in_output() -> None:
    m = StopStringMatcher(["STOP"], include_stop_str_in_output=True)
    assert m.feed("abc ST").text == "abc "
    r = m.feed("OP and more")
    assert (r.text, r.matched, r.finished) == ("STOP", "STOP", True)


def test_held_back_text_released_by_flush() -> None:
    m = StopStringMatcher(["###", "\n\nUser:"])
    assert m.feed("result\n\nUs").text == "result"
    assert m.feed("e").text == ""  # still a possible prefix of "\n\nUser:"
    assert m.flush() == "\n\nUse"
    assert m.flush() == ""
    assert m.feed("more").text == ""


def test_false_start_is_released_when_it_cannot_match() -> None:
    m = StopStringMatcher(["abc"])
    assert m.feed("xab").text == "x"
    assert m.feed("d").text == "abd"


def test_earliest_completion_then_longest_wins() -> None:
    # Both complete at the same character: the longer (earlier-starting) one wins.
    r = StopStringMatcher(["c", "abc"]).feed("xxabcyy")
    assert (r.text, r.matched) == ("xx", "abc")
    # "b" completes before "abc" could: generation stops at "b", whatever the splits.
    for parts in (["xabcx"], ["xa", "bcx"], ["xab", "cx"]):
        m = StopStringMatcher(["abc", "b"])
        results = [m.feed(p) for p in parts]
        assert results[-1].finished and results[-1].matched == "b"
        assert "".join(r.text for r in results) == "xa"


def test_after_finish_feeds_are_empty() -> None:
    m = StopStringMatcher(["x"])
    assert m.feed("axb").finished
    r = m.feed("more text")
    assert (r.text, r.finished) == ("", True)
    assert m.flush() == ""


def test_no_stops_passes_text_through() -> None:
    m = StopStringMatcher([])
    assert m.feed("anything").text == "anything"
    assert m.flush() == ""


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])


def test_held_text_stays_bounded_on_long_streams() -> None:
    # Text that keeps looking like the start of a stop: the held part never exceeds the stop.
    stop = "a" * 50 + "!"
    m = StopStringMatcher([stop])
    total = ""
    for i in range(1, 2001):
        total += m.feed("a").text
        assert i - len(total) < len(stop)
    assert total + m.flush() == "a" * 2000


# -- found by mutation testing (docs/testing.md) ------------------------------------------------


def test_results_and_state_before_any_match() -> None:
    from dataclasses import FrozenInstanceError

    from tandem.frontend.stops import StopResult

    m = StopStringMatcher(["END"])
    assert m.matched is None and m.finished is False
    r = m.feed("abc")
    assert r == StopResult("abc") and r.matched is None and r.finished is False
    with pytest.raises(FrozenInstanceError):
        r.text = "changed"  # results are values: a caller can keep them


def test_empty_stop_string_message_names_the_rule() -> None:
    with pytest.raises(ValueError, match="^stop strings must be non-empty strings$"):
        StopStringMatcher([""])
