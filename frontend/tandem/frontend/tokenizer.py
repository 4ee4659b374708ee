"""Text ↔ token ids for the frontend: loading, round-trip probe, chat templates, stop encodings.

Thread safety: Hugging Face fast tokenizers wrap a Rust object that some versions refuse to
share between threads ("Already borrowed" when one call changes truncation/padding state while
another runs). Every call into the wrapped tokenizer therefore goes through one lock held by
the `TextTokenizer`. The server should call it from the event loop for short texts and move
long prompts to a worker thread (`asyncio.to_thread`): the lock serialises the two, so nothing
is ever unsafe, only briefly contended.
"""

from __future__ import annotations

import copy
import difflib
import functools
import json
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import structlog
# Not `from transformers import AutoTokenizer`: it reaches modeling code that imports torch, and
# the frontend must stay torch-free. AutoTokenizer is imported when a tokenizer needs it.
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

logger = structlog.get_logger(__name__)

# One string that exercises what tokenizers most often get wrong: accents (NFC/NFD
# normalisers), CJK and Arabic (byte fallback, multi-byte merges), emoji with a skin-tone
# modifier (4-byte sequences and ZWJ-free clusters), runs of spaces, tabs and newlines (code).
# It starts with a letter so SentencePiece's dummy-prefix space does not count as a failure.
PROBE_TEXT = (
    "Héllo wörld, naïve café Ångström — 你好，世界！ こんにちは 안녕하세요 "
    "مرحبا بالعالم Привет 🙂👍🏽🚀\n"
    "def f(x):\n\tif x:\n\t\treturn x  # done\n\n    y = [1,\t2]\r\n  end  "
)

ALLOWED_ROLES = frozenset({"system", "user", "assistant", "tool"})

# Keys a client must not smuggle in through chat_template_kwargs: they would change what we
# return (ids vs text), replace the model's template, or shadow the conversation itself.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tokenize",
        "return_dict",
        "return_tensors",
        "add_generation_prompt",
        "chat_template",
        "tokenizer_kwargs",
        "padding",
        "truncation",
        "max_length",
        "return_assistant_tokens_mask",
    }
)

# transformers uses int(1e30) as "no limit known"; anything this large is not a real context.
_MAX_SANE_MODEL_LEN = 1 << 24


class AutoTokenizer:
    """`transformers.AutoTokenizer`, imported on first use (importing it imports torch)."""

    @staticmethod
    def from_pretrained(*args: Any, **kwargs: Any) -> PreTrainedTokenizerBase:
        from transformers import AutoTokenizer as _Auto

        return _Auto.from_pretrained(*args, **kwargs)


# Directories whose tokenizer_config names one of these are plain `tokenizer.json` tokenizers:
# loaded without AutoTokenizer (whose model-config lookup imports torch), as the same class.
_PLAIN_FAST_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})


def _plain_fast_tokenizer(path: str) -> bool:
    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
            name = json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return False
    return name in _PLAIN_FAST_CLASSES and os.path.isfile(os.path.join(path, "tokenizer.json"))


def _load(path: str, use_fast: bool, trust_remote_code: bool) -> PreTrainedTokenizerBase:
    if use_fast and not trust_remote_code and _plain_fast_tokenizer(path):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path, use_fast=use_fast, trust_remote_code=trust_remote_code)


