"""Streaming token ids → text deltas that never split a character."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from tandem.frontend.tokenizer import TextTokenizer

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens decoded in front of the first output token. Some decoders (SentencePiece's
# Metaspace + Strip) drop the leading space of whatever token comes first in a decode, so the
# first output token needs real text before it to keep its space.
_PROMPT_CONTEXT_TOKENS = 5
_MAX_PROMPT_CONTEXT_TOKENS = 32

# A character is at most 4 UTF-8 bytes, so an incomplete tail sits in the last few tokens: when
# a multi-token push ends mid-character, this many boundaries are tried to emit what is complete.
_TAIL_LOOKBACK = 4

# Unread tokens held back before giving up on completing a character. Real text reaches a
# character boundary within a handful of tokens; only a model emitting invalid bytes (or only
# skipped special tokens) gets here, and holding forever would make each step O(output).
_MAX_HELD_TOKENS = 16


class IncrementalDetokenizer:
    """Turns one sequence's output token ids, pushed as they arrive, into text deltas.

    Each push decodes only a small window: a few already-emitted tokens for context plus the
    unread ones, and emits what the window adds beyond the context's own decode (the
    prefix/read offset technique). A window whose decode ends in U+FFFD is an incomplete
    multi-byte character and is held back until more tokens complete it; `flush` releases it
    at the end (as U+FFFD if it never completed). The concatenation of all deltas equals
    `tokenizer.decode(output_ids)`, or with `prompt_token_ids` given, the output's part of
    `tokenizer.decode(prompt_ids + output_ids)` (they differ only for decoders that strip the
    first token's leading space). One exception, on malformed or truncated output only:
    SentencePiece byte fallback decodes a whole run of byte tokens as U+FFFDs once the run
    holds an invalid or incomplete sequence, even the complete characters at its start; those
    were already emitted here, so only the broken tail becomes U+FFFD.

    `spaces_between_special_tokens` is passed to `decode` only when False, for tokenizers
    whose decode honours it (recent transformers backends ignore it).
    """

    def __init__(
        self,
        tokenizer: TextTokenizer | PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        kwargs: dict[str, Any] = {"skip_special_tokens": skip_special_tokens}
        if not spaces_between_special_tokens:
            kwargs["spaces_between_special_tokens"] = False
        decode = tokenizer.decode
        self._decode: Callable[[list[int]], str] = lambda ids: decode(ids, **kwargs)

        # The window: ids[:read] is emitted context (the prefix), ids[read:] is unread. Older
        # tokens are dropped as the window slides, so it stays a few tokens long.
        self._ids: list[int] = self._prompt_context(list(prompt_token_ids or ()))
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids) if self._ids else ""
        self._pieces: list[str] = []
        self._flushed = False

    def _prompt_context(self, prompt: list[int]) -> list[int]:
        """The last few prompt tokens, extended back while they decode to nothing visible (a
        tail of skipped special tokens gives no context) or start inside a character (with
        byte fallback that garbles the whole run of byte tokens the output may continue)."""
        n = min(_PROMPT_CONTEXT_TOKENS, len(prompt))
        while n < min(len(prompt), _MAX_PROMPT_CONTEXT_TOKENS):
            text = self._decode(prompt[-n:])
            if text and not text.startswith(REPLACEMENT_CHAR):
                break
            n += 1
        return prompt[len(prompt) - n :]

    @property
    def context_ids(self) -> list[int]:
        """The emitted tokens decoded in front of the unread ones (at first: the prompt's tail)."""
        return self._ids[: self._read]

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._pieces)

    def push(self, token_ids: Sequence[int]) -> str:
        """Adds output tokens; returns the text they complete (maybe empty)."""
        if self._flushed:
            raise RuntimeError("push() after flush(): the detokenizer has finished")
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        end = len(self._ids)
        text = self._decode(self._ids)
        if not text.endswith(REPLACEMENT_CHAR):
            if len(text) > len(self._prefix_text) or end - self._read >= _MAX_HELD_TOKENS:
                return self._emit(end, text)
            # Nothing visible yet (e.g. skipped special tokens): keep the old context so the
            # next token's leading space still decodes right.
            return ""
        # Incomplete character at the end: emit up to the latest clean token boundary, if any.
        # Normally only boundaries inside this push are new, and a character's bytes span only
        # the last few of them. Once too much is held, every held boundary is tried (rare and
        # bounded) before giving up and emitting U+FFFD.
        give_up = end - self._read >= _MAX_HELD_TOKENS
        if give_up:
            lowest = self._read + 1
        else:
            lowest = max(end - len(token_ids) + 1, self._read + 1, end - _TAIL_LOOKBACK)
        delta = self._emit_clean_prefix(lowest)
        if delta is not None:
            return delta
        return self._emit(end, text) if give_up else ""

    def flush(self) -> str:
        """Ends the stream: returns whatever was held back (an incomplete character as U+FFFD)."""
        if self._flushed:
            return ""
        self._flushed = True
        if self._read == len(self._ids):
            return ""
        text = self._decode(self._ids)
        head = ""
        if text.endswith(REPLACEMENT_CHAR):
            # Complete characters before the broken tail go out as they are, so only the tail
            # (decoded on its own if need be) turns into U+FFFD.
            head = self._emit_clean_prefix(self._read + 1) or ""
            text = self._decode(self._ids)
        return head + self._emit(len(self._ids), text, final=True)

    def _emit_clean_prefix(self, lowest: int) -> str | None:
        """Emits up to the latest token boundary k >= lowest (before the end) whose decode is
        complete and adds text; None when there is no such boundary."""
        for k in range(len(self._ids) - 1, lowest - 1, -1):
            partial = self._decode(self._ids[:k])
            if not partial.endswith(REPLACEMENT_CHAR) and len(partial) > len(self._prefix_text):
                return self._emit(k, partial)
        return None

    def _emit(self, upto: int, text: str, final: bool = False) -> str:
        """Emits what `text` (the decode of ids[:upto]) adds to the context's text, then slides
        the window so that ids[read:upto] becomes the new context."""
        if text.startswith(self._prefix_text):
            delta = text[len(self._prefix_text) :]
        else:
            # The new tokens changed how the context decodes: SentencePiece byte fallback turns
            # a whole run of byte tokens into U+FFFDs when the run ends in an invalid or
            # incomplete sequence. The context is already out, so decode the new part alone
            # (it starts with a byte token, so no leading space is at stake).
            delta = self._decode(self._ids[self._read : upto])
        if delta:
            self._pieces.append(delta)
        if final:
            return delta
        old_read = self._read
        del self._ids[:old_read]
        self._read = upto - old_read
        self._prefix_text = self._decode(self._ids[: self._read])
        return delta
