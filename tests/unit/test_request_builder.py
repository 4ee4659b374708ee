"""RequestBuilder at every documented bound (docs/api.md) and its fan-out into engine requests.
Found by mutation testing (docs/testing.md): limits are written as the literal numbers the API
documents, and every message a client sees is checked whole."""

from __future__ import annotations

import pytest

from tandem.frontend.app import engine_default_max_tokens
from tandem.frontend.request_builder import PreparedRequest, RequestBuilder
from tandem.frontend.tokenizer import TextTokenizer
from tandem.proto_wire import InvalidRequest, Limits
from tandem.v1 import common_pb2, engine_pb2, frontend_pb2

LIMITS = Limits(vocab_size=49152, max_model_len=64, default_max_tokens=8)


@pytest.fixture(scope="module")
def tok(smollm2_dir) -> TextTokenizer:
    return TextTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def builder(tok) -> RequestBuilder:
    return RequestBuilder(tok, LIMITS, "smollm2", aliases=("small",))


def req(**kw) -> frontend_pb2.GenerateRequest:
    sampling = kw.pop("sampling", {})
    messages = kw.pop("messages", [])
    r = frontend_pb2.GenerateRequest(**kw)
    for role, content in messages:
        r.messages.add(role=role, content=content)
    for k, v in sampling.items():
        setattr(r.sampling, k, v)
    return r


def refused(builder: RequestBuilder, request: frontend_pb2.GenerateRequest) -> tuple[str, str]:
    with pytest.raises(InvalidRequest) as err:
        builder.check_request(request)
    return err.value.field, str(err.value)


def test_prompt_byte_bound_is_the_context_times_the_longest_token(builder, tok):
    assert builder.max_prompt_bytes == 64 * tok.max_token_bytes
    huge = RequestBuilder(tok, Limits(vocab_size=49152, max_model_len=10**7), "m")
    assert huge.max_prompt_bytes == 4 * 1024 * 1024  # the absolute ceiling


def test_num_choices():
    assert RequestBuilder.num_choices(req(prompt="x")) == 1
    assert RequestBuilder.num_choices(req(prompt="x", n=4)) == 4


def test_model_names(builder):
    for name in ("", "smollm2", "small"):
        builder.check_request(req(prompt="x", model=name))
    assert refused(builder, req(prompt="x", model="other")) == (
        "model", "model: unknown model 'other'; this server serves 'smollm2'")
    assert refused(builder, req(prompt="x", model="m" * 64)) == (
        "model", f"model: unknown model '{'m' * 64}'; this server serves 'smollm2'")
    assert refused(builder, req(prompt="x", model="m" * 65)) == (
        "model", f"model: unknown model '{'m' * 64}'… (65 characters); this server serves 'smollm2'")


def test_exactly_one_prompt_kind(builder):
    assert refused(builder, req()) == (
        "prompt", "prompt: one of prompt, messages or prompt_token_ids is required and must not be empty")
    assert refused(builder, req(prompt="x", messages=[("user", "hi")])) == (
        "messages", "messages: only one of prompt, messages, prompt_token_ids may be set (got prompt, messages)")
    assert refused(builder, req(prompt="x", prompt_token_ids=[1])) == (
        "prompt_token_ids",
        "prompt_token_ids: only one of prompt, messages, prompt_token_ids may be set (got prompt, prompt_token_ids)")
    assert refused(builder, req(messages=[("user", "hi")], prompt_token_ids=[1]))[0] == "prompt_token_ids"
    assert refused(builder, req(prompt="x", messages=[("user", "hi")], prompt_token_ids=[1]))[1].endswith(
        "(got prompt, messages, prompt_token_ids)")
    builder.check_request(req(messages=[("user", "hi")]))
    builder.check_request(req(prompt_token_ids=[1]))


