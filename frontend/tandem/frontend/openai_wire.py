"""OpenAI JSON <-> Tandem protobuf: the translation seam of the HTTP face (no I/O here).

A request body becomes a `frontend_pb2.GenerateRequest`, so the HTTP endpoints run the very
validation, tokenization and fan-out of the gRPC `Frontend` service; a reply (or stream delta)
becomes OpenAI's JSON. Every shape error raises `InvalidRequest` naming the JSON field, which
the HTTP layer answers with OpenAI's error object and status 400.

Fields outside OpenAI's schema that vLLM also accepts (`top_k`, `min_p`, `repetition_penalty`,
`min_tokens`, `ignore_eos`, `stop_token_ids`, `skip_special_tokens`, `include_stop_str_in_output`,
`add_generation_prompt`, `return_token_ids`, `truncate_prompt_tokens`, `cache_salt`, `priority`,
`prompt_logprobs`) map onto the matching protobuf fields (`logit_bias` too); other unknown fields
are ignored, as OpenAI-compatible servers do. OpenAI's `echo` on `/v1/completions` (without
streaming) puts the prompt's text before each choice's, and with `logprobs` the prompt's tokens
before the choice's (their logprobs are prompt logprobs; the first token's is null). Features
Tandem does not implement (tools, `echo` with `stream`, `suffix`, `best_of` > n) are refused with
400 rather than silently ignored.

`/v1/completions` takes OpenAI's batch form too: `prompt` a list of strings or of token-id lists
(`completion_requests`: one GenerateRequest per prompt, at most `MAX_BATCH_PROMPTS`). Prompt i's
choice j is choice `i * n + j` of the reply (`merge_completion_bodies`, `StreamTranslator`'s
`index_offset`), whose usage is the prompts' summed. With `return_token_ids`, each choice carries
its prompt's `prompt_token_ids` (vLLM's completions shape; a chat reply has them at the top level).

`prompt_logprobs` (both endpoints; on chat over the chat-templated prompt) comes back in vLLM's
shape (`prompt_logprobs_json`): on each choice of `/v1/completions`, at the top level of a chat
completion. Streamed, it goes out once per choice, on that choice's first chunk (on the choice of
a completion chunk, at the top level of a chat chunk), and only once the whole prompt's entries
have arrived (`StreamTranslator`).

Structured output (both endpoints) comes in the three spellings a vLLM user knows, at most one
per request: OpenAI's `response_format` (`{"type": "json_schema", "json_schema": {"schema":
...}}`, `{"type": "json_object"}`, `{"type": "text"}` = none), vLLM's `structured_outputs`
object (`json`, `regex`, `grammar` in Lark syntax, `choice`, `json_object`; exactly one), and
vLLM's older top-level `guided_json`, `guided_regex`, `guided_grammar`, `guided_choice`. Each
becomes `SamplingParams.structured_output`; `choice` a Lark grammar of the alternatives.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import grpc

from tandem.frontend.request_builder import RequestBuilder
from tandem.proto_wire import InvalidRequest
from tandem.sampling_ranges import SAMPLING_RANGES
from tandem.v1 import common_pb2, frontend_pb2

# Prompts one /v1/completions call may batch, and choices in all (prompts x n): each prompt is a
# request of its own (registered, tokenized, scheduled), so a call's work stays bounded.
MAX_BATCH_PROMPTS = 64
MAX_BATCH_CHOICES = 256

FINISH_REASONS = {
    common_pb2.FINISH_REASON_UNSPECIFIED: None,
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
}

# gRPC status -> (HTTP status, OpenAI error type).
_HTTP_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "not_implemented_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}


def http_error(code: grpc.StatusCode, message: str) -> tuple[int, dict]:
    """The HTTP status and OpenAI error body of a call that ended with gRPC `code`.

    `param` is the field an `InvalidRequest` message names (its text before the first ': '; 400,
    and 404 for an unknown model)."""
    status, kind = _HTTP_ERRORS.get(code, (500, "server_error"))
    param = None
    if status in (400, 404):
        head, sep, _ = message.partition(": ")
        if sep and head and " " not in head:
            param = head
    return status, {"error": {"message": message, "type": kind, "param": param, "code": code.name.lower()}}


# -- requests --------------------------------------------------------------------------------------
def _typed(body: dict, name: str, kinds: tuple, what: str):
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in kinds:
        raise InvalidRequest(name, f"must be {what}")
    if not isinstance(value, kinds):
        raise InvalidRequest(name, f"must be {what}")
    return value


def _fits(value: int, bits: int = 32) -> bool:
    """Whether a JSON integer fits a signed proto field of `bits` (protobuf's setter raises otherwise)."""
    return -2 ** (bits - 1) <= value < 2 ** (bits - 1)


def _int(body, name, bits: int = 32):
    """An integer that fits the proto field it goes to (int32 unless `bits` says int64): a larger
    one is refused here, naming the field, rather than failing in protobuf's setter."""
    value = _typed(body, name, (int,), "an integer")
    if value is not None and not _fits(value, bits):
        raise InvalidRequest(name, f"must fit a {bits}-bit integer")
    return value


def _num(body, name):
    return _typed(body, name, (int, float), "a number")


def _bool(body, name):
    return _typed(body, name, (bool,), "a boolean")


def _refuse(body: dict, name: str, allowed=(None, False)) -> None:
    if body.get(name) not in allowed:
        raise InvalidRequest(name, "is not supported by this server")


def _common(body: dict, req: frontend_pb2.GenerateRequest) -> None:
    """The fields completions and chat completions share."""
    if not isinstance(body, dict):
        raise InvalidRequest("body", "must be a JSON object")
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise InvalidRequest("model", "must be a string")
        req.model = model
    s = req.sampling
    for name, target, bits in (("max_tokens", "max_tokens", 32), ("max_completion_tokens", "max_tokens", 32),
                               ("top_k", "top_k", 32), ("seed", "seed", 64), ("min_tokens", "min_tokens", 32)):
        value = _int(body, name, bits)
        if value is not None:
            setattr(s, target, value)
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = _num(body, name)
        if value is not None:
            setattr(s, name, value)
    n = _int(body, "n")
    if n is not None:
        req.n = n
    best_of = _int(body, "best_of")
    if best_of is not None and best_of != (n or 1):
        raise InvalidRequest("best_of", "must equal n (this server returns every choice it generates)")
    stop = body.get("stop")
    if isinstance(stop, str):
        req.stop.append(stop)
    elif isinstance(stop, list) and all(isinstance(x, str) for x in stop):
        req.stop.extend(stop)
    elif stop is not None:
        raise InvalidRequest("stop", "must be a string or a list of strings")
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
            raise InvalidRequest("stop_token_ids", "must be a list of integers")
        if not all(_fits(x) for x in ids):
            raise InvalidRequest("stop_token_ids", "each must fit a 32-bit integer")
        s.stop_token_ids.extend(ids)
    for name, target in (("ignore_eos", s), ("skip_special_tokens", req), ("include_stop_str_in_output", req)):
        value = _bool(body, name)
        if value is not None:
            setattr(target, name, value)
    _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise InvalidRequest("stream_options", "must be an object")
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise InvalidRequest("logit_bias", "must be an object of token id -> bias")
        for key, value in bias.items():
            try:
                token = int(key)
            except ValueError:
                raise InvalidRequest("logit_bias", f"key {key!r} is not a token id") from None
            if not _fits(token):
                raise InvalidRequest("logit_bias", f"token id {token} is outside the vocabulary")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidRequest("logit_bias", f"the bias of token {key} must be a number")
            s.logit_bias[token] = value
    priority = _int(body, "priority")
    if priority is not None:
        s.priority = priority
    salt = _typed(body, "cache_salt", (str,), "a string")
    if salt is not None:
        s.cache_salt = salt
    _structured_output(body, s)
    prompt_logprobs = _int(body, "prompt_logprobs")
    if prompt_logprobs is not None:
        bounds = SAMPLING_RANGES["prompt_logprobs"]  # checked here too: a huge value must not reach int32
        if not bounds.contains(prompt_logprobs):
            raise InvalidRequest("prompt_logprobs", bounds.text)
        s.prompt_logprobs = prompt_logprobs
    truncate = _int(body, "truncate_prompt_tokens")
    if truncate is not None:
        req.truncate_prompt_tokens = truncate
    if _bool(body, "return_token_ids"):
        req.return_prompt_token_ids = True


def wants_usage_in_stream(body: dict) -> bool:
    """`stream_options.include_usage`: a last chunk with `usage` and no choices."""
    options = body.get("stream_options") or {}
    return bool(options.get("include_usage"))


def _is_token_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(x, int) and not isinstance(x, bool)
                                                           for x in value)