class TextTokenizer:
    """Owns one Hugging Face tokenizer and turns text, chat messages and stop strings into ids.

    Chosen at load time by a round-trip probe: the fast tokenizer when `decode(encode(s)) == s`
    holds on a mixed-script string, otherwise the slow one if it does better. `kind` says which
    was kept ("fast" or "slow") and `probe_passed` whether it round-trips exactly.
    """

    def __init__(
        self,
        hf_tokenizer: PreTrainedTokenizerBase,
        *,
        kind: str,
        probe_passed: bool,
        extra_eos_token_ids: Sequence[int] = (),
    ) -> None:
        self._tok = hf_tokenizer
        self._lock = threading.Lock()
        self.kind = kind
        self.probe_passed = probe_passed
        eos: list[int] = []
        if hf_tokenizer.eos_token_id is not None:
            eos.append(int(hf_tokenizer.eos_token_id))
        for tid in extra_eos_token_ids:
            if int(tid) not in eos:
                eos.append(int(tid))
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.vocab_size: int = len(hf_tokenizer)
        limit = getattr(hf_tokenizer, "model_max_length", None)
        self.max_model_len: int | None = (
            int(limit) if isinstance(limit, int) and 0 < limit <= _MAX_SANE_MODEL_LEN else None
        )

    # -- loading ---------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], trust_remote_code: bool = False) -> TextTokenizer:
        """Loads the tokenizer of a Hugging Face model directory, preferring the fast one."""
        path = os.fspath(path)
        candidates: list[tuple[PreTrainedTokenizerBase, float]] = []
        errors: list[str] = []
        for use_fast in (True, False):
            if candidates and candidates[0][1] >= 1.0:
                break  # the fast tokenizer round-trips: no reason to look further
            label = "fast" if use_fast else "slow"
            try:
                tok = _load(path, use_fast, trust_remote_code)
            except Exception as exc:  # noqa: BLE001 - any loader failure means "try the other one"
                errors.append(f"{label}: {exc!r}")
                logger.warning("tokenizer failed to load", path=path, kind=label, error=repr(exc))
                continue
            # Recent transformers hand back the fast class again when no slow implementation
            # exists; probing it twice would tell us nothing new.
            if candidates and tok.is_fast and type(tok) is type(candidates[0][0]):
                continue
            candidates.append((tok, _probe(tok)))
        if not candidates:
            raise ValueError(f"cannot load a tokenizer from {path!r}: {'; '.join(errors)}")
        chosen, score = max(candidates, key=lambda c: c[1])  # first (fast) wins ties
        passed = score >= 1.0
        kind = "fast" if chosen.is_fast else "slow"
        if not passed:
            logger.warning(
                "tokenizer does not round-trip the probe text; it probably normalises input",
                path=path,
                kind=kind,
                similarity=round(score, 4),
            )
        return cls(chosen, kind=kind, probe_passed=passed, extra_eos_token_ids=_generation_config_eos(path))

    # -- text ------------------------------------------------------------------------------------
    @property
    def hf_tokenizer(self) -> PreTrainedTokenizerBase:
        """The wrapped tokenizer; callers that use it directly take on the threading caveat."""
        return self._tok

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """UTF-8 bytes one token can stand for at most (computed once, ~1 s for 50k tokens)."""
        with self._lock:
            return _max_token_bytes(self._tok)

    def clone(self) -> TextTokenizer:
        """An independent copy (its own Rust tokenizer and lock) for another thread."""
        with self._lock:
            tok = copy.deepcopy(self._tok)
        twin = TextTokenizer(tok, kind=self.kind, probe_passed=self.probe_passed,
                             extra_eos_token_ids=self.eos_token_ids)
        if "max_token_bytes" in self.__dict__:
            twin.__dict__["max_token_bytes"] = self.__dict__["max_token_bytes"]
        return twin

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens` the tokenizer adds BOS/EOS as it is
        configured to (many chat models add nothing, Llama-style ones add BOS)."""
        with self._lock:
            return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True, **kwargs: Any) -> str:
        """Text of `ids`; extra keyword arguments go to the wrapped tokenizer's decode."""
        with self._lock:
            return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens, **kwargs)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Renders a conversation with the model's chat template and returns its token ids.

        The rendered text already holds the template's special tokens, so it is encoded without
        adding any again (a second BOS changes what many models generate).
        """
        _validate_messages(messages)
        extra = dict(chat_template_kwargs or {})
        reserved = _RESERVED_TEMPLATE_KWARGS.intersection(extra)
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {sorted(reserved)}")
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead of messages")
        try:
            with self._lock:
                rendered = self._tok.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
                )
        except jinja2.TemplateError as exc:
            # Templates reject conversations they do not support (e.g. roles that do not
            # alternate) with raise_exception(); that is the client's error, not ours.
            raise ValueError(f"chat template rejected the messages: {exc}") from exc
        if not isinstance(rendered, str):
            raise TypeError(f"chat template rendered {type(rendered).__name__}, expected str")
        return self.encode(rendered, add_special_tokens=False)

    # -- stops -----------------------------------------------------------------------------------
    def encode_stop_strings(self, stops: Sequence[str]) -> list[list[int]]:
        """Token sequences the engine may stop on early, deduplicated, for each non-empty stop.

        These are a hint, not the rule: the frontend's text match (`StopStringMatcher`) decides
        what the client sees. A string tokenizes differently in context (" Hello" after a word
        is usually one token, "Hello" alone another), so each stop contributes its plain
        encoding and, when different, the encoding of " " + stop with a lone leading space
        token removed. Either sequence decodes to text containing the stop, so an early stop
        fires only where the stop text is really there (a stop that is a special token's text
        is the exception when special tokens are skipped: the text match never sees it).
        """
        return self.encode_stop_strings_with_owner(stops)[0]

    def encode_stop_strings_with_owner(self, stops: Sequence[str]) -> tuple[list[list[int]], list[int]]:
        """Like `encode_stop_strings`, plus `owner[i]`: the index in `stops` of sequence i."""
        sequences: list[list[int]] = []
        owner: list[int] = []
        seen: set[tuple[int, ...]] = set()
        for index, stop in enumerate(stops):
            if not stop:
                continue
            plain = self.encode(stop, add_special_tokens=False)
            spaced = self.encode(" " + stop, add_special_tokens=False)
            if spaced and self.decode(spaced[:1], skip_special_tokens=False) == " ":
                spaced = spaced[1:]
            for seq in (plain, spaced):
                key = tuple(seq)
                if seq and key not in seen:
                    seen.add(key)
                    sequences.append(seq)
                    owner.append(index)
        return sequences, owner


def _max_token_bytes(tok: PreTrainedTokenizerBase) -> int:
    """An upper bound on the UTF-8 bytes of text that one token stands for.

    Each token is decoded alone: byte-level BPE gives its bytes (a partial UTF-8 sequence
    decodes to U+FFFD, 3 bytes, never fewer than it covers); a SentencePiece piece loses its
    leading space when decoded alone, hence the + 1. So a text of T tokens has at most
    T * max_token_bytes bytes, for tokenizers whose normaliser does not delete text (one that
    strips accents could shrink it).
    """
    texts = tok.batch_decode([[i] for i in range(len(tok))], skip_special_tokens=False,
                             clean_up_tokenization_spaces=False)
    return max((len(t.encode("utf-8", "surrogatepass")) for t in texts), default=0) + 1


def _probe(tok: PreTrainedTokenizerBase) -> float:
    """Similarity in [0, 1] of decode(encode(PROBE_TEXT)) to PROBE_TEXT; 1.0 is exact."""
    try:
        ids = tok.encode(PROBE_TEXT, add_special_tokens=False)
        decoded = tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    except Exception as exc:  # noqa: BLE001 - a tokenizer that crashes on the probe scores 0
        logger.warning("tokenizer probe raised", error=repr(exc))
        return 0.0
    if decoded == PROBE_TEXT:
        return 1.0
    # Strictly below 1 even when the ratio rounds to 1, so "exact" stays exact.
    return min(difflib.SequenceMatcher(None, PROBE_TEXT, decoded, autojunk=False).ratio(), 0.999999)


def _generation_config_eos(path: str) -> list[int]:
    """EOS ids listed in generation_config.json (an int or a list), if the directory has one."""
    file = os.path.join(path, "generation_config.json")
    if not os.path.isfile(file):
        return []
    try:
        with open(file, encoding="utf-8") as f:
            value = json.load(f).get("eos_token_id")
    except (OSError, ValueError) as exc:
        logger.warning("unreadable generation_config.json", path=file, error=repr(exc))
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [int(v) for v in value if isinstance(v, int)]
    return []


def _validate_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        role = message.get("role")
        if role not in ALLOWED_ROLES:
            raise ValueError(f"messages[{i}].role must be one of {sorted(ALLOWED_ROLES)}, got {role!r}")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"messages[{i}].content must be a string")
