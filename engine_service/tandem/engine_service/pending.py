"""What both sides of the step plan keep per request in the same way: pending tokens and the
seeded generator.

The scheduler's `Sequence` (sequence.py) and the worker's `RequestRow` (worker/worker_rows.py)
each track a request's progress, and must agree on it token for token: both extend
`PendingTokens` and both draw their generator from `seeded_generator`. This module sits on the
engine's ground floor, so the worker imports it without importing the core.
"""

from __future__ import annotations

import torch

from tandem.core_protocol import SamplingParams


def seeded_generator(params: SamplingParams) -> torch.Generator | None:
    """The CPU generator a seeded request samples from alone (None when it has no seed).

    Created once per request and kept across preemptions, so a seeded request draws the same
    stream whatever else runs beside it."""
    if params.seed is None:
        return None
    generator = torch.Generator(device="cpu")
    generator.manual_seed(params.seed)
    return generator


class PendingTokens:
    """Tokens sampled on the device but not yet read back (overlapped scheduling).

    Invariants: `num_pending_tokens` >= 0; they count in the request's length but not in its
    known token ids; `pending_row` is the newest one's row in its step's sampled-token tensor,
    where the next step's input reads it from. Tokens are confirmed oldest first; a subclass
    sets both attributes (0 and -1) and stores a confirmed token with `_append_confirmed`.
    """

    request_id: str
    num_pending_tokens: int
    pending_row: int

    def mark_pending(self, row: int) -> None:
        """A step sampled the request's next token on the device, at `row` of its tokens."""
        self.num_pending_tokens += 1
        self.pending_row = row

    def confirm_token(self, token_id: int) -> None:
        """The oldest pending token was read back: it becomes a known output token."""
        if self.num_pending_tokens < 1:
            raise RuntimeError(f"{self.request_id}: no pending token to confirm")
        self.num_pending_tokens -= 1
        self._append_confirmed(token_id)

    def _append_confirmed(self, token_id: int) -> None:
        raise NotImplementedError
