"""The typed messages between the engine service's gRPC process and its engine core (no torch).

Both sides import this module: the gRPC server translates protobuf into these messages, the
engine core consumes them and answers with one `CoreOutputs` per step. The messages cross a
process boundary as msgpack (msgspec), never pickle; the in-process client hands the same
objects over without encoding them.

Messages to the core (`CoreInput`, a tagged union): `CoreRequest`, `CoreAbort`, `UtilityCall`,
`CoreShutdown`. Messages from the core (`CoreMessage`): `CoreReady` (once, after the model
loaded), `CoreOutputs` (once per step that produced anything), `UtilityResult` (one per call),
`CoreFailed` (once, just before a core that hit a fatal error exits).

Invariants: a request's outputs arrive in order and its last one has `finished=True`; every
`UtilityCall` gets exactly one `UtilityResult` with the same `call_id`.
"""

from __future__ import annotations

import enum
from typing import Any, Union

import msgspec

# -- sampling and endings ---------------------------------------------------------------------------


LOGIT_BAN = -100.0  # a logit_bias of this value bans its token (its logit becomes -inf)


class StructuredOutputKind(str, enum.Enum):
    """What a structured-output constraint's `spec` is (the wire's `structured_output` oneof)."""

    JSON_SCHEMA = "json_schema"  # a JSON Schema as JSON text
    JSON_OBJECT = "json_object"  # any JSON object (`spec` is empty)
    REGEX = "regex"
    GRAMMAR = "grammar"  # llguidance's Lark syntax


class StructuredOutput(msgspec.Struct, frozen=True, kw_only=True):
    """A constraint the generated tokens must match (compiled by the engine with llguidance).

    `num_constrained_prompt_tokens`: how many of the prompt's last tokens were already generated
    under this constraint (a disaggregated decode leg: the prefill leg's first token); the
    engine's matcher consumes them before the first new token.
    """

    kind: StructuredOutputKind
    spec: str = ""
    num_constrained_prompt_tokens: int = 0


class SamplingParams(msgspec.Struct, kw_only=True):
    """Token-level sampling and stopping parameters, already validated by the server layer.

    Conventions: temperature == 0 means greedy; top_k <= 0 means disabled; top_p == 1 and
    min_p == 0 mean disabled; penalties at their neutral values (1.0 / 0.0) mean disabled.
    `logprobs` is the number of top alternatives to return per generated token (None = no
    logprobs at all; 0 = only the sampled token's logprob). `prompt_logprobs` likewise for every
    prompt position after the first (None = none); such a request takes no prefix-cache hits,
    so every prompt position is computed.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    stop_token_sequences: list[list[int]] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    # Token id -> bias added to its logit before sampling; -100 (LOGIT_BAN) bans the token.
    logit_bias: dict[int, float] = msgspec.field(default_factory=dict)
    # Prefix-cache partition (the block hash chain starts from it); "" is the shared one.
    cache_salt: str = ""
    # Waiting-queue rank under the priority scheduling policy: lower goes first.
    priority: int = 0
    # Structured output (None: unconstrained): the engine masks tokens that cannot continue it.
    structured_output: StructuredOutput | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_repetition_penalty(self) -> bool:
        return self.repetition_penalty != 1.0

    @property
    def uses_output_penalties(self) -> bool:
        """Presence or frequency penalty (OpenAI semantics, over output tokens)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def uses_penalties(self) -> bool:
        """Sampling counts every earlier token, so it needs them all on the host."""
        return self.uses_repetition_penalty or self.uses_output_penalties


class FinishReason(str, enum.Enum):
    """Why a request ended (the wire's FinishReason without UNSPECIFIED)."""

    STOP = "stop"  # EOS, a stop token id or a stop token sequence
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"
    ERROR = "error"


class SchedulerReason(str, enum.Enum):
    """Why the scheduler itself ended a request that can never run (FinishReason.ERROR)."""

    KV_CACHE_TOO_SMALL = "kv_cache_too_small"
    EXCEEDS_MAX_MODEL_LEN = "exceeds_max_model_len"
    KV_TRANSFER_FAILED = "kv_transfer_failed"  # a pulled load could not be written (detail says why)
    # The transfer parameters do not fit this engine or this prompt, or the producer refused them
    # (unknown, expired or foreign lease): INVALID_ARGUMENT.
    KV_TRANSFER_REFUSED = "kv_transfer_refused"
    # The producer could not be reached, broke off or sent corrupt bytes: UNAVAILABLE (retryable).
    KV_PRODUCER_UNAVAILABLE = "kv_producer_unavailable"
    # The request's deadline (CoreRequest.deadline) passed before it ended: DEADLINE_EXCEEDED.
    DEADLINE_EXCEEDED = "deadline_exceeded"
    # A prefill leg would make the producer hold more leases than its caps: RESOURCE_EXHAUSTED.
    KV_LEASES_EXHAUSTED = "kv_leases_exhausted"
    # The structured-output constraint did not compile, or the output left it: INVALID_ARGUMENT.
    INVALID_STRUCTURED_OUTPUT = "invalid_structured_output"


