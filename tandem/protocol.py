"""Converts and validates the wire's `SamplingParams` into the engine's, for both services.

Both services validate with the same code: the frontend to fail fast before tokenizing, the
engine because it is the authority on vocabulary and context length and may be called directly.
Every error names the offending field so a client can fix its request.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from google.protobuf import json_format, struct_pb2

from tandem.core_protocol import FinishReason, KVTransferParams, SamplingParams
from tandem.v1 import common_pb2

MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 64
MAX_STOP_SEQUENCES = 64
MAX_STOP_SEQUENCE_LEN = 64
# Choices per request (`n`). With a seed, choice i samples with seed + i.
MAX_CHOICES = 16
# The largest seed: choice i of n <= MAX_CHOICES uses seed + i, which must still fit the wire's
# int64, so the range stops MAX_CHOICES short of 2**63 (seed + 15 <= 2**63 - 1).
MAX_SEED = 2**63 - MAX_CHOICES
# Temperatures below this are greedy: dividing logits by a smaller number overflows float32
# (1e-38 makes every logit inf, softmax NaN, and the sampler then picks token 0 forever).
TEMPERATURE_EPSILON = 1e-5
# repetition_penalty divides positive logits and multiplies negative ones; outside this range
# the products overflow or lose every token's ordering, so it is refused.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0


class InvalidRequest(ValueError):
    """A request field is invalid; `field` names it (maps to INVALID_ARGUMENT)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class Limits:
    """What the serving model and server accept."""

    vocab_size: int
    max_model_len: int
    default_max_tokens: int = 256
    kv_capacity_tokens: int | None = None  # the whole KV pool; one request must fit in it
    # The model's sampling defaults (tandem.generation_defaults.GenerationDefaults), applied by
    # the engine to fields a request leaves unset; the frontend validates the request as sent.
    sampling_defaults: object | None = None


def _f32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


def _finite(field: str, value: float) -> float:
    if math.isnan(value) or math.isinf(value):
        raise InvalidRequest(field, "must be a finite number")
    return value


def _token_id(field: str, value: int, vocab_size: int) -> int:
    if not 0 <= value < vocab_size:
        raise InvalidRequest(field, f"token id {value} is outside the vocabulary [0, {vocab_size})")
    return value


