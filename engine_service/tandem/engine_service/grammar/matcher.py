"""One request's position in its structured-output constraint (an llguidance matcher).

The scheduler side owns it (`Sequence.grammar`): the engine advances it with every token it
reads back (`accept`), `check_stop` ends the request when it is complete (`is_terminated`) or
was left (`is_error`), and each step's token bitmask is filled from it before sampling.

Invariant: the matcher has consumed exactly `prefix` (prompt tokens generated under the
constraint elsewhere: a decode leg's first token) followed by `tokens`. Preemption by recompute
keeps a sequence's output tokens, so the matcher stays where it is; `sync` nonetheless checks,
before each mask, that `tokens` equals the sequence's output and otherwise rolls the matcher
back to their common prefix and replays the rest, so a mask never comes from a stale state.
"""

from __future__ import annotations

import llguidance


class GrammarMatcher:
    """A request's llguidance matcher and the output tokens it has consumed."""

    def __init__(self, matcher: llguidance.LLMatcher, prefix: list[int] | tuple[int, ...] = ()) -> None:
        self.llmatcher = matcher
        self.tokens: list[int] = []
        if prefix and not matcher.consume_tokens(list(prefix)):
            raise ValueError(f"the constrained prompt tokens {list(prefix)} do not match: {matcher.get_error()}")

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False when the constraint rejects it (then `is_error`)."""
        self.tokens.append(token_id)
        return self.llmatcher.consume_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """Complete, and nothing but EOS may follow (the request stops)."""
        return self.llmatcher.is_stopped()

    @property
    def is_error(self) -> bool:
        return self.llmatcher.is_error()

    @property
    def error(self) -> str:
        return self.llmatcher.get_error()

    def rollback(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` accepted tokens."""
        if not 0 <= num_tokens <= len(self.tokens):
            raise ValueError(f"cannot roll back {num_tokens} of {len(self.tokens)} tokens")
        if num_tokens and not self.llmatcher.rollback(num_tokens):
            raise RuntimeError(f"llguidance refused to roll back {num_tokens} tokens: {self.error}")
        del self.tokens[len(self.tokens) - num_tokens:]

    def sync(self, output_token_ids: list[int]) -> None:
        """Make the consumed tokens equal `output_token_ids` (rollback to the common prefix, then
        replay); a no-op in the common case (one list comparison, in C)."""
        tokens = self.tokens
        if tokens == output_token_ids:
            return
        common = 0
        for mine, theirs in zip(tokens, output_token_ids):
            if mine != theirs:
                break
            common += 1
        self.rollback(len(tokens) - common)
        for token_id in output_token_ids[common:]:
            if not self.accept(token_id):
                return  # left in its error state: check_stop ends the request
