"""Stop strings on streamed text: emit what is safe, hold back what may start a stop."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StopResult:
    """What one `feed` allows out: `text` to emit now; `matched` and `finished` once a stop hit."""

    text: str
    matched: str | None = None
    finished: bool = False


class StopStringMatcher:
    """Finds the first stop string in a stream of text deltas and trims the output at it.

    The match is the stop occurrence that *completes* first in the stream (generation would
    have stopped there); among occurrences completing at the same character, the one starting
    earliest (the longest) wins. This answer does not depend on how the text was split into
    deltas. Text that could be the beginning of a stop string (the longest suffix of the
    pending text that is a proper prefix of some stop) is held back until it either completes
    a stop or cannot anymore, so a stop is never partially emitted. Each `feed` costs
    O(len(delta) + longest stop) per stop string, whatever the length of the text so far.
    """

    def __init__(self, stops: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop strings must be non-empty strings")
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(stops))  # dedupe, keep order
        self.include_stop_str_in_output = include_stop_str_in_output
        self._max_len = max((len(s) for s in self.stops), default=0)
        self._held = ""
        self.matched: str | None = None
        self.finished = False

    def feed(self, delta: str) -> StopResult:
        if self.finished:
            return StopResult("", self.matched, True)
        if not self.stops:
            return StopResult(delta)
        # Emitted text holds no stop and no stop prefix reaching its end, so any stop
        # completing now starts inside held + delta.
        pending = self._held + delta
        match = self._first_completed(pending)
        if match is not None:
            start, stop = match
            self.finished = True
            self.matched = stop
            self._held = ""
            end = start + len(stop) if self.include_stop_str_in_output else start
            return StopResult(pending[:end], stop, True)
        keep = self._held_suffix_len(pending)
        self._held = pending[len(pending) - keep :] if keep else ""
        return StopResult(pending[: len(pending) - keep])

    def flush(self) -> str:
        """Releases held-back text when generation ended without a stop string."""
        if self.finished:
            return ""
        self.finished = True
        out, self._held = self._held, ""
        return out

    def _first_completed(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self.stops:
            # A string's first occurrence is also its earliest-ending one.
            start = text.find(stop)
            if start < 0:
                continue
            key = (start + len(stop), start, stop)
            if best is None or key[:2] < best[:2]:
                best = key
        return None if best is None else (best[1], best[2])

    def _held_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop."""
        longest = 0
        n = len(text)
        for stop in self.stops:
            # Only suffixes longer than what we already hold can improve the answer.
            lo = max(n - len(stop) + 1, 0)
            hi = n - longest  # exclusive bound on the suffix start
            i = text.find(stop[0], lo, hi)
            while i != -1:
                if stop.startswith(text[i:]):
                    longest = n - i
                    break
                i = text.find(stop[0], i + 1, hi)
        return longest
