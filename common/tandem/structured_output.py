"""Structured-output constraints as llguidance grammars, and their validation (no torch).

Both services call `check` at ingress (through `tandem.proto_wire`), so a schema, regex or Lark
grammar that cannot compile is INVALID_ARGUMENT before it reaches an engine's queue; the engine
compiles the same `grammar_text` against the model's token vocabulary (`tandem.engine_service.
grammar.compiler`). Validation needs no tokenizer: llguidance checks the grammar itself.

JSON schemas compile with `whitespace_flexible` off: the output is compact JSON (no whitespace
outside strings), so its length is bounded by the schema's bounds alone and a model cannot pad
an answer with whitespace until `max_tokens` cuts it. A schema's own "x-guidance" object
overrides these defaults (llguidance applies defaults, then the schema's options).
"""

from __future__ import annotations

import functools
import json

import llguidance

from tandem.core_protocol import StructuredOutput, StructuredOutputKind

MAX_SPEC_BYTES = 64 * 1024
MAX_CHECKED = 64  # constraints remembered as valid by `check`
JSON_DEFAULTS = {"whitespace_flexible": False}
_ANY_OBJECT = {"type": "object"}


class InvalidStructuredOutput(ValueError):
    """The constraint cannot compile; the message says why (llguidance's own words)."""


def grammar_text(so: StructuredOutput) -> str:
    """The llguidance grammar of `so` (not yet checked; `check` does)."""
    if so.kind is StructuredOutputKind.JSON_SCHEMA:
        try:
            schema = json.loads(so.spec)
        except json.JSONDecodeError as exc:
            raise InvalidStructuredOutput(f"not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidStructuredOutput("a JSON Schema is an object (or true/false)")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
        except (ValueError, TypeError) as exc:
            raise InvalidStructuredOutput(str(exc)) from None
    if so.kind is StructuredOutputKind.JSON_OBJECT:
        return llguidance.LLMatcher.grammar_from_json_schema(_ANY_OBJECT, defaults=JSON_DEFAULTS)
    if so.kind is StructuredOutputKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(so.spec)
    return llguidance.LLMatcher.grammar_from_lark(so.spec)


def check(so: StructuredOutput) -> str:
    """`so`'s grammar if it compiles; raises InvalidStructuredOutput otherwise. A constraint that
    passed is remembered (the last `MAX_CHECKED`): each request of a hot schema, and each of a
    request's `n` engine requests, would otherwise be validated again on the event loop."""
    return _checked(so.kind, so.spec)


@functools.lru_cache(maxsize=MAX_CHECKED)
def _checked(kind: StructuredOutputKind, spec: str) -> str:
    if len(spec.encode("utf-8", "surrogatepass")) > MAX_SPEC_BYTES:
        raise InvalidStructuredOutput(f"at most {MAX_SPEC_BYTES} bytes")
    if kind is not StructuredOutputKind.JSON_OBJECT and not spec.strip():
        raise InvalidStructuredOutput("must not be empty")
    grammar = grammar_text(StructuredOutput(kind=kind, spec=spec))
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidStructuredOutput(error.strip())
    return grammar