def _token_ids(value: list[int]) -> list[int]:
    outside = next((x for x in value if x < 0 or not _fits(x)), None)
    if outside is not None:  # the vocabulary's bound is checked later; this one keeps protobuf's
        raise InvalidRequest("prompt", f"token id {outside} is outside the vocabulary")
    return value


def _prompts(prompt) -> list:
    """OpenAI's `prompt`: a string, a list of token ids, or a batch (a list of those)."""
    if isinstance(prompt, str):
        return [prompt]
    if _is_token_ids(prompt):
        return [_token_ids(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(x, str) or _is_token_ids(x) for x in prompt):
        if len(prompt) > MAX_BATCH_PROMPTS:
            raise InvalidRequest("prompt", f"at most {MAX_BATCH_PROMPTS} prompts per call (got {len(prompt)})")
        return [x if isinstance(x, str) else _token_ids(x) for x in prompt]
    raise InvalidRequest("prompt", "must be a string, a list of token ids, or a list of those (a batch)")


def completion_requests(body: dict) -> list[frontend_pb2.GenerateRequest]:
    """`POST /v1/completions` as one GenerateRequest per prompt (one, unless `prompt` is a batch),
    every other field the same."""
    base = frontend_pb2.GenerateRequest()
    _common(body, base)
    prompts = _prompts(body.get("prompt"))
    if len(prompts) > 1 and len(prompts) * RequestBuilder.num_choices(base) > MAX_BATCH_CHOICES:
        raise InvalidRequest("n", f"a batch of {len(prompts)} prompts with n={base.n} asks for more than "
                                  f"{MAX_BATCH_CHOICES} choices in all")
    logprobs = _int(body, "logprobs")
    if logprobs is not None:
        base.sampling.logprobs = logprobs
    if _bool(body, "echo"):
        if body.get("stream"):
            raise InvalidRequest("echo", "not with stream: true (ask without streaming)")
        base.return_prompt_token_ids = True  # the reply puts the prompt's text before each choice's
        if logprobs is not None:
            if body.get("prompt_logprobs") not in (None, logprobs):
                raise InvalidRequest("prompt_logprobs", "with echo and logprobs, leave it out or make it equal logprobs")
            base.sampling.prompt_logprobs = logprobs  # the echoed prompt's tokens get logprobs too
    _refuse(body, "suffix", (None, ""))
    requests = []
    for prompt in prompts:
        req = frontend_pb2.GenerateRequest()
        req.CopyFrom(base)
        if isinstance(prompt, str):
            req.prompt = prompt
        else:
            req.prompt_token_ids.extend(prompt)
        requests.append(req)
    return requests


def _message_text(i: int, content) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequest(f"messages[{i}].content", "only text parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidRequest(f"messages[{i}].content", "must be a string or a list of text parts")


def chat_request(body: dict) -> frontend_pb2.GenerateRequest:
    """`POST /v1/chat/completions` as a GenerateRequest."""
    req = frontend_pb2.GenerateRequest()
    _common(body, req)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages", "must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequest(f"messages[{i}]", "must be an object with a role")
        role = "system" if m["role"] == "developer" else m["role"]
        req.messages.add(role=role, content=_message_text(i, m.get("content")))
    if _bool(body, "logprobs"):
        top = _int(body, "top_logprobs")
        req.sampling.logprobs = top or 0
    elif body.get("top_logprobs") is not None:
        raise InvalidRequest("top_logprobs", "needs logprobs: true")
    add_gen = _bool(body, "add_generation_prompt")
    if add_gen is not None:
        req.add_generation_prompt = add_gen
    _refuse(body, "tools", (None, []))
    _refuse(body, "tool_choice", (None, "none", "auto"))
    return req


# vLLM's `structured_outputs` keys and its older top-level `guided_*` fields, by the kind they set.
_VLLM_KINDS = {"json": "json_schema", "regex": "regex", "grammar": "grammar", "choice": "choice",
               "json_object": "json_object"}
_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_grammar": "grammar",
           "guided_choice": "choice"}


def _structured_output(body: dict, s: common_pb2.SamplingParams) -> None:
    """Sets `s.structured_output` from whichever spelling the body uses (module docstring)."""
    found: list[tuple[str, str, object]] = []  # (JSON field, kind, value)
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise InvalidRequest("response_format", 'type must be "text", "json_object" or "json_schema"')
        if fmt["type"] == "json_object":
            found.append(("response_format", "json_object", True))
        elif fmt["type"] == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
                raise InvalidRequest("response_format", "json_schema.schema must be a JSON Schema object")
            found.append(("response_format", "json_schema", spec["schema"]))
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise InvalidRequest("structured_outputs", "must be an object")
        set_keys = [k for k in _VLLM_KINDS if outputs.get(k) not in (None, False)]
        if len(set_keys) != 1:
            raise InvalidRequest("structured_outputs", f"set exactly one of {', '.join(_VLLM_KINDS)}")
        found.append(("structured_outputs", _VLLM_KINDS[set_keys[0]], outputs[set_keys[0]]))
    found += [(name, kind, body[name]) for name, kind in _GUIDED.items() if body.get(name) is not None]
    if not found:
        return
    if len(found) > 1:
        raise InvalidRequest(found[1][0], f"only one structured-output constraint per request (also {found[0][0]})")
    field, kind, value = found[0]
    if kind == "json_object":
        if value is not True:
            raise InvalidRequest(field, "json_object must be true")
        s.json_object = True
    elif kind == "json_schema":
        if isinstance(value, str):
            s.json_schema = value
        elif isinstance(value, (dict, bool)):
            s.json_schema = json.dumps(value)
        else:
            raise InvalidRequest(field, "the JSON schema must be an object or its JSON text")
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise InvalidRequest(field, "choice must be a non-empty list of non-empty strings")
        s.grammar = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
    else:
        if not isinstance(value, str):
            raise InvalidRequest(field, f"the {kind} must be a string")
        setattr(s, kind, value)


# -- replies ---------------------------------------------------------------------------------------
def total_usage(usages) -> common_pb2.Usage:
    """The usage of a batch's calls together (their fields summed)."""
    total = common_pb2.Usage()
    for u in usages:
        total.prompt_tokens += u.prompt_tokens
        total.completion_tokens += u.completion_tokens
        total.cached_prompt_tokens += u.cached_prompt_tokens
        total.total_tokens += u.total_tokens
    return total


def usage_json(usage: common_pb2.Usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens}}


