from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class UtilityCommand(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UTILITY_COMMAND_UNSPECIFIED: _ClassVar[UtilityCommand]
    UTILITY_COMMAND_HEALTH: _ClassVar[UtilityCommand]
    UTILITY_COMMAND_ABORT: _ClassVar[UtilityCommand]
    UTILITY_COMMAND_STATS: _ClassVar[UtilityCommand]
    UTILITY_COMMAND_FLUSH_PREFIX_CACHE: _ClassVar[UtilityCommand]
    UTILITY_COMMAND_START_PROFILE: _ClassVar[UtilityCommand]
    UTILITY_COMMAND_STOP_PROFILE: _ClassVar[UtilityCommand]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason
UTILITY_COMMAND_UNSPECIFIED: UtilityCommand
UTILITY_COMMAND_HEALTH: UtilityCommand
UTILITY_COMMAND_ABORT: UtilityCommand
UTILITY_COMMAND_STATS: UtilityCommand
UTILITY_COMMAND_FLUSH_PREFIX_CACHE: UtilityCommand
UTILITY_COMMAND_START_PROFILE: UtilityCommand
UTILITY_COMMAND_STOP_PROFILE: UtilityCommand

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "ignore_eos", "logprobs", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens", "logit_bias", "cache_salt", "priority", "prompt_logprobs", "json_schema", "json_object", "regex", "grammar")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    min_tokens: int
    logit_bias: _containers.ScalarMap[int, float]
    cache_salt: str
    priority: int
    prompt_logprobs: int
    json_schema: str
    json_object: bool
    regex: str
    grammar: str
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., min_tokens: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., cache_salt: _Optional[str] = ..., priority: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "text")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    text: str
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., text: _Optional[str] = ...) -> None: ...

class Logprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "rank", "text", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    text: str
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., text: _Optional[str] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens", "total_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    total_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("ttft", "tpot", "latency", "queue")
    TTFT_FIELD_NUMBER: _ClassVar[int]
    TPOT_FIELD_NUMBER: _ClassVar[int]
    LATENCY_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    ttft: float
    tpot: float
    latency: float
    queue: float
    def __init__(self, ttft: _Optional[float] = ..., tpot: _Optional[float] = ..., latency: _Optional[float] = ..., queue: _Optional[float] = ...) -> None: ...

class KVTransferParams(_message.Message):
    __slots__ = ("do_remote_decode", "do_remote_prefill", "remote_engine_id", "remote_block_ids", "remote_host", "remote_port", "remote_group_block_ids", "remote_state_slot", "num_prompt_tokens", "first_token_id", "lease_id", "lease_expiry_unix", "remote_transport", "block_size", "lease_secret", "extra")
    DO_REMOTE_DECODE_FIELD_NUMBER: _ClassVar[int]
    DO_REMOTE_PREFILL_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_HOST_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PORT_FIELD_NUMBER: _ClassVar[int]
    REMOTE_GROUP_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_STATE_SLOT_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRY_UNIX_FIELD_NUMBER: _ClassVar[int]
    REMOTE_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECRET_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    do_remote_decode: bool
    do_remote_prefill: bool
    remote_engine_id: str
    remote_block_ids: _containers.RepeatedScalarFieldContainer[int]
    remote_host: str
    remote_port: int
    remote_group_block_ids: _containers.RepeatedCompositeFieldContainer[BlockIds]
    remote_state_slot: int
    num_prompt_tokens: int
    first_token_id: int
    lease_id: str
    lease_expiry_unix: float
    remote_transport: str
    block_size: int
    lease_secret: str
    extra: _struct_pb2.Struct
    def __init__(self, do_remote_decode: _Optional[bool] = ..., do_remote_prefill: _Optional[bool] = ..., remote_engine_id: _Optional[str] = ..., remote_block_ids: _Optional[_Iterable[int]] = ..., remote_host: _Optional[str] = ..., remote_port: _Optional[int] = ..., remote_group_block_ids: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., remote_state_slot: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., first_token_id: _Optional[int] = ..., lease_id: _Optional[str] = ..., lease_expiry_unix: _Optional[float] = ..., remote_transport: _Optional[str] = ..., block_size: _Optional[int] = ..., lease_secret: _Optional[str] = ..., extra: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class BlockIds(_message.Message):
    __slots__ = ("block_ids",)
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class UtilityRequest(_message.Message):
    __slots__ = ("command", "request_id", "args")
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    command: UtilityCommand
    request_id: str
    args: _struct_pb2.Struct
    def __init__(self, command: _Optional[_Union[UtilityCommand, str]] = ..., request_id: _Optional[str] = ..., args: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class UtilityResponse(_message.Message):
    __slots__ = ("command", "result")
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    command: UtilityCommand
    result: _struct_pb2.Struct
    def __init__(self, command: _Optional[_Union[UtilityCommand, str]] = ..., result: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...