def test_prompt_byte_bound_counts_utf8_bytes(builder):
    limit = builder.max_prompt_bytes
    message = f"prompt: at most {limit} bytes (UTF-8): a longer text cannot fit the context of 64 tokens"
    builder.check_request(req(prompt="a" * limit))
    assert refused(builder, req(prompt="a" * (limit + 1))) == ("prompt", message)
    # Two bytes a character: refused by bytes although it has fewer characters than the bound.
    assert refused(builder, req(prompt="é" * (limit // 2 + 1))) == ("prompt", message)


def test_prompt_token_ids_leave_room(builder):
    builder.check_request(req(prompt_token_ids=[1] * 63))
    assert refused(builder, req(prompt_token_ids=[1] * 64)) == (
        "prompt_token_ids", "prompt_token_ids: 64 tokens leave no room in the context of 64")


def test_message_count_roles_and_total_size(builder):
    builder.check_request(req(messages=[("user", "")] * 1024))
    assert refused(builder, req(messages=[("user", "")] * 1025)) == ("messages", "messages: at most 1024 messages")
    for role in ("system", "user", "assistant", "tool"):
        builder.check_request(req(messages=[(role, "hi")]))
    assert refused(builder, req(messages=[("user", "a"), ("robot", "b")])) == (
        "messages[1].role", "messages[1].role: must be one of system, user, assistant, tool")
    limit = builder.max_prompt_bytes
    half = limit // 2
    builder.check_request(req(messages=[("user", "a" * half), ("assistant", "b" * (limit - half))]))
    assert refused(builder, req(messages=[("user", "a" * half), ("assistant", "é" * ((limit - half) // 2 + 1))])) == (
        "messages",
        f"messages: at most {limit} bytes (UTF-8) of content in all: a longer conversation cannot fit the "
        "context of 64 tokens")


def test_n_bounds(builder):
    for n in (1, 16):
        builder.check_request(req(prompt="x", n=n))
    for n in (0, 17, -1):
        assert refused(builder, req(prompt="x", n=n)) == ("n", "n: must be in [1, 16]")


def test_stop_bounds(builder):
    builder.check_request(req(prompt="x", stop=["s"] * 16))
    assert refused(builder, req(prompt="x", stop=["s"] * 17)) == ("stop", "stop: at most 16 stop strings")
    builder.check_request(req(prompt="x", stop=["s" * 256]))
    message = ("stop", "stop: each stop string needs 1..256 characters")
    assert refused(builder, req(prompt="x", stop=["s" * 257])) == message
    assert refused(builder, req(prompt="x", stop=["ok", ""])) == message


def _params_of_size(size: int) -> common_pb2.KVTransferParams:
    """Typed transfer parameters whose serialized size is exactly `size` bytes."""
    for length in range(size - 16, size):
        m = common_pb2.KVTransferParams(remote_engine_id="x" * length)
        if m.ByteSize() == size:
            return m
    raise AssertionError(f"no KVTransferParams of {size} bytes")


def test_kv_transfer_params_size_bound(builder):
    builder.check_request(req(prompt="x", kv_transfer_params=_params_of_size(65536)))
    assert refused(builder, req(prompt="x", kv_transfer_params=_params_of_size(65537))) == (
        "kv_transfer_params", "kv_transfer_params: 65537 bytes serialized; at most 65536")


# -- prepare: tokenizing and fanning out -----------------------------------------------------------
def test_prepare_text_prompt_fans_out_with_seed_plus_index(builder, tok):
    kv = common_pb2.KVTransferParams(do_remote_decode=True)
    request = req(prompt="Hello there", n=3, stop=["END"], sampling={"seed": 7, "temperature": 0.5, "max_tokens": 4},
                  kv_transfer_params=kv)
    p = builder.prepare(request, "ext", ["a", "b", "c"])
    prompt = tok.encode("Hello there")
    assert p.external_id == "ext" and p.prompt_token_ids == prompt
    assert [e.request_id for e in p.engine_requests] == ["a", "b", "c"]
    assert [e.sampling.seed for e in p.engine_requests] == [7, 8, 9]
    sequences, owner = tok.encode_stop_strings_with_owner(["END"])
    for e in p.engine_requests:
        assert list(e.prompt_token_ids) == prompt
        assert e.sampling.temperature == 0.5 and e.sampling.max_tokens == 4
        assert [list(s.token_ids) for s in e.stop_token_sequences] == sequences
        assert e.kv_transfer_params == kv
    assert p.stops == ["END"] and p.stop_sequence_owner == owner
    assert p.kv_transfer_params == kv
    assert request.sampling.seed == 7  # the client's request is left as sent


def test_prepare_defaults(builder):
    p = builder.prepare(req(prompt="Hi"), "e", ["a"])
    e = p.engine_requests[0]
    assert not e.sampling.HasField("seed") and not e.HasField("kv_transfer_params")
    assert list(e.stop_token_sequences) == []
    assert (p.stops, p.stop_sequence_owner, p.kv_transfer_params, p.extra) == ([], [], None, {})
    assert p.include_stop_str_in_output is False and p.skip_special_tokens is True
    assert p.want_logprobs is False and p.return_prompt_token_ids is False


def test_prepare_keeps_the_validated_sampling(builder):
    """The frontend's one conversion of the request's sampling is kept, not redone: the default
    max_tokens (8) capped by what the prompt leaves of the context (64), the client's fields."""
    p = builder.prepare(req(prompt_token_ids=[1] * 60, sampling={"temperature": 0.5, "min_tokens": 2}), "e", ["a"])
    assert (p.sampling.max_tokens, p.sampling.temperature, p.sampling.min_tokens) == (4, 0.5, 2)
    assert builder.prepare(req(prompt="Hi"), "e", ["a"]).sampling.max_tokens == 8
    assert builder.prepare(req(prompt="Hi", sampling={"max_tokens": 30}), "e", ["a"]).sampling.max_tokens == 30


def test_frontend_validates_with_the_engines_default_max_tokens(tok):
    """The engine reports the max_tokens a request that sets none gets (its generation config's,
    else its flag's); the frontend resolves with that value, not its own flag, so a min_tokens
    the engine accepts is not refused here, and the disaggregated legs split the engine's value."""
    info = engine_pb2.EngineModelInfo(sampling_defaults=common_pb2.SamplingParams(max_tokens=40, temperature=0.0))
    assert engine_default_max_tokens(info, 8) == 40
    # An engine that reports none: the frontend's flag.
    assert engine_default_max_tokens(engine_pb2.EngineModelInfo(), 8) == 8
    limits = Limits(vocab_size=49152, max_model_len=64, default_max_tokens=engine_default_max_tokens(info, 8))
    p = RequestBuilder(tok, limits, "smollm2").prepare(req(prompt="Hi", sampling={"min_tokens": 20}), "e", ["a"])
    assert (p.sampling.max_tokens, p.sampling.min_tokens) == (40, 20)
    with pytest.raises(InvalidRequest, match="min_tokens"):
        RequestBuilder(tok, LIMITS, "smollm2").prepare(req(prompt="Hi", sampling={"min_tokens": 20}), "e", ["a"])


def test_prepare_carries_the_output_options(builder):
    p = builder.prepare(req(prompt="Hi", include_stop_str_in_output=True, skip_special_tokens=False,
                            return_prompt_token_ids=True, sampling={"logprobs": 0}), "e", ["a"])
    assert p.include_stop_str_in_output is True and p.skip_special_tokens is False
    assert p.want_logprobs is True and p.return_prompt_token_ids is True
    assert builder.prepare(req(prompt="Hi", skip_special_tokens=True), "e", ["a"]).skip_special_tokens is True


def test_prepare_messages_and_token_ids(builder, tok):
    msgs = [("system", "Be brief."), ("user", "Hi")]
    as_dicts = [{"role": r, "content": c} for r, c in msgs]
    assert builder.prepare(req(messages=msgs), "e", ["a"]).prompt_token_ids == tok.apply_chat_template(as_dicts)
    without = builder.prepare(req(messages=msgs, add_generation_prompt=False), "e", ["a"]).prompt_token_ids
    assert without == tok.apply_chat_template(as_dicts, add_generation_prompt=False)
    with_header = builder.prepare(req(messages=msgs, add_generation_prompt=True), "e", ["a"]).prompt_token_ids
    assert without != with_header
    assert builder.prepare(req(prompt_token_ids=[5, 6]), "e", ["a"]).prompt_token_ids == [5, 6]
    with pytest.raises(InvalidRequest) as err:
        builder.prepare(req(prompt_token_ids=[5, 49152]), "e", ["a"])
    assert str(err.value) == "prompt_token_ids: token id 49152 is outside the vocabulary [0, 49152)"


class _Wrapped:
    """The real tokenizer with chosen stop encodings, or a chat template that refuses."""

    def __init__(self, inner: TextTokenizer, stop_lengths: list[int] | None = None, refuse: str | None = None):
        self.inner, self.stop_lengths, self.refuse = inner, stop_lengths, refuse

    def encode(self, *a, **kw):
        return self.inner.encode(*a, **kw)

    def apply_chat_template(self, *a, **kw):
        if self.refuse:
            raise ValueError(self.refuse)
        return self.inner.apply_chat_template(*a, **kw)

    def encode_stop_strings_with_owner(self, stops):
        return [[7] * n for n in self.stop_lengths], list(range(len(self.stop_lengths)))


def test_chat_template_refusal_names_messages(builder, tok):
    with pytest.raises(InvalidRequest) as err:
        builder.prepare(req(messages=[("user", "hi")]), "e", ["a"], tokenizer=_Wrapped(tok, refuse="no"))
    assert err.value.field == "messages" and str(err.value) == "messages: no"


def test_stop_encodings_longer_than_the_engine_takes_are_text_only(builder, tok):
    wrapped = _Wrapped(tok, stop_lengths=[64, 65, 2])
    p = builder.prepare(req(prompt="Hi", stop=["a", "b", "c"]), "e", ["x"], tokenizer=wrapped)
    assert [len(s.token_ids) for s in p.engine_requests[0].stop_token_sequences] == [64, 2]
    assert p.stop_sequence_owner == [0, 2] and p.stops == ["a", "b", "c"]


def test_prepare_validates_sampling_against_the_prompt(builder):
    with pytest.raises(InvalidRequest) as err:
        builder.prepare(req(prompt_token_ids=[1] * 60, sampling={"max_tokens": 5}), "e", ["a"])
    assert str(err.value) == "max_tokens: prompt (60) + max_tokens (5) exceeds the context length 64"
    builder.prepare(req(prompt_token_ids=[1] * 60, sampling={"max_tokens": 4}), "e", ["a"])


def test_choice_state_gets_the_prepared_options(builder, tok):
    p = PreparedRequest(external_id="e", prompt_token_ids=tok.encode("Say:"), engine_requests=[],
                        stops=["STOP"], stop_sequence_owner=[0, 0], include_stop_str_in_output=True,
                        skip_special_tokens=False, want_logprobs=False, return_prompt_token_ids=False)
    assert p.kv_transfer_params is None and p.extra == {}  # the dataclass defaults
    c = builder.choice_state(p, 2)
    assert c.index == 2 and c.tokenizer is builder.tokenizer
    assert c.stops == ["STOP"] and c.stop_sequence_owner == [0, 0]
    eos = tok.eos_token_ids[0]
    d = c.on_engine(engine_pb2.EngineResponse(token_ids=tok.encode(" a STOP b", add_special_tokens=False)))
    assert d.text == " a STOP"  # include_stop_str_in_output reached the matcher
    c2 = builder.choice_state(p.__class__(**{**p.__dict__, "stops": []}), 0)
    c2.on_engine(engine_pb2.EngineResponse(token_ids=[*tok.encode(" a", add_special_tokens=False), eos]))
    assert c2.text == " a" + tok.decode([eos], skip_special_tokens=False)  # specials kept
    # The prompt reaches the detokenizer as its context (what SentencePiece decoders need).
    assert tok.decode(builder.choice_state(p, 0).detok.context_ids) == tok.decode(p.prompt_token_ids) != ""


def test_truncate_prompt_tokens_keeps_the_prompt_tail(builder, tok):
    text = "one two three four five six seven eight nine ten " * 3
    full = tok.encode(text)
    assert len(full) > 12
    r = req(prompt=text, truncate_prompt_tokens=12)
    builder.check_request(r)
    prepared = builder.prepare(r, "x", ["x-0"])
    assert prepared.prompt_token_ids == full[-12:]
    assert list(prepared.engine_requests[0].prompt_token_ids) == full[-12:]
    # Ids longer than the context (64) are cut instead of refused.
    long_ids = list(range(100, 200))
    r = req(prompt_token_ids=long_ids, truncate_prompt_tokens=63)
    builder.check_request(r)
    assert builder.prepare(r, "y", ["y-0"]).prompt_token_ids == long_ids[-63:]
    assert refused(builder, req(prompt_token_ids=long_ids))[0] == "prompt_token_ids"


@pytest.mark.parametrize("n", [0, -1, 64])
def test_truncate_prompt_tokens_range(builder, n):
    assert refused(builder, req(prompt="hi", truncate_prompt_tokens=n)) == (
        "truncate_prompt_tokens", "truncate_prompt_tokens: must be in [1, 63] (the context is 64 tokens)")