def chat_logprobs(entries) -> dict:
    return {"content": [{
        "token": e.text, "logprob": e.logprob, "bytes": list(e.text.encode("utf-8")),
        "top_logprobs": [{"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode("utf-8"))}
                         for t in e.top],
    } for e in entries]}


def completion_logprobs(entries, text_offset: int = 0) -> dict:
    offsets, at = [], text_offset
    for e in entries:
        offsets.append(at)
        at += len(e.text)
    return {"tokens": [e.text for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t.text: t.logprob for t in e.top} for e in entries], "text_offset": offsets}


def chat_response(msg: frontend_pb2.GenerateResponse, created: int) -> dict:
    choices = []
    for c in msg.choices:
        choice = {"index": c.index, "message": {"role": "assistant", "content": c.text},
                  "finish_reason": FINISH_REASONS.get(c.finish_reason), "logprobs": None}
        if c.logprobs:
            choice["logprobs"] = chat_logprobs(c.logprobs)
        if c.HasField("stop_str"):
            choice["stop_reason"] = c.stop_str
        elif c.HasField("stop_token_id"):
            choice["stop_reason"] = c.stop_token_id
        choices.append(choice)
    body = {"id": f"chatcmpl-{msg.request_id}", "object": "chat.completion", "created": created,
            "model": msg.model, "choices": choices, "usage": usage_json(msg.usage)}
    if msg.prompt_logprobs:
        body["prompt_logprobs"] = prompt_logprobs_json(msg.prompt_logprobs)  # vLLM: top level on chat
    if msg.prompt_token_ids:
        body["prompt_token_ids"] = list(msg.prompt_token_ids)
    return body


