"""Turns a public `GenerateRequest` into validated token ids and n engine requests.

Tokenizes once per request whatever n is; choice i gets seed + i when a seed is given, so the
choices are distinct yet reproducible. Every check raises `InvalidRequest` naming its field.

Cheap checks come first (`check_request`, no tokenizer): a prompt is refused by its UTF-8 size
before it is tokenized when it cannot fit the context: a text of T tokens has at most
T * `max_token_bytes` bytes (see `TextTokenizer.max_token_bytes`), so a prompt longer than
`max_prompt_bytes` = max_model_len * max_token_bytes (never more than MAX_PROMPT_BYTES) would be
refused after tokenizing anyway.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.core_protocol import SamplingParams
from tandem.frontend.choice_state import ChoiceState
from tandem.frontend.tokenizer import TextTokenizer
from tandem.proto_wire import (
    MAX_CHOICES,
    MAX_KV_TRANSFER_PARAMS_BYTES,  # noqa: F401 - re-exported (the bound's documented home was here)
    MAX_STOP_SEQUENCE_LEN,
    InvalidRequest,
    Limits,
    UnknownModel,
    check_prompt_token_ids,
    kv_transfer_from_proto,
    sampling_from_proto,
)
from tandem.v1 import common_pb2
from tandem.v1 import engine_pb2, frontend_pb2

MAX_N = MAX_CHOICES
MAX_STOPS = 16
MAX_STOP_LEN = 256
MAX_MESSAGES = 1024
# Absolute ceiling on a prompt's (or all messages' contents') UTF-8 size, whatever the context.
MAX_PROMPT_BYTES = 4 * 1024 * 1024
# How much of an unknown `model` name an error message quotes.
MAX_ECHOED_MODEL_CHARS = 64
CHAT_ROLES = ("system", "user", "assistant", "tool")


@dataclass
class PreparedRequest:
    """A request ready to fan out: its prompt tokens and one engine request per choice.

    `sampling` is the request's sampling as validated against the engines' limits (every choice
    shares it but the seed); its `max_tokens` is resolved (the client's, else the engines'
    default capped by the context), which the disaggregated legs split.
    """

    external_id: str
    prompt_token_ids: list[int]
    engine_requests: list[engine_pb2.EngineRequest]
    stops: list[str]
    stop_sequence_owner: list[int]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    want_logprobs: bool
    return_prompt_token_ids: bool
    kv_transfer_params: common_pb2.KVTransferParams | None = None
    extra: dict = field(default_factory=dict)
    sampling: SamplingParams = field(default_factory=SamplingParams)


class RequestBuilder:
    """Validation, tokenization and fan-out planning for the frontend."""

    def __init__(self, tokenizer: TextTokenizer, limits: Limits, served_model_name: str, aliases: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.limits = limits
        self.served_model_name = served_model_name
        self.model_names = {served_model_name, *aliases}
        self.max_prompt_bytes = min(MAX_PROMPT_BYTES, limits.max_model_len * tokenizer.max_token_bytes)

    @staticmethod
    def num_choices(request: frontend_pb2.GenerateRequest) -> int:
        return request.n if request.HasField("n") else 1

    def check_request(self, request: frontend_pb2.GenerateRequest) -> None:
        """Cheap checks that need no tokenizer (done before registering the request ID)."""
        if request.model and request.model not in self.model_names:
            shown = request.model[:MAX_ECHOED_MODEL_CHARS]
            more = f"… ({len(request.model)} characters)" if len(request.model) > MAX_ECHOED_MODEL_CHARS else ""
            raise UnknownModel("model", f"unknown model {shown!r}{more}; this server serves {self.served_model_name!r}")
        given = [name for name, present in (
            ("prompt", bool(request.prompt)),
            ("messages", len(request.messages) > 0),
            ("prompt_token_ids", len(request.prompt_token_ids) > 0),
        ) if present]
        if not given:
            raise InvalidRequest("prompt", "one of prompt, messages or prompt_token_ids is required and must not be empty")
        if len(given) > 1:
            raise InvalidRequest(given[1], f"only one of prompt, messages, prompt_token_ids may be set (got {', '.join(given)})")
        truncating = request.HasField("truncate_prompt_tokens")
        if truncating and not 1 <= request.truncate_prompt_tokens < self.limits.max_model_len:
            raise InvalidRequest("truncate_prompt_tokens", f"must be in [1, {self.limits.max_model_len - 1}] "
                                                           f"(the context is {self.limits.max_model_len} tokens)")
        # A prompt that will be cut to fit may be longer than the context: only the absolute cap.
        limit = MAX_PROMPT_BYTES if truncating else self.max_prompt_bytes
        if request.prompt and len(request.prompt.encode("utf-8", "surrogatepass")) > limit:
            raise InvalidRequest("prompt", f"at most {limit} bytes (UTF-8): a longer text cannot fit the context "
                                           f"of {self.limits.max_model_len} tokens")
        if len(request.prompt_token_ids) >= self.limits.max_model_len and not truncating:
            raise InvalidRequest("prompt_token_ids", f"{len(request.prompt_token_ids)} tokens leave no room in the "
                                                     f"context of {self.limits.max_model_len}")
        if len(request.messages) > MAX_MESSAGES:
            raise InvalidRequest("messages", f"at most {MAX_MESSAGES} messages")
        total = 0
        for i, m in enumerate(request.messages):
            if m.role not in CHAT_ROLES:
                raise InvalidRequest(f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}")
            total += len(m.content.encode("utf-8", "surrogatepass"))
        if total > limit:
            raise InvalidRequest("messages", f"at most {limit} bytes (UTF-8) of content in all: a longer "
                                             f"conversation cannot fit the context of {self.limits.max_model_len} tokens")
        n = self.num_choices(request)
        if not 1 <= n <= MAX_N:
            raise InvalidRequest("n", f"must be in [1, {MAX_N}]")
        if len(request.stop) > MAX_STOPS:
            raise InvalidRequest("stop", f"at most {MAX_STOPS} stop strings")
        for s in request.stop:
            if not s or len(s) > MAX_STOP_LEN:
                raise InvalidRequest("stop", f"each stop string needs 1..{MAX_STOP_LEN} characters")
        if request.HasField("kv_transfer_params"):
            # Bounded (MAX_KV_TRANSFER_PARAMS_BYTES serialized) and range-checked here; the engine
            # is the authority on what they mean.
            kv_transfer_from_proto(request.kv_transfer_params)

    def prompt_token_ids(self, request: frontend_pb2.GenerateRequest, tokenizer: TextTokenizer | None = None) -> list[int]:
        """The prompt's token ids as a generation would see them (`tokenizer`: the calling
        thread's own, default the shared one)."""
        return self._prompt_ids(request, tokenizer if tokenizer is not None else self.tokenizer)

    def _prompt_ids(self, request: frontend_pb2.GenerateRequest, tokenizer: TextTokenizer) -> list[int]:
        if request.prompt_token_ids:
            return check_prompt_token_ids("prompt_token_ids", request.prompt_token_ids, self.limits.vocab_size)
        if request.messages:
            messages = [{"role": m.role, "content": m.content} for m in request.messages]
            add_gen = request.add_generation_prompt if request.HasField("add_generation_prompt") else True
            try:
                return tokenizer.apply_chat_template(messages, add_generation_prompt=add_gen)
            except ValueError as exc:
                raise InvalidRequest("messages", str(exc)) from exc
        return tokenizer.encode(request.prompt)

    def prepare(self, request: frontend_pb2.GenerateRequest, external_id: str, internal_ids: list[str],
                tokenizer: TextTokenizer | None = None) -> PreparedRequest:
        """Tokenizes and validates; `tokenizer` is the calling thread's own (default: the shared one)."""
        tokenizer = tokenizer if tokenizer is not None else self.tokenizer
        prompt = self._prompt_ids(request, tokenizer)
        if request.HasField("truncate_prompt_tokens"):  # range-checked by check_request
            prompt = prompt[-request.truncate_prompt_tokens:]
        stops = list(request.stop)
        sequences, owner = tokenizer.encode_stop_strings_with_owner(stops) if stops else ([], [])
        # A stop string's token encoding is only the engine's hint to stop early; one longer than
        # the engine accepts is left out and that stop is matched on the text alone.
        kept = [(seq, o) for seq, o in zip(sequences, owner) if len(seq) <= MAX_STOP_SEQUENCE_LEN]
        sequences, owner = [seq for seq, _ in kept], [o for _, o in kept]
        # Validates every sampling field against the model (raises InvalidRequest).
        sampling = sampling_from_proto(request.sampling, self.limits, len(prompt), sequences)
        kv = request.kv_transfer_params if request.HasField("kv_transfer_params") else None
        engine_requests = []
        for i, internal_id in enumerate(internal_ids):
            er = engine_pb2.EngineRequest(request_id=internal_id, prompt_token_ids=prompt)
            er.sampling.CopyFrom(request.sampling)
            if request.sampling.HasField("seed"):
                er.sampling.seed = request.sampling.seed + i
            if i > 0:  # the prompt is shared: choice 0 alone computes its logprobs
                er.sampling.ClearField("prompt_logprobs")
            for seq in sequences:
                er.stop_token_sequences.add(token_ids=seq)
            if kv is not None:
                er.kv_transfer_params.CopyFrom(kv)
            engine_requests.append(er)
        return PreparedRequest(
            external_id=external_id,
            prompt_token_ids=prompt,
            engine_requests=engine_requests,
            stops=stops,
            stop_sequence_owner=owner,
            include_stop_str_in_output=request.include_stop_str_in_output,
            skip_special_tokens=request.skip_special_tokens if request.HasField("skip_special_tokens") else True,
            want_logprobs=request.sampling.HasField("logprobs"),
            return_prompt_token_ids=request.return_prompt_token_ids,
            kv_transfer_params=kv,
            sampling=sampling,
        )

    def choice_state(self, prepared: PreparedRequest, index: int) -> ChoiceState:
        return ChoiceState(
            index=index,
            tokenizer=self.tokenizer,
            prompt_token_ids=prepared.prompt_token_ids,
            stops=prepared.stops,
            include_stop_str_in_output=prepared.include_stop_str_in_output,
            skip_special_tokens=prepared.skip_special_tokens,
            stop_sequence_owner=prepared.stop_sequence_owner,
        )
