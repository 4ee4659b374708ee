"""The protobuf wire, converted and validated: `SamplingParams`, limits and KV transfer
parameters between the generated messages and the core protocol's typed structs, for both
services (`tandem.core_protocol` is what crosses into the engine core; this module is the seam
with gRPC).

Both services validate with the same code: the frontend to fail fast before tokenizing, the
engine because it is the authority on vocabulary and context length and may be called directly.
Every error names the offending field so a client can fix its request.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import msgspec
from google.protobuf import json_format, struct_pb2, unknown_fields

from tandem.core_protocol import FinishReason, KVTransferParams, SamplingParams, StructuredOutput, StructuredOutputKind
from tandem.sampling_ranges import (  # noqa: F401 - the bounds are re-exported for callers of this module
    MAX_CHOICES,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MIN_REPETITION_PENALTY,
    SAMPLING_RANGES,
)
from tandem.structured_output import InvalidStructuredOutput, check as check_structured_output
from tandem.v1 import common_pb2

MAX_STOP_TOKEN_IDS = 64
MAX_STOP_SEQUENCES = 64
MAX_STOP_SEQUENCE_LEN = 64
# Temperatures below this are greedy: dividing logits by a smaller number overflows float32
# (1e-38 makes every logit inf, softmax NaN, and the sampler then picks token 0 forever).
TEMPERATURE_EPSILON = 1e-5


class InvalidRequest(ValueError):
    """A request field is invalid; `field` names it. `status` is the gRPC status it maps to, by
    name (INVALID_ARGUMENT; HTTP 400)."""

    status = "INVALID_ARGUMENT"

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class UnknownModel(InvalidRequest):
    """`model` names a model this server does not serve: NOT_FOUND (HTTP 404, as OpenAI and vLLM
    answer it), so a gateway can tell it from a malformed request."""

    status = "NOT_FOUND"


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


def _finite(field: str, value: float) -> float:
    if math.isnan(value) or math.isinf(value):
        raise InvalidRequest(field, "must be a finite number")
    return value


def _ranged(field: str, value, float32: bool = False):
    """`value` if it lies in the field's range (`tandem.sampling_ranges`); float fields are
    float32 on the wire and checked as such."""
    if float32:
        value = _finite(field, value)
    rng = SAMPLING_RANGES[field]
    if not rng.contains(value, float32):
        raise InvalidRequest(field, rng.text)
    return value


def _token_id(field: str, value: int, vocab_size: int) -> int:
    if not 0 <= value < vocab_size:
        raise InvalidRequest(field, f"token id {value} is outside the vocabulary [0, {vocab_size})")
    return value


MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_CACHE_SALT_BYTES = 256


def _logit_bias(bias, vocab_size: int) -> dict[int, float]:
    """`logit_bias` checked: token ids in the vocabulary, finite values in [-100, 100]."""
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequest("logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} entries")
    out = {}
    for token, value in bias.items():
        _token_id("logit_bias", token, vocab_size)
        if not (math.isfinite(value) and -100.0 <= value <= 100.0):
            raise InvalidRequest("logit_bias", f"the bias of token {token} must be in [-100, 100]")
        out[int(token)] = float(value)
    return out


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
        _ranged("max_tokens", msg.max_tokens)
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
        p.temperature = _ranged("temperature", msg.temperature, float32=True)
        if p.temperature < TEMPERATURE_EPSILON:
            p.temperature = 0.0  # greedy, as the arithmetic would be without overflowing
    if msg.HasField("top_p"):
        p.top_p = _ranged("top_p", msg.top_p, float32=True)
    if msg.HasField("top_k"):
        p.top_k = max(_ranged("top_k", msg.top_k), 0)
    if msg.HasField("min_p"):
        p.min_p = _ranged("min_p", msg.min_p, float32=True)
    if msg.HasField("seed"):
        p.seed = _ranged("seed", msg.seed)
    if len(msg.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} entries")
    p.stop_token_ids = [_token_id("stop_token_ids", t, limits.vocab_size) for t in msg.stop_token_ids]
    if msg.HasField("ignore_eos"):
        p.ignore_eos = msg.ignore_eos
    if msg.HasField("logprobs"):
        p.logprobs = _ranged("logprobs", msg.logprobs)
    if msg.HasField("prompt_logprobs"):
        p.prompt_logprobs = _ranged("prompt_logprobs", msg.prompt_logprobs)
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        if msg.HasField(name):
            setattr(p, name, _ranged(name, getattr(msg, name), float32=True))
    if msg.HasField("min_tokens"):
        if not 0 <= msg.min_tokens <= p.max_tokens:
            raise InvalidRequest("min_tokens", "must be in [0, max_tokens]")
        p.min_tokens = msg.min_tokens
    if msg.logit_bias:
        p.logit_bias = _logit_bias(msg.logit_bias, limits.vocab_size)
    if msg.cache_salt:
        if len(msg.cache_salt.encode("utf-8", "surrogatepass")) > MAX_CACHE_SALT_BYTES:
            raise InvalidRequest("cache_salt", f"at most {MAX_CACHE_SALT_BYTES} bytes")
        p.cache_salt = msg.cache_salt
    if msg.HasField("priority"):
        p.priority = msg.priority
    if msg.WhichOneof("structured_output") is not None:
        p.structured_output = structured_output_from_proto(msg)
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


def structured_output_from_proto(msg: common_pb2.SamplingParams) -> StructuredOutput:
    """The request's constraint, checked to compile (InvalidRequest naming the oneof's field)."""
    which = msg.WhichOneof("structured_output")
    field = f"structured_output.{which}"
    if which == "json_object":
        if not msg.json_object:
            raise InvalidRequest(field, "only true is valid (leave the field unset for no constraint)")
        so = StructuredOutput(kind=StructuredOutputKind.JSON_OBJECT)
    else:
        so = StructuredOutput(kind=StructuredOutputKind(which), spec=getattr(msg, which))
    try:
        check_structured_output(so)
    except InvalidStructuredOutput as exc:
        raise InvalidRequest(field, str(exc)) from None
    return so


def with_constrained_prompt_tokens(params: SamplingParams, num_tokens: int, num_prompt_tokens: int) -> SamplingParams:
    """`params` whose constraint first consumes the prompt's last `num_tokens` tokens (an engine
    request's `num_constrained_prompt_tokens`: a decode leg's first token)."""
    field = "num_constrained_prompt_tokens"
    if params.structured_output is None:
        raise InvalidRequest(field, "needs sampling.structured_output")
    if not 0 <= num_tokens < num_prompt_tokens:
        raise InvalidRequest(field, f"must be in [0, {num_prompt_tokens}) (the prompt's length)")
    so = msgspec.structs.replace(params.structured_output, num_constrained_prompt_tokens=num_tokens)
    return msgspec.structs.replace(params, structured_output=so)


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


# kv_transfer_params are echoed in the final reply; bounding them keeps every reply far below the
# 16 MiB message limit (a reply's other parts are bounded by the context length). The same bound
# applies to the `x-tandem-kv-transfer` header's JSON (gRPC's own metadata limit, 8 KiB by
# default, usually refuses a larger header first).
MAX_KV_TRANSFER_PARAMS_BYTES = 64 * 1024
# The gRPC metadata header that carries the same parameters as `kv_transfer_params`, as one JSON
# object with the same keys, for routers in a service mesh that do not parse request bodies.
# When a request has both, the header wins: it replaces the body's parameters as a whole.
KV_TRANSFER_HEADER = "x-tandem-kv-transfer"

_KV_OPTIONAL_SCALARS = ("remote_engine_id", "remote_host", "remote_port", "remote_state_slot", "num_prompt_tokens",
                        "first_token_id", "lease_id", "lease_expiry_unix", "remote_transport", "block_size",
                        "lease_secret")
_KV_NON_NEGATIVE = ("remote_state_slot", "num_prompt_tokens", "first_token_id")


def _check_kv_params(params: KVTransferParams, field: str) -> KVTransferParams:
    """Range checks shared by the typed message and the header; raises InvalidRequest."""
    if params.remote_port is not None and not 0 < params.remote_port < 65536:
        raise InvalidRequest(f"{field}.remote_port", f"{params.remote_port} is not a port (1..65535)")
    if params.block_size is not None and params.block_size < 1:
        raise InvalidRequest(f"{field}.block_size", "must be >= 1")
    for name in _KV_NON_NEGATIVE:
        value = getattr(params, name)
        if value is not None and value < 0:
            raise InvalidRequest(f"{field}.{name}", "must be >= 0")
    ids = list(params.remote_block_ids or [])
    for group in params.remote_group_block_ids or []:
        ids.extend(group)
    if any(b < 0 for b in ids):
        raise InvalidRequest(f"{field}.remote_block_ids", "block ids must be >= 0")
    if params.lease_expiry_unix is not None and not math.isfinite(params.lease_expiry_unix):
        raise InvalidRequest(f"{field}.lease_expiry_unix", "must be a finite number")
    clash = sorted(set(params.extra) & set(KVTransferParams._NAMED))
    if clash:
        raise InvalidRequest(f"{field}.extra", f"{clash[0]!r} is a named field; set it directly")
    return params


def kv_transfer_from_proto(msg: common_pb2.KVTransferParams) -> KVTransferParams:
    """The typed wire message as the core's `KVTransferParams`; raises InvalidRequest.

    Unset optional fields and empty id lists become None, as in a params object built in Python."""
    if msg.ByteSize() > MAX_KV_TRANSFER_PARAMS_BYTES:
        raise InvalidRequest("kv_transfer_params", f"{msg.ByteSize()} bytes serialized; at most "
                                                   f"{MAX_KV_TRANSFER_PARAMS_BYTES}")
    fields: dict = {"do_remote_decode": msg.do_remote_decode, "do_remote_prefill": msg.do_remote_prefill}
    for name in _KV_OPTIONAL_SCALARS:
        if msg.HasField(name):
            fields[name] = getattr(msg, name)
    if msg.remote_block_ids:
        fields["remote_block_ids"] = list(msg.remote_block_ids)
    if msg.remote_group_block_ids:
        fields["remote_group_block_ids"] = [list(g.block_ids) for g in msg.remote_group_block_ids]
    if msg.HasField("extra"):
        fields["extra"] = json_format.MessageToDict(msg.extra)
    return _check_kv_params(KVTransferParams(**fields), "kv_transfer_params")


def kv_transfer_to_proto(params: KVTransferParams) -> common_pb2.KVTransferParams:
    """The core's `KVTransferParams` as the typed wire message."""
    msg = common_pb2.KVTransferParams(do_remote_decode=params.do_remote_decode,
                                      do_remote_prefill=params.do_remote_prefill)
    for name in _KV_OPTIONAL_SCALARS:
        value = getattr(params, name)
        if value is not None:
            setattr(msg, name, value)
    if params.remote_block_ids:
        msg.remote_block_ids.extend(params.remote_block_ids)
    for group in params.remote_group_block_ids or []:
        msg.remote_group_block_ids.add(block_ids=group)
    if params.extra:
        json_format.ParseDict(params.extra, msg.extra)
    return msg