class StopToken(msgspec.Struct, frozen=True, tag="token", array_like=True):
    """Ended by this token: an EOS token or one of the request's stop_token_ids."""

    token_id: int


class StopSequence(msgspec.Struct, frozen=True, tag="sequence", array_like=True):
    """Ended by the request's stop_token_sequences[index]."""

    index: int


class StopGrammar(msgspec.Struct, frozen=True, tag="grammar", array_like=True):
    """Ended by its structured-output constraint: complete, and nothing more may follow."""


class SchedulerStop(msgspec.Struct, frozen=True, tag="scheduler", array_like=True):
    """Ended by the scheduler (an ERROR finish): the request can never be scheduled."""

    reason: SchedulerReason
    detail: str = ""  # what exactly went wrong (KV transfer failures)


StopReason = Union[StopToken, StopSequence, StopGrammar, SchedulerStop]


class KVTransferParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Disaggregated prefill/decode parameters of one request.

    The first six fields carry vLLM NixlConnector's names and meanings, so a prefill/decode router
    written for vLLM drives Tandem without translation:

    - `do_remote_decode` (on the prefill leg): keep the prompt's KV for a remote decoder, compute at
      most one new token, and return the fields below in the final output.
    - `do_remote_prefill` (on the decode leg): the prompt's KV lives on `remote_engine_id`; pull the
      blocks this engine does not already hold in its own prefix cache, then decode.
    - `remote_engine_id`, `remote_host`, `remote_port`: the producer and the address it serves KV
      pulls on. `remote_block_ids`: the producer's block ids of the prompt in its first (primary)
      paged cache group.

    Tandem's own fields (filled by the producer in its final output, echoed by the router into the
    decode leg):

    - `remote_group_block_ids`: block ids per paged cache group (hybrid / sliding-window models;
      entry 0 equals `remote_block_ids`). `remote_state_slot`: the producer's state slot holding the
      request's per-request state at the end of the prompt (hybrid models), or None.
    - `num_prompt_tokens`: how many leading tokens of the request's prompt the producer's KV covers.
    - `first_token_id`: the token the prefill leg produced (the decode leg's prompt is the original
      prompt followed by it; its KV is computed by the decoder).
    - `lease_id`, `lease_expiry_unix`: the producer holds the blocks under this lease until the
      consumer releases it or the wall-clock time `lease_expiry_unix` passes (then they are freed).
      `lease_secret`: what a pull or a release of the lease must present; it travels only on the
      trusted path (producer, frontend, consumer) and never to a public client.
    - `remote_transport`: how to pull (`"tcp"`, `"cuda_ipc"` or `"nixl"`); `block_size`: the
      producer's tokens per block (the consumer refuses a mismatch).

    Fields this struct does not name travel in `extra` untouched.
    """

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_block_ids: list[int] | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_group_block_ids: list[list[int]] | None = None
    remote_state_slot: int | None = None
    num_prompt_tokens: int | None = None
    first_token_id: int | None = None
    lease_id: str | None = None
    lease_expiry_unix: float | None = None
    remote_transport: str | None = None
    block_size: int | None = None
    lease_secret: str | None = None
    extra: dict[str, Any] = msgspec.field(default_factory=dict)

    _NAMED = ("do_remote_decode", "do_remote_prefill", "remote_engine_id", "remote_block_ids",
              "remote_host", "remote_port", "remote_group_block_ids", "remote_state_slot",
              "num_prompt_tokens", "first_token_id", "lease_id", "lease_expiry_unix",
              "remote_transport", "block_size", "lease_secret")
    _WHOLE = ("remote_port", "remote_state_slot", "num_prompt_tokens", "first_token_id", "block_size")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "KVTransferParams":
        """From a JSON-like dict (a protobuf Struct's); raises ValueError on a mistyped field."""
        known = {k: data[k] for k in cls._NAMED if k in data and data[k] is not None}
        # A Struct carries every number as a double: whole numbers become ints again.
        for name in cls._WHOLE:
            if name in known:
                known[name] = _whole(name, known[name])
        if "remote_block_ids" in known:
            known["remote_block_ids"] = _whole_list("remote_block_ids", known["remote_block_ids"])
        if "remote_group_block_ids" in known:
            groups = known["remote_group_block_ids"]
            if not isinstance(groups, (list, tuple)):
                raise ValueError("remote_group_block_ids: must be a list of block-id lists")
            known["remote_group_block_ids"] = [_whole_list("remote_group_block_ids", g) for g in groups]
        extra = {k: v for k, v in data.items() if k not in cls._NAMED}
        try:
            return msgspec.convert({**known, "extra": extra}, cls)
        except msgspec.ValidationError as exc:
            raise ValueError(str(exc)) from None

    def to_dict(self) -> dict[str, Any]:
        """Back to a JSON-like dict: the named fields that are set, then `extra`."""
        out: dict[str, Any] = dict(self.extra)
        for k in self._NAMED:
            value = getattr(self, k)
            if value is not None and value is not False:
                out[k] = value
        return out


def _whole_list(field: str, ids: Any) -> list[int]:
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"{field}: must be a list of block ids")
    return [_whole(field, b) for b in ids]