def prompt_logprobs_json(entries) -> list:
    """vLLM's `prompt_logprobs`: None for position 0, then per position a dict keyed by token id
    (the prompt's own token and the top alternatives) of `{logprob, rank, decoded_token}`; an
    alternative's rank is its place in the top list."""
    out: list = [None]
    for e in entries:
        position = {t.token_id: {"logprob": t.logprob, "rank": r, "decoded_token": t.text}
                    for r, t in enumerate(e.top, start=1)}
        position[e.token_id] = {"logprob": e.logprob, "rank": e.rank, "decoded_token": e.text}
        out.append(position)
    return out


@dataclass(frozen=True)
class Echo:
    """`echo: true` on /v1/completions: `text` (the prompt's) goes before every choice's text, and
    with logprobs the prompt's tokens lead the choice's, the first (`first_token_text`) with a
    null logprob. The `keep_*` flags: the body also asked for `prompt_logprobs` /
    `return_token_ids` (echo asks for both itself, and shows them only if they were asked)."""

    text: str
    first_token_text: str
    keep_prompt_logprobs: bool = False
    keep_prompt_token_ids: bool = False

    @classmethod
    def of(cls, body: dict, text: str, first_token_text: str) -> Echo:
        """The echo of a body that asked for it (the caller checked `echo`)."""
        return cls(text, first_token_text, body.get("prompt_logprobs") is not None, bool(body.get("return_token_ids")))


