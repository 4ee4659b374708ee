from tandem.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EngineModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineModelInfo(_message.Message):
    __slots__ = ("model", "model_path", "tokenizer_path", "architecture", "max_model_len", "vocab_size", "eos_token_ids", "dtype", "device", "kv_blocks", "block_size", "kv_capacity_tokens", "enable_prefix_caching", "sampling_defaults", "sampling_defaults_source", "kv_transfer")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_PATH_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENABLE_PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_DEFAULTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_DEFAULTS_SOURCE_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_path: str
    tokenizer_path: str
    architecture: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    device: str
    kv_blocks: int
    block_size: int
    kv_capacity_tokens: int
    enable_prefix_caching: bool
    sampling_defaults: _common_pb2.SamplingParams
    sampling_defaults_source: str
    kv_transfer: EngineKVTransferInfo
    def __init__(self, model: _Optional[str] = ..., model_path: _Optional[str] = ..., tokenizer_path: _Optional[str] = ..., architecture: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., kv_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., kv_capacity_tokens: _Optional[int] = ..., enable_prefix_caching: _Optional[bool] = ..., sampling_defaults: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., sampling_defaults_source: _Optional[str] = ..., kv_transfer: _Optional[_Union[EngineKVTransferInfo, _Mapping]] = ...) -> None: ...

class EngineKVTransferInfo(_message.Message):
    __slots__ = ("role", "engine_id", "transfer_address", "transports", "lease_seconds")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    role: str
    engine_id: str
    transfer_address: str
    transports: _containers.RepeatedScalarFieldContainer[str]
    lease_seconds: float
    def __init__(self, role: _Optional[str] = ..., engine_id: _Optional[str] = ..., transfer_address: _Optional[str] = ..., transports: _Optional[_Iterable[str]] = ..., lease_seconds: _Optional[float] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("channel_id",)
    CHANNEL_ID_FIELD_NUMBER: _ClassVar[int]
    channel_id: str
    def __init__(self, channel_id: _Optional[str] = ...) -> None: ...

class EngineBatch(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[EngineResponse]
    def __init__(self, responses: _Optional[_Iterable[_Union[EngineResponse, _Mapping]]] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class TokenSequence(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class EngineRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "stop_token_sequences", "kv_transfer_params", "channel_id", "num_constrained_prompt_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CONSTRAINED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    stop_token_sequences: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    kv_transfer_params: _common_pb2.KVTransferParams
    channel_id: str
    num_constrained_prompt_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., stop_token_sequences: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ..., kv_transfer_params: _Optional[_Union[_common_pb2.KVTransferParams, _Mapping]] = ..., channel_id: _Optional[str] = ..., num_constrained_prompt_tokens: _Optional[int] = ...) -> None: ...

class EngineResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "logprobs", "finish_reason", "stop_token_id", "stop_sequence_index", "usage", "timings", "kv_transfer_params", "error", "error_code", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_SEQUENCE_INDEX_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.Logprobs]
    finish_reason: _common_pb2.FinishReason
    stop_token_id: int
    stop_sequence_index: int
    usage: _common_pb2.Usage
    timings: _common_pb2.Timings
    kv_transfer_params: _common_pb2.KVTransferParams
    error: str
    error_code: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.Logprobs]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.Logprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., stop_sequence_index: _Optional[int] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ..., kv_transfer_params: _Optional[_Union[_common_pb2.KVTransferParams, _Mapping]] = ..., error: _Optional[str] = ..., error_code: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.Logprobs, _Mapping]]] = ...) -> None: ...