def kv_transfer_from_header(value: str | bytes) -> KVTransferParams:
    """The `x-tandem-kv-transfer` header's JSON object (the same keys as `kv_transfer_params`);
    raises InvalidRequest naming the header."""
    field = KV_TRANSFER_HEADER
    if len(value) > MAX_KV_TRANSFER_PARAMS_BYTES:
        raise InvalidRequest(field, f"{len(value)} bytes; at most {MAX_KV_TRANSFER_PARAMS_BYTES}")
    try:
        data = json.loads(value)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(field, f"not valid JSON ({exc})") from None
    return kv_transfer_from_dict(data, field)


def kv_transfer_from_dict(data: dict, field: str = "kv_transfer_params") -> KVTransferParams:
    """Parameters from a JSON-like dict with the message's keys (unknown keys, or those under
    "extra", land in `extra`); raises InvalidRequest naming `field`."""
    if not isinstance(data, dict):
        raise InvalidRequest(field, f"must be a JSON object, got {type(data).__name__}")
    data = _from_proto3_json(data, field)
    nested = data.pop("extra", None)  # the typed message's JSON form: unknown keys under "extra"
    if nested is not None:
        if not isinstance(nested, dict):
            raise InvalidRequest(f"{field}.extra", "must be a JSON object")
        data = {**nested, **data}
    for name in ("do_remote_decode", "do_remote_prefill"):
        if name in data and not isinstance(data[name], bool):
            raise InvalidRequest(f"{field}.{name}", "must be true or false")
    for name in ("remote_engine_id", "remote_host", "lease_id", "remote_transport", "lease_secret"):
        if data.get(name) is not None and not isinstance(data[name], str):
            raise InvalidRequest(f"{field}.{name}", "must be a string")
    try:
        params = KVTransferParams.from_dict(data)
    except ValueError as exc:
        raise InvalidRequest(field, str(exc)) from None
    params = _check_kv_params(params, field)
    try:
        kv_transfer_to_proto(params)  # the wire's int32/int64 ranges
    except (ValueError, TypeError, json_format.ParseError) as exc:
        raise InvalidRequest(field, f"a value is out of range ({exc})") from None
    return params