def sampling_from_proto(
    msg: common_pb2.SamplingParams,
    limits: Limits,
    num_prompt_tokens: int,
    stop_token_sequences: list[list[int]] | None = None,
) -> SamplingParams:
    """Validates `msg` against `limits` and fills defaults; raises InvalidRequest."""
    if limits.sampling_defaults is not None:
        msg = limits.sampling_defaults.fill(msg)
    p = SamplingParams()
    room = limits.max_model_len - num_prompt_tokens
    if num_prompt_tokens < 1:
        raise InvalidRequest("prompt", "must not be empty")
    if room < 1:
        raise InvalidRequest(
            "prompt",
            f"{num_prompt_tokens} tokens leave no room in the context of {limits.max_model_len}",
        )
    if msg.HasField("max_tokens"):
        if msg.max_tokens < 1:
            raise InvalidRequest("max_tokens", "must be >= 1")
        if msg.max_tokens > room:
            raise InvalidRequest(
                "max_tokens",
                f"prompt ({num_prompt_tokens}) + max_tokens ({msg.max_tokens}) exceeds the "
                f"context length {limits.max_model_len}",
            )
        p.max_tokens = msg.max_tokens
    else:
        p.max_tokens = min(limits.default_max_tokens, room)
    if limits.kv_capacity_tokens is not None and num_prompt_tokens + p.max_tokens > limits.kv_capacity_tokens:
        raise InvalidRequest(
            "max_tokens",
            f"prompt + max_tokens ({num_prompt_tokens + p.max_tokens}) exceeds the KV cache "
            f"capacity of this engine ({limits.kv_capacity_tokens} tokens)",
        )
    if msg.HasField("temperature"):
        p.temperature = _finite("temperature", msg.temperature)
        if p.temperature < 0:
            raise InvalidRequest("temperature", "must be >= 0")
        if p.temperature < TEMPERATURE_EPSILON:
            p.temperature = 0.0  # greedy, as the arithmetic would be without overflowing
    if msg.HasField("top_p"):
        p.top_p = _finite("top_p", msg.top_p)
        if not 0 < p.top_p <= 1:
            raise InvalidRequest("top_p", "must be in (0, 1]")
    if msg.HasField("top_k"):
        if msg.top_k < -1:
            raise InvalidRequest("top_k", "must be -1, 0 (off) or a positive count")
        p.top_k = max(msg.top_k, 0)
    if msg.HasField("min_p"):
        p.min_p = _finite("min_p", msg.min_p)
        if not 0 <= p.min_p <= 1:
            raise InvalidRequest("min_p", "must be in [0, 1]")
    if msg.HasField("seed"):
        if not 0 <= msg.seed <= MAX_SEED:
            raise InvalidRequest("seed", f"must be in [0, {MAX_SEED}] (2^63 - {MAX_CHOICES})")
        p.seed = msg.seed
    if len(msg.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} entries")
    p.stop_token_ids = [_token_id("stop_token_ids", t, limits.vocab_size) for t in msg.stop_token_ids]
    if msg.HasField("ignore_eos"):
        p.ignore_eos = msg.ignore_eos
    if msg.HasField("logprobs"):
        if not 0 <= msg.logprobs <= MAX_LOGPROBS:
            raise InvalidRequest("logprobs", f"must be in [0, {MAX_LOGPROBS}]")
        p.logprobs = msg.logprobs
    if msg.HasField("repetition_penalty"):
        p.repetition_penalty = _finite("repetition_penalty", msg.repetition_penalty)
        # The wire carries float32: compare with the bounds as float32 (0.01 arrives as 0.0099999998).
        if not _f32(MIN_REPETITION_PENALTY) <= p.repetition_penalty <= _f32(MAX_REPETITION_PENALTY):
            raise InvalidRequest("repetition_penalty",
                                 f"must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}]")
    for name in ("presence_penalty", "frequency_penalty"):
        if msg.HasField(name):
            value = _finite(name, getattr(msg, name))
            if not -2 <= value <= 2:
                raise InvalidRequest(name, "must be in [-2, 2]")
            setattr(p, name, value)
    if msg.HasField("min_tokens"):
        if not 0 <= msg.min_tokens <= p.max_tokens:
            raise InvalidRequest("min_tokens", "must be in [0, max_tokens]")
        p.min_tokens = msg.min_tokens
    sequences = stop_token_sequences or []
    if len(sequences) > MAX_STOP_SEQUENCES:
        raise InvalidRequest("stop_token_sequences", f"at most {MAX_STOP_SEQUENCES} sequences")
    for seq in sequences:
        if not seq or len(seq) > MAX_STOP_SEQUENCE_LEN:
            raise InvalidRequest("stop_token_sequences", f"each needs 1..{MAX_STOP_SEQUENCE_LEN} tokens")
        for t in seq:
            _token_id("stop_token_sequences", t, limits.vocab_size)
    p.stop_token_sequences = [list(s) for s in sequences]
    return p


def check_prompt_token_ids(field: str, ids, vocab_size: int) -> list[int]:
    ids = list(ids)
    if not ids:
        raise InvalidRequest(field, "must not be empty")
    for t in ids:
        _token_id(field, t, vocab_size)
    return ids


FINISH_TO_PROTO = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
    FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR,
}


def kv_transfer_from_proto(msg: struct_pb2.Struct) -> KVTransferParams:
    """The request's kv_transfer_params Struct as typed parameters; raises InvalidRequest."""
    try:
        return KVTransferParams.from_dict(json_format.MessageToDict(msg))
    except ValueError as exc:
        raise InvalidRequest("kv_transfer_params", str(exc)) from None


def kv_transfer_to_proto(params: KVTransferParams) -> struct_pb2.Struct:
    """Typed KV transfer parameters back as the wire's Struct."""
    return to_struct(params.to_dict())


def to_struct(data: dict) -> struct_pb2.Struct:
    """A JSON-like dict as the `google.protobuf.Struct` the Utility responses carry."""
    out = struct_pb2.Struct()
    json_format.ParseDict(data, out)
    return out
