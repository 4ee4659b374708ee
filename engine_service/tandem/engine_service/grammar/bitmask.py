"""One step's token bitmask, filled on the host from the constrained rows' matchers.

Layout (llguidance's and the sampler's): row r, bit (t % 32) of int32 word (t // 32) is 1 when
token t may follow. Words cover ``num_words(vocab_size)`` × 32 ids; bits past the vocabulary
are never read. Filling runs in llguidance's own threads (`LLExecutor`, the GIL released).
"""

from __future__ import annotations

import llguidance
import llguidance.numpy
import numpy as np

from tandem.engine_service.grammar.matcher import GrammarMatcher

_executor: llguidance.LLExecutor | None = None


def num_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def fill_bitmask(matchers: list[GrammarMatcher], vocab_size: int) -> np.ndarray:
    """``[len(matchers), num_words(vocab_size)]`` int32: each matcher's allowed next tokens."""
    global _executor
    words = np.full((len(matchers), num_words(vocab_size)), -1, dtype=np.int32)
    if len(matchers) == 1:
        llguidance.numpy.fill_next_token_bitmask(matchers[0].llmatcher, words, 0)
        return words
    if _executor is None:
        _executor = llguidance.LLExecutor()
    llguidance.numpy.fill_next_token_bitmask_par(_executor, [(m.llmatcher, i) for i, m in enumerate(matchers)], words)
    return words