# The message's fields by their proto3 JSON names (camelCase), and those of type int64, which
# protobuf's JSON printer writes as decimal strings.
_KV_JSON_NAMES = {f.json_name: f.name for f in common_pb2.KVTransferParams.DESCRIPTOR.fields}
_KV_INT64 = frozenset(f.name for f in common_pb2.KVTransferParams.DESCRIPTOR.fields
                      if f.type == f.TYPE_INT64)
_BLOCK_IDS_KEYS = ("block_ids", "blockIds")


def _int64(value, field: str):
    """An int64 as the JSON printer writes it (a decimal string) or as a number."""
    if isinstance(value, str):
        text = value[1:] if value.startswith("-") else value
        if not text.isdigit():
            raise InvalidRequest(field, f"{value[:32]!r} is not an integer")
        return int(value)
    return value


def _from_proto3_json(data: dict, field: str) -> dict:
    """`data` with the proto3 JSON form of `KVTransferParams` (as `json_format.MessageToDict`
    prints it: camelCase names, int64 values as strings, each group as {"blockIds": [...]})
    turned into the field-name form; keys of neither form are left alone (they land in extra)."""
    out = {_KV_JSON_NAMES.get(k, k): v for k, v in data.items()}
    for name in _KV_INT64 & out.keys():
        value = out[name]
        out[name] = [_int64(v, f"{field}.{name}") for v in value] if isinstance(value, list) else \
            _int64(value, f"{field}.{name}")
    groups = out.get("remote_group_block_ids")
    if isinstance(groups, list):
        unwrapped = []
        for g in groups:
            if isinstance(g, dict):
                ids = next((g[k] for k in _BLOCK_IDS_KEYS if k in g), [])
                g = [_int64(v, f"{field}.remote_group_block_ids") for v in ids] if isinstance(ids, list) else ids
            unwrapped.append(g)
        out["remote_group_block_ids"] = unwrapped
    return out


