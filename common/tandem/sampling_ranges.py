"""The accepted range of every numeric sampling field, written once (no torch, no protobuf).

Three readers check values against this table: the wire validation of both services
(`tandem.proto_wire.sampling_from_proto`, which the frontend runs to fail fast and the engine runs
as the authority), and the model's sampling defaults (`tandem.generation_defaults`, which must
hold only values a request could send). A range here is what docs/api.md documents.

Checks that depend on the request or the model (max_tokens against the context, min_tokens
against max_tokens, token ids against the vocabulary) are not ranges and stay with the caller.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

MAX_LOGPROBS = 20
# Choices per request (`n`). With a seed, choice i samples with seed + i.
MAX_CHOICES = 16
# The largest seed: choice i of n <= MAX_CHOICES uses seed + i, which must still fit the wire's
# int64, so the range stops MAX_CHOICES short of 2**63 (seed + 15 <= 2**63 - 1).
MAX_SEED = 2**63 - MAX_CHOICES
# repetition_penalty divides positive logits and multiplies negative ones; outside this range
# the products overflow or lose every token's ordering, so it is refused.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0


def as_float32(value: float) -> float:
    """`value` rounded to float32, as the wire's `float` fields carry it."""
    return struct.unpack("f", struct.pack("f", value))[0]


@dataclass(frozen=True)
class Range:
    """Closed bounds `[low, high]` (None: unbounded on that side; `low_open`: low excluded) and
    the words an error uses for them (`must be ...`)."""

    low: float | None
    high: float | None
    text: str
    low_open: bool = False

    def contains(self, value: float, float32: bool = False) -> bool:
        """Whether `value` is in range; `float32` compares with the bounds rounded to float32,
        for values that crossed the wire (0.01 arrives as 0.0099999998)."""
        low, high = self.low, self.high
        if float32:
            low = as_float32(low) if low is not None else None
            high = as_float32(high) if high is not None else None
        if low is not None and (value <= low if self.low_open else value < low):
            return False
        return high is None or value <= high


SAMPLING_RANGES: dict[str, Range] = {
    "max_tokens": Range(1, None, "must be >= 1"),
    "temperature": Range(0, None, "must be >= 0"),
    "top_p": Range(0, 1, "must be in (0, 1]", low_open=True),
    "top_k": Range(-1, None, "must be -1, 0 (off) or a positive count"),
    "min_p": Range(0, 1, "must be in [0, 1]"),
    "repetition_penalty": Range(MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY,
                                f"must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}]"),
    "presence_penalty": Range(-2, 2, "must be in [-2, 2]"),
    "frequency_penalty": Range(-2, 2, "must be in [-2, 2]"),
    "logprobs": Range(0, MAX_LOGPROBS, f"must be in [0, {MAX_LOGPROBS}]"),
    "prompt_logprobs": Range(0, MAX_LOGPROBS, f"must be in [0, {MAX_LOGPROBS}]"),
    "seed": Range(0, MAX_SEED, f"must be in [0, {MAX_SEED}] (2^63 - {MAX_CHOICES})"),
}
