"""Compiles structured-output constraints against the model's vocabulary, off the engine loop.

The engine never holds text, but llguidance needs the tokenizer's token vocabulary (each
token's bytes) to know which tokens can continue a match. The compiler loads it once, from the
`tokenizer.json` in the model's directory (for dummy weights the tokenizer made to fit their
vocabulary: the directory the engine reports as `tokenizer_path`), with the model's vocabulary
size (the logits' width, which may exceed the tokenizer's) and EOS ids.

`submit` returns at once with a future; the work (loading the vocabulary on first use, building
the grammar, deep-copying it for the request, consuming a decode leg's constrained prompt
tokens) runs on a small thread pool (llguidance releases the GIL while it builds), and the
scheduler keeps the request out of its queue until the future is done. A constraint compiled
before is built once: each request gets a deep copy of the cached matcher.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import llguidance

from tandem.core_protocol import StructuredOutput
from tandem.engine_service.grammar.matcher import GrammarMatcher
from tandem.structured_output import InvalidStructuredOutput, grammar_text

MAX_CACHED_GRAMMARS = 64


class GrammarCompiler:
    """Builds a `GrammarMatcher` per constrained request on `num_threads` threads."""

    def __init__(self, tokenizer_path: str | Path | None, vocab_size: int, eos_token_ids: tuple[int, ...],
                 num_threads: int = 2) -> None:
        self.tokenizer_path = Path(tokenizer_path) if tokenizer_path else None
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()

    def submit(self, so: StructuredOutput, prefix: list[int]) -> Future[GrammarMatcher]:
        """A future of the request's matcher, positioned after `prefix`; it fails with
        InvalidStructuredOutput when the constraint cannot compile."""
        return self._pool.submit(self._build, so, list(prefix))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _build(self, so: StructuredOutput, prefix: list[int]) -> GrammarMatcher:
        key = (so.kind.value, so.spec)
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
        if compiled is None:
            compiled = llguidance.LLMatcher(self._vocabulary(), grammar_text(so), log_level=0)
            if compiled.is_error():
                raise InvalidStructuredOutput(compiled.get_error().strip())
            with self._lock:
                self._compiled[key] = compiled
                while len(self._compiled) > MAX_CACHED_GRAMMARS:
                    self._compiled.popitem(last=False)
        try:
            return GrammarMatcher(compiled.deep_copy(), prefix)
        except ValueError as exc:
            raise InvalidStructuredOutput(str(exc)) from None

    def _vocabulary(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = load_vocabulary(self.tokenizer_path, self.vocab_size, self.eos_token_ids)
            return self._tokenizer


def load_vocabulary(tokenizer_path: Path | None, vocab_size: int, eos_token_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    """llguidance's view of the model's tokens, from `tokenizer_path`/tokenizer.json."""
    if tokenizer_path is None:
        raise InvalidStructuredOutput("this engine has no tokenizer files, which structured output needs")
    path = tokenizer_path / "tokenizer.json" if tokenizer_path.is_dir() else tokenizer_path
    if not path.is_file():
        raise InvalidStructuredOutput(f"structured output needs the model's tokenizer.json ({path} is missing)")
    try:
        return llguidance.LLTokenizer(str(path), n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)
    except ValueError as exc:  # e.g. the word-level tokenizer of small dummy models: no byte decoding
        raise InvalidStructuredOutput(f"structured output needs a tokenizer whose tokens map to bytes (byte-level or "
                                      f"byte-fallback); llguidance cannot read {path}: {exc}") from None