def kv_transfer_from_metadata(metadata) -> KVTransferParams | None:
    """The header's parameters from a call's invocation metadata ((key, value) pairs), or None
    when the header is absent; raises InvalidRequest (also when it is given twice)."""
    values = [v for k, v in (metadata or ()) if k == KV_TRANSFER_HEADER]
    if not values:
        return None
    if len(values) > 1:
        raise InvalidRequest(KV_TRANSFER_HEADER, f"given {len(values)} times; send one JSON object")
    return kv_transfer_from_header(values[0])


def kv_transfer_params_of(request, metadata) -> KVTransferParams | None:
    """A request's transfer parameters: the `x-tandem-kv-transfer` header's when the call has
    one (it wins, whole), else the message's `kv_transfer_params`, else None; raises InvalidRequest."""
    from_header = kv_transfer_from_metadata(metadata)
    if from_header is not None:
        return from_header
    if request.HasField("kv_transfer_params"):
        return kv_transfer_from_proto(request.kv_transfer_params)
    return None


# The field number of the untyped Struct form of a frontend request's KV transfer parameters
# (removed; reserved in frontend.proto).
REMOVED_LEGACY_KV_FIELD_NUMBER = 9


def refuse_removed_legacy_kv_params(request) -> None:
    """Raises InvalidRequest when `request` carries the removed Struct form of its KV transfer
    parameters (an unknown field 9 now): a router built against it is told, not silently
    served without its transfer."""
    if any(f.field_number == REMOVED_LEGACY_KV_FIELD_NUMBER for f in unknown_fields.UnknownFieldSet(request)):
        raise InvalidRequest("legacy_kv_transfer_params", "removed: send kv_transfer_params (the typed message, "
                                                          "field 14) or the x-tandem-kv-transfer header")


def kv_params_steer(params: common_pb2.KVTransferParams) -> bool:
    """Whether the parameters set anything besides `extra`: a lease to make or to pull, an
    address, block ids, a secret (what only a trusted caller may send or see)."""
    named = common_pb2.KVTransferParams()
    named.CopyFrom(params)
    named.ClearField("extra")
    return named.ByteSize() > 0


def public_kv_params(params: common_pb2.KVTransferParams) -> common_pb2.KVTransferParams | None:
    """What of the parameters a caller that is not trusted may see: `extra` only (never a pull
    address, lease, secret or block ids); None when that is empty."""
    if not params.HasField("extra") or not params.extra.fields:
        return None
    return common_pb2.KVTransferParams(extra=params.extra)


def set_reply_kv_params(msg, params: common_pb2.KVTransferParams) -> None:
    """Puts the returned parameters on a frontend reply."""
    msg.kv_transfer_params.CopyFrom(params)


def to_struct(data: dict) -> struct_pb2.Struct:
    """A JSON-like dict as the `google.protobuf.Struct` the Utility responses carry."""
    out = struct_pb2.Struct()
    json_format.ParseDict(data, out)
    return out