def echoed_logprobs(echo: Echo, prompt_entries, entries) -> dict:
    """OpenAI's completion logprobs over the echoed prompt and the choice's tokens."""
    prompt = completion_logprobs(prompt_entries, len(echo.first_token_text))
    generated = completion_logprobs(entries, len(echo.text))
    return {key: [first] + prompt[key] + generated[key] for key, first in
            (("tokens", echo.first_token_text), ("token_logprobs", None), ("top_logprobs", None), ("text_offset", 0))}


def completion_response(msg: frontend_pb2.GenerateResponse, created: int, echo: Echo | None = None) -> dict:
    choices = []
    for c in msg.choices:
        logprobs = None
        if c.logprobs:
            logprobs = echoed_logprobs(echo, msg.prompt_logprobs, c.logprobs) if echo else completion_logprobs(c.logprobs)
        choice = {"index": c.index, "text": (echo.text if echo else "") + c.text,
                  "finish_reason": FINISH_REASONS.get(c.finish_reason), "logprobs": logprobs}
        if msg.prompt_logprobs and (echo is None or echo.keep_prompt_logprobs):
            # The prompt is every choice's (vLLM repeats it per choice).
            choice["prompt_logprobs"] = prompt_logprobs_json(msg.prompt_logprobs)
        if msg.prompt_token_ids and (echo is None or echo.keep_prompt_token_ids):
            choice["prompt_token_ids"] = list(msg.prompt_token_ids)  # on the choice, as vLLM's completions
        if c.HasField("stop_str"):
            choice["stop_reason"] = c.stop_str
        elif c.HasField("stop_token_id"):
            choice["stop_reason"] = c.stop_token_id
        choices.append(choice)
    return {"id": f"cmpl-{msg.request_id}", "object": "text_completion", "created": created,
            "model": msg.model, "choices": choices, "usage": usage_json(msg.usage)}


def merge_completion_bodies(bodies: list[dict], n: int, usage: common_pb2.Usage) -> dict:
    """The /v1/completions reply to a batch, from each prompt's reply in order: prompt i's choice
    j becomes choice `i * n + j` and `usage` (the batch's, `total_usage`) replaces each prompt's.
    The reply of a single prompt is returned as it is."""
    if len(bodies) == 1:
        return bodies[0]
    choices = [dict(c, index=i * n + c["index"]) for i, body in enumerate(bodies) for c in body["choices"]]
    return dict(bodies[0], choices=choices, usage=usage_json(usage))