def _whole(field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise ValueError(f"{field}: must be a whole number")
    return int(value)


# -- messages to the core ---------------------------------------------------------------------------


class CoreRequest(msgspec.Struct, tag="add", array_like=True, kw_only=True):
    """Admit one engine request (one choice of a client request)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float  # time.monotonic() at the gRPC server (system-wide clock on Linux)
    channel: str | None = None  # the multiplexed channel its outputs go to (gRPC side only)
    kv_transfer_params: KVTransferParams | None = None
    # time.monotonic() (same clock as arrival_time) when the call's gRPC deadline passes; None:
    # none. The scheduler never admits a request past it and stops one running past it.
    deadline: float | None = None
    # Who sent it (the engine service's AccessPolicy.caller_identity; None: callers not told
    # apart): a producer caps the leases each caller holds.
    caller: str | None = None


class CoreAbort(msgspec.Struct, tag="abort", array_like=True):
    """Abort requests; each still in the core gets a final ABORT output."""

    request_ids: list[str]


class UtilityCommand(str, enum.Enum):
    """What a `UtilityCall` asks the core, between two steps."""

    STATS = "stats"  # result: EngineStats
    FLUSH_PREFIX_CACHE = "flush_prefix_cache"  # result: FlushResult


class UtilityCall(msgspec.Struct, tag="utility", array_like=True):
    """One utility command; answered by one `UtilityResult` with the same `call_id`."""

    call_id: int
    command: UtilityCommand


class CoreShutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """Stop the core loop and exit 0."""


CoreInput = Union[CoreRequest, CoreAbort, UtilityCall, CoreShutdown]

# -- messages from the core ---------------------------------------------------------------------------


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprob report for one sampled token, taken from the raw model distribution.

    ``rank`` is the 1-based rank of the sampled token in that distribution (1 + the number of
    tokens with a strictly higher logprob); ``top`` holds the ``params.logprobs`` most likely
    tokens as ``(token_id, logprob)``, most likely first (empty when ``params.logprobs == 0``).
    """

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


class RequestOutput(msgspec.Struct, array_like=True):
    """What one request produced in one step: new tokens and, on its last output, how it ended
    (finish reason, typed stop reason, usage counts, timestamps, KV transfer parameters)."""

    request_id: str
    new_token_ids: list[int] = msgspec.field(default_factory=list)
    new_logprobs: list[TokenLogprobs | None] = msgspec.field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: StopReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    error: str | None = None
    kv_transfer_params: KVTransferParams | None = None
    # With `prompt_logprobs`: the logprobs of the prompt positions this step's chunk computed,
    # in order (position 1 first over the request's outputs; position 0 has none).
    new_prompt_logprobs: list[TokenLogprobs] = msgspec.field(default_factory=list)


class EngineStats(msgspec.Struct, kw_only=True, tag="stats"):
    """The core's gauges and monotonic counters after a step (Utility STATS and metrics)."""

    num_running: int = 0
    num_waiting: int = 0
    waiting_tokens: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    steps_total: int = 0
    finished_requests_total: int = 0
    aborted_requests_total: int = 0
    overlap_scheduling: bool = False
    max_prefill_tokens_per_seq: int = 0  # the fair-prefill cap in effect (0: none)
    group_blocks_used: int = 0  # used blocks over every paged cache group (kv_blocks_used: the first)
    state_slots_used: int = 0  # state slots held by sequences (models with state groups)
    # Prefix caching of models with state groups: tokens whose K/V were cached at admission
    # (prefix_cache_hits is that, rounded down to the last state checkpoint; equal without state).
    prefix_cache_kv_hits: int = 0
    state_checkpoints_total: int = 0  # checkpoint slots
    state_checkpoints_used: int = 0  # registered (reusable) or pending (a save in flight)
    state_checkpoints_pending: int = 0  # held by requests whose save is not registered yet
    state_checkpoint_saves: int = 0  # checkpoints registered since start
    # Disaggregated prefill/decode (engines with a --kv-role; zero otherwise).
    kv_remote_tokens_loaded: int = 0  # prompt tokens whose KV a consumer pulled from a producer
    kv_remote_blocks_pulled: int = 0  # blocks pulled, over every paged cache group
    kv_remote_bytes_pulled: int = 0
    kv_remote_load_seconds: float = 0.0  # summed over loads, plan to blocks written (bytes / this = GB/s)
    kv_remote_loads: int = 0  # loads finished
    kv_remote_load_failures: int = 0
    kv_loading_requests: int = 0  # requests holding blocks while their KV is pulled
    kv_leases_active: int = 0  # producer: prefills whose blocks wait for a decode leg's pull
    kv_leases_granted: int = 0
    kv_leases_expired: int = 0

    def to_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)


