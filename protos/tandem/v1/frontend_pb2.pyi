from tandem.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "messages", "prompt_token_ids", "sampling", "stop", "include_stop_str_in_output", "n", "kv_transfer_params", "skip_special_tokens", "model", "add_generation_prompt", "return_prompt_token_ids", "truncate_prompt_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    RETURN_PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    stop: _containers.RepeatedScalarFieldContainer[str]
    include_stop_str_in_output: bool
    n: int
    kv_transfer_params: _common_pb2.KVTransferParams
    skip_special_tokens: bool
    model: str
    add_generation_prompt: bool
    return_prompt_token_ids: bool
    truncate_prompt_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., include_stop_str_in_output: _Optional[bool] = ..., n: _Optional[int] = ..., kv_transfer_params: _Optional[_Union[_common_pb2.KVTransferParams, _Mapping]] = ..., skip_special_tokens: _Optional[bool] = ..., model: _Optional[str] = ..., add_generation_prompt: _Optional[bool] = ..., return_prompt_token_ids: _Optional[bool] = ..., truncate_prompt_tokens: _Optional[int] = ...) -> None: ...

class Choice(_message.Message):
    __slots__ = ("index", "text", "token_ids", "finish_reason", "stop_str", "stop_token_id", "logprobs", "kv_transfer_params")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_STR_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _common_pb2.FinishReason
    stop_str: str
    stop_token_id: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.Logprobs]
    kv_transfer_params: _common_pb2.KVTransferParams
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_str: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.Logprobs, _Mapping]]] = ..., kv_transfer_params: _Optional[_Union[_common_pb2.KVTransferParams, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "choices", "usage", "timings", "kv_transfer_params", "model", "prompt_token_ids", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    choices: _containers.RepeatedCompositeFieldContainer[Choice]
    usage: _common_pb2.Usage
    timings: _common_pb2.Timings
    kv_transfer_params: _common_pb2.KVTransferParams
    model: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.Logprobs]
    def __init__(self, request_id: _Optional[str] = ..., choices: _Optional[_Iterable[_Union[Choice, _Mapping]]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ..., kv_transfer_params: _Optional[_Union[_common_pb2.KVTransferParams, _Mapping]] = ..., model: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.Logprobs, _Mapping]]] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("request_id", "choices", "usage", "timings", "kv_transfer_params", "model", "prompt_token_ids", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    choices: _containers.RepeatedCompositeFieldContainer[Choice]
    usage: _common_pb2.Usage
    timings: _common_pb2.Timings
    kv_transfer_params: _common_pb2.KVTransferParams
    model: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.Logprobs]
    def __init__(self, request_id: _Optional[str] = ..., choices: _Optional[_Iterable[_Union[Choice, _Mapping]]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ..., kv_transfer_params: _Optional[_Union[_common_pb2.KVTransferParams, _Mapping]] = ..., model: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.Logprobs, _Mapping]]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("served_model_name", "model", "max_context_length", "vocab_size", "eos_token_ids", "sampling_defaults", "sampling_defaults_source", "kv_capacity_tokens", "tokenizer_kind", "has_chat_template", "architecture", "dtype", "tokenizer_round_trip_ok")
    SERVED_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_DEFAULTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_DEFAULTS_SOURCE_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_KIND_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_ROUND_TRIP_OK_FIELD_NUMBER: _ClassVar[int]
    served_model_name: str
    model: str
    max_context_length: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_defaults: _common_pb2.SamplingParams
    sampling_defaults_source: str
    kv_capacity_tokens: int
    tokenizer_kind: str
    has_chat_template: bool
    architecture: str
    dtype: str
    tokenizer_round_trip_ok: bool
    def __init__(self, served_model_name: _Optional[str] = ..., model: _Optional[str] = ..., max_context_length: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., sampling_defaults: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., sampling_defaults_source: _Optional[str] = ..., kv_capacity_tokens: _Optional[int] = ..., tokenizer_kind: _Optional[str] = ..., has_chat_template: _Optional[bool] = ..., architecture: _Optional[str] = ..., dtype: _Optional[str] = ..., tokenizer_round_trip_ok: _Optional[bool] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineReplicaInfo(_message.Message):
    __slots__ = ("address", "role", "ready", "kv_role", "kv_engine_id", "kv_transports")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    KV_ROLE_FIELD_NUMBER: _ClassVar[int]
    KV_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    address: str
    role: str
    ready: bool
    kv_role: str
    kv_engine_id: str
    kv_transports: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, address: _Optional[str] = ..., role: _Optional[str] = ..., ready: _Optional[bool] = ..., kv_role: _Optional[str] = ..., kv_engine_id: _Optional[str] = ..., kv_transports: _Optional[_Iterable[str]] = ...) -> None: ...

class GetServerInfoResponse(_message.Message):
    __slots__ = ("version", "disaggregated", "engine_transport", "frontend_worker_index", "frontend_workers", "engines", "ready")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DISAGGREGATED_FIELD_NUMBER: _ClassVar[int]
    ENGINE_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    FRONTEND_WORKER_INDEX_FIELD_NUMBER: _ClassVar[int]
    FRONTEND_WORKERS_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    version: str
    disaggregated: bool
    engine_transport: str
    frontend_worker_index: int
    frontend_workers: int
    engines: _containers.RepeatedCompositeFieldContainer[EngineReplicaInfo]
    ready: bool
    def __init__(self, version: _Optional[str] = ..., disaggregated: _Optional[bool] = ..., engine_transport: _Optional[str] = ..., frontend_worker_index: _Optional[int] = ..., frontend_workers: _Optional[int] = ..., engines: _Optional[_Iterable[_Union[EngineReplicaInfo, _Mapping]]] = ..., ready: _Optional[bool] = ...) -> None: ...

class GetLoadsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaLoad(_message.Message):
    __slots__ = ("address", "role", "ready", "num_running", "num_waiting", "waiting_tokens", "kv_usage", "kv_blocks_total", "kv_blocks_used", "state_slots_used", "in_flight", "kv_loading_requests", "kv_leases_active", "error")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    WAITING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOTS_USED_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    KV_LOADING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_LEASES_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    address: str
    role: str
    ready: bool
    num_running: int
    num_waiting: int
    waiting_tokens: int
    kv_usage: float
    kv_blocks_total: int
    kv_blocks_used: int
    state_slots_used: int
    in_flight: int
    kv_loading_requests: int
    kv_leases_active: int
    error: str
    def __init__(self, address: _Optional[str] = ..., role: _Optional[str] = ..., ready: _Optional[bool] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., waiting_tokens: _Optional[int] = ..., kv_usage: _Optional[float] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., state_slots_used: _Optional[int] = ..., in_flight: _Optional[int] = ..., kv_loading_requests: _Optional[int] = ..., kv_leases_active: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class GetLoadsResponse(_message.Message):
    __slots__ = ("replicas",)
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaLoad]
    def __init__(self, replicas: _Optional[_Iterable[_Union[ReplicaLoad, _Mapping]]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("model", "prompt", "messages", "add_generation_prompt")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "count", "max_context_length")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    count: int
    max_context_length: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., count: _Optional[int] = ..., max_context_length: _Optional[int] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("token_ids", "skip_special_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...