class StreamTranslator:
    """Turns one request's `GenerateStreamResponse`s into OpenAI chunk objects, in order.

    Invariants: each choice's first chat chunk carries `role: assistant`; a choice's
    `finish_reason` appears once, on its last chunk; with `include_usage` every chunk has
    `usage: null`, and the caller ends the call's stream with `usage_chunk` (no choices, the
    call's usage: OpenAI's shape) once every request of the call has ended (`usage` holds this
    one's). In a batch (`completion_requests`), choice c of the request goes out as choice
    `index_offset + c`.

    With `prompt_logprobs` (the request asked for them) each choice's first chunk carries the
    whole prompt's list once. The entries arrive over several messages as the prompt is computed,
    by choice 0 alone; they are complete once choice 0 has a delta (its first token follows its
    prompt) or the stream ends. Until then the chunks of other choices wait in `_held`, so none
    goes out with part of the list; `flush` hands back whatever still waits.
    """

    def __init__(self, chat: bool, model: str, created: int, include_usage: bool,
                 prompt_logprobs: bool = False, index_offset: int = 0) -> None:
        self.chat = chat
        self.model = model
        self.created = created
        self.include_usage = include_usage
        self.index_offset = index_offset
        self.usage: common_pb2.Usage | None = None  # set by the request's last message
        self._started: set[int] = set()
        self._text_offsets: dict[int, int] = {}
        self.request_id = ""
        self._prompt_entries: list | None = [] if prompt_logprobs else None  # None: not asked
        self._prompt_complete = not prompt_logprobs
        self._prompt_json: list | None = None
        self._held: list[dict] = []
        self._owes_prompt: set[int] = set()  # choices whose first chunk still lacks the list
        self._seen: set[int] = set()  # choices with a chunk made

    def _envelope(self, choices: list[dict]) -> dict:
        prefix, kind = ("chatcmpl", "chat.completion.chunk") if self.chat else ("cmpl", "text_completion")
        body = {"id": f"{prefix}-{self.request_id}", "object": kind, "created": self.created,
                "model": self.model, "choices": choices}
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: common_pb2.Usage) -> dict:
        """The stream's last chunk with `include_usage`: no choices, `usage` (the call's)."""
        last = self._envelope([])
        last["usage"] = usage_json(usage)
        return last

    def _with_prompt_logprobs(self, chunk: dict) -> dict:
        """`chunk` with the prompt logprobs if it is its choice's first (complete list by now)."""
        choice = chunk["choices"][0]
        index = choice["index"] - self.index_offset
        if index in self._owes_prompt:
            self._owes_prompt.discard(index)
            if self._prompt_json is None:  # the list is complete by now: convert it once for every choice
                self._prompt_json = prompt_logprobs_json(self._prompt_entries)
            (chunk if self.chat else choice)["prompt_logprobs"] = self._prompt_json
        return chunk

    def flush(self) -> list[dict]:
        """The held chunks, with the prompt logprobs that arrived (the stream ended early)."""
        self._prompt_complete = True
        held, self._held = self._held, []
        return [self._with_prompt_logprobs(chunk) for chunk in held]

    def chunks(self, msg: frontend_pb2.GenerateStreamResponse) -> list[dict]:
        self.request_id = self.request_id or msg.request_id
        if msg.model:
            self.model = msg.model
        if self._prompt_entries is not None:
            self._prompt_entries.extend(msg.prompt_logprobs)
        if any(c.index == 0 for c in msg.choices) or msg.HasField("usage"):
            self._prompt_complete = True
        out = []
        for c in msg.choices:
            if self._prompt_entries is not None and c.index not in self._seen:
                self._owes_prompt.add(c.index)
            self._seen.add(c.index)
            finish = FINISH_REASONS.get(c.finish_reason)
            if self.chat:
                delta: dict = {}
                if c.index not in self._started:
                    delta["role"] = "assistant"
                    self._started.add(c.index)
                if c.text or "role" in delta:
                    delta["content"] = c.text
                choice = {"index": self.index_offset + c.index, "delta": delta, "finish_reason": finish,
                          "logprobs": None}
                if c.logprobs:
                    choice["logprobs"] = chat_logprobs(c.logprobs)
            else:
                offset = self._text_offsets.get(c.index, 0)
                choice = {"index": self.index_offset + c.index, "text": c.text, "finish_reason": finish,
                          "logprobs": completion_logprobs(c.logprobs, offset) if c.logprobs else None}
                self._text_offsets[c.index] = offset + len(c.text)
            if c.HasField("stop_str"):
                choice["stop_reason"] = c.stop_str
            out.append(self._envelope([choice]))
        if not self._prompt_complete:
            self._held.extend(out)
            return []
        if msg.HasField("usage"):
            self.usage = msg.usage
        return self.flush() + [self._with_prompt_logprobs(chunk) for chunk in out]


def tokenize_request(body: dict) -> frontend_pb2.GenerateRequest:
    """`POST /tokenize` ({"prompt": text} or {"messages": [...]}, optional `model` and
    `add_generation_prompt`) as the GenerateRequest whose prompt would be tokenized."""
    if not isinstance(body, dict):
        raise InvalidRequest("body", "must be a JSON object")
    if "messages" in body:
        req = chat_request({k: body[k] for k in ("model", "messages", "add_generation_prompt") if k in body})
    else:
        req = frontend_pb2.GenerateRequest()
        if not isinstance(body.get("prompt"), str):
            raise InvalidRequest("prompt", "must be a string (or send messages)")
        req.prompt = body["prompt"]
        if isinstance(body.get("model"), str):
            req.model = body["model"]
    return req


def detokenize_ids(body: dict) -> list[int]:
    """`POST /detokenize`'s `tokens`: a list of token ids."""
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in tokens):
        raise InvalidRequest("tokens", "must be a list of token ids")
    return tokens
