"""Turns a public `GenerateRequest` into validated token ids and n engine requests.

Tokenizes once per request whatever n is; choice i gets seed + i when a seed is given, so the
choices are distinct yet reproducible. Every check raises `InvalidRequest` naming its field.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from google.protobuf import struct_pb2

from tandem.frontend.choice_state import ChoiceState
from tandem.frontend.tokenizer import TextTokenizer
from tandem.protocol import InvalidRequest, Limits, check_prompt_token_ids, sampling_from_proto
from tandem.v1 import engine_pb2, frontend_pb2

MAX_N = 16
MAX_STOPS = 16
MAX_STOP_LEN = 256
MAX_MESSAGES = 1024
MAX_PROMPT_CHARS = 4 * 1024 * 1024
CHAT_ROLES = ("system", "user", "assistant", "tool")


@dataclass
class PreparedRequest:
    """A request ready to fan out: its prompt tokens and one engine request per choice."""

    external_id: str
    prompt_token_ids: list[int]
    engine_requests: list[engine_pb2.EngineRequest]
    stops: list[str]
    stop_sequence_owner: list[int]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    want_logprobs: bool
    return_prompt_token_ids: bool
    kv_transfer_params: struct_pb2.Struct | None = None
    extra: dict = field(default_factory=dict)


class RequestBuilder:
    """Validation, tokenization and fan-out planning for the frontend."""

    def __init__(self, tokenizer: TextTokenizer, limits: Limits, served_model_name: str, aliases: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.limits = limits
        self.served_model_name = served_model_name
        self.model_names = {served_model_name, *aliases}

    def tokenizer_info(self) -> dict:
        return {
            "kind": self.tokenizer.kind,
            "round_trip_ok": bool(self.tokenizer.probe_passed),
            "eos_token_ids": list(self.tokenizer.eos_token_ids),
        }

    @staticmethod
    def num_choices(request: frontend_pb2.GenerateRequest) -> int:
        return request.n if request.HasField("n") else 1

    def check_request(self, request: frontend_pb2.GenerateRequest) -> None:
        """Cheap checks that need no tokenizer (done before registering the request ID)."""
        if request.model and request.model not in self.model_names:
            raise InvalidRequest("model", f"unknown model {request.model!r}; this server serves {self.served_model_name!r}")
        given = [name for name, present in (
            ("prompt", bool(request.prompt)),
            ("messages", len(request.messages) > 0),
            ("prompt_token_ids", len(request.prompt_token_ids) > 0),
        ) if present]
        if not given:
            raise InvalidRequest("prompt", "one of prompt, messages or prompt_token_ids is required and must not be empty")
        if len(given) > 1:
            raise InvalidRequest(given[1], f"only one of prompt, messages, prompt_token_ids may be set (got {', '.join(given)})")
        if len(request.prompt) > MAX_PROMPT_CHARS:
            raise InvalidRequest("prompt", f"at most {MAX_PROMPT_CHARS} characters")
        if len(request.messages) > MAX_MESSAGES:
            raise InvalidRequest("messages", f"at most {MAX_MESSAGES} messages")
        total = 0
        for i, m in enumerate(request.messages):
            if m.role not in CHAT_ROLES:
                raise InvalidRequest(f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}")
            total += len(m.content)
        if total > MAX_PROMPT_CHARS:
            raise InvalidRequest("messages", f"at most {MAX_PROMPT_CHARS} characters in all")
        n = self.num_choices(request)
        if not 1 <= n <= MAX_N:
            raise InvalidRequest("n", f"must be in [1, {MAX_N}]")
        if len(request.stop) > MAX_STOPS:
            raise InvalidRequest("stop", f"at most {MAX_STOPS} stop strings")
        for s in request.stop:
            if not s or len(s) > MAX_STOP_LEN:
                raise InvalidRequest("stop", f"each stop string needs 1..{MAX_STOP_LEN} characters")

    def _prompt_ids(self, request: frontend_pb2.GenerateRequest) -> list[int]:
        if request.prompt_token_ids:
            return check_prompt_token_ids("prompt_token_ids", request.prompt_token_ids, self.limits.vocab_size)
        if request.messages:
            messages = [{"role": m.role, "content": m.content} for m in request.messages]
            add_gen = request.add_generation_prompt if request.HasField("add_generation_prompt") else True
            try:
                return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_gen)
            except ValueError as exc:
                raise InvalidRequest("messages", str(exc)) from exc
        return self.tokenizer.encode(request.prompt)

    def prepare(self, request: frontend_pb2.GenerateRequest, external_id: str, internal_ids: list[str]) -> PreparedRequest:
        prompt = self._prompt_ids(request)
        stops = list(request.stop)
        sequences, owner = self.tokenizer.encode_stop_strings_with_owner(stops) if stops else ([], [])
        # Validates every sampling field against the model (raises InvalidRequest).
        sampling_from_proto(request.sampling, self.limits, len(prompt), sequences)
        kv = request.kv_transfer_params if request.HasField("kv_transfer_params") else None
        engine_requests = []
        for i, internal_id in enumerate(internal_ids):
            er = engine_pb2.EngineRequest(request_id=internal_id, prompt_token_ids=prompt)
            er.sampling.CopyFrom(request.sampling)
            if request.sampling.HasField("seed"):
                er.sampling.seed = request.sampling.seed + i
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