class FlushResult(msgspec.Struct, tag="flush"):
    """FLUSH_PREFIX_CACHE's answer: whether the prefix cache was emptied (False while in use)."""

    flushed: bool


class CoreInfo(msgspec.Struct, kw_only=True):
    """What the gRPC side needs to know about the loaded model (validation limits, model info,
    metrics labels)."""

    model: str
    model_path: str | None  # None for dummy weights (no directory)
    architecture: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    dtype: str
    device: str
    kv_blocks: int
    block_size: int
    kv_capacity_tokens: int
    enable_prefix_caching: bool
    # The engine's KV transfer role: role, engine_id, transfer_address, transports (None: no role).
    kv_transfer: dict[str, Any] | None = None
    # The directory of the model's tokenizer files: model_path, or for dummy weights one that
    # fits their vocabulary (engine_service/worker/tokenizer_files.py); what a frontend loads
    # when it is given no --tokenizer.
    tokenizer_path: str | None = None


class CoreReady(msgspec.Struct, tag="ready", array_like=True):
    """The core loaded its model and serves from now on."""

    info: CoreInfo
    stats: EngineStats
    pid: int


class CoreOutputs(msgspec.Struct, tag="outputs", array_like=True, kw_only=True):
    """One step's outputs for every request that produced something, batched in one message.

    `added_requests`/`added_tokens` count the CoreRequests the core took since its previous
    message (the client stops counting them as in transit once `stats` includes them).
    `step_time` is the model step's duration (0 when the message carries only aborts or
    admission failures); `timestamp` is the core's time.monotonic() when it was sent.
    """

    outputs: list[RequestOutput]
    stats: EngineStats
    step_time: float = 0.0
    stepped: bool = False
    added_requests: int = 0
    added_tokens: int = 0
    timestamp: float = 0.0


class UtilityResult(msgspec.Struct, tag="utility_result", array_like=True):
    """The answer to `UtilityCall` `call_id`: a typed result, or an error message."""

    call_id: int
    result: EngineStats | FlushResult | None = None
    error: str | None = None


class CoreFailed(msgspec.Struct, tag="failed", array_like=True):
    """The core hit a fatal error; it exits non-zero right after sending this."""

    error: str


CoreMessage = Union[CoreReady, CoreOutputs, UtilityResult, CoreFailed]


# -- codecs (one of each per process; msgspec's are reusable and thread-compatible) -------------------


class CoreCodec:
    """msgpack encoders/decoders for both directions (one instance per socket owner)."""

    def __init__(self) -> None:
        self.encoder = msgspec.msgpack.Encoder()
        self.input_decoder = msgspec.msgpack.Decoder(CoreInput)
        self.message_decoder = msgspec.msgpack.Decoder(CoreMessage)
