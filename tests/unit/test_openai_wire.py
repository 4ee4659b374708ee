"""OpenAI JSON <-> protobuf translation of the HTTP face (`tandem.frontend.openai_wire`) and the
HTTP bearer-token check (`tandem.security.bearer_denial`)."""

from __future__ import annotations

import json

import grpc
import pytest

from tandem.frontend import openai_wire
from tandem.proto_wire import InvalidRequest
from tandem.security import bearer_denial
from tandem.v1 import common_pb2, frontend_pb2


def completion(body: dict) -> frontend_pb2.GenerateRequest:
    """The one request of a single-prompt /v1/completions body."""
    (req,) = openai_wire.completion_requests(body)
    return req


def test_chat_body_maps_onto_generate_request():
    req = openai_wire.chat_request({
        "model": "m", "messages": [{"role": "developer", "content": "be brief"},
                                   {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "max_completion_tokens": 7, "temperature": 0, "top_p": 0.5, "n": 2, "stop": "END", "seed": 3,
        "logprobs": True, "top_logprobs": 2, "top_k": 5, "ignore_eos": True, "stream": True,
        "truncate_prompt_tokens": 9,
    })
    assert req.truncate_prompt_tokens == 9
    assert req.model == "m" and req.n == 2 and list(req.stop) == ["END"]
    assert [(m.role, m.content) for m in req.messages] == [("system", "be brief"), ("user", "ab")]
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed, s.logprobs, s.top_k, s.ignore_eos) == (7, 0.0, 0.5, 3, 2, 5, True)
    assert s.HasField("temperature")  # 0 is sent, not dropped as a default


def test_unset_fields_stay_unset_so_the_model_defaults_apply():
    req = openai_wire.chat_request({"messages": [{"role": "user", "content": "hi"}]})
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs"):
        assert not req.sampling.HasField(name), name
    assert not req.HasField("n")


@pytest.mark.parametrize("body, field", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": True}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": [1]}, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "structured_outputs": {"regex": "a", "grammar": "b"}},
     "structured_outputs"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"},
      "guided_regex": "a"}, "guided_regex"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
])
def test_chat_shape_errors_name_their_field(body, field):
    with pytest.raises(InvalidRequest) as info:
        openai_wire.chat_request(body)
    assert info.value.field == field


def test_structured_output_spellings():
    """OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields all set
    the one structured_output field (the engine-side behaviour: tests/integration/test_structured_output.py)."""
    msgs = [{"role": "user", "content": "x"}]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    s = openai_wire.chat_request({"messages": msgs, "response_format": fmt}).sampling
    assert s.WhichOneof("structured_output") == "json_schema" and json.loads(s.json_schema) == schema
    assert openai_wire.chat_request({"messages": msgs, "response_format": {"type": "json_object"}}).sampling.json_object
    text = openai_wire.chat_request({"messages": msgs, "response_format": {"type": "text"}}).sampling
    assert text.WhichOneof("structured_output") is None
    s = completion({"prompt": "x", "structured_outputs": {"json": schema}}).sampling
    assert json.loads(s.json_schema) == schema
    assert completion({"prompt": "x", "guided_regex": "[0-9]+"}).sampling.regex == "[0-9]+"
    assert completion({"prompt": "x", "guided_grammar": "start: \"a\""}).sampling.grammar
    s = openai_wire.chat_request({"messages": msgs, "structured_outputs": {"choice": ["yes", 'say "no"']}}).sampling
    assert s.grammar == 'start: "yes" | "say \\"no\\""'


def test_completion_prompt_forms():
    assert completion({"prompt": "hi"}).prompt == "hi"
    assert list(completion({"prompt": [1, 2]}).prompt_token_ids) == [1, 2]
    assert completion({"prompt": ["one"]}).prompt == "one"
    assert completion({"prompt": "x", "logprobs": 0}).sampling.HasField("logprobs")
    for bad in ({"prompt": 3}, {}, {"prompt": []}, {"prompt": ["a", 3]}, {"prompt": [[1], []]},
                {"prompt": "x", "echo": True, "stream": True},
                {"prompt": "x", "echo": True, "logprobs": 2, "prompt_logprobs": 1}, {"prompt": "x", "echo": "yes"}):
        with pytest.raises(InvalidRequest) as info:
            openai_wire.completion_requests(bad)
        assert info.value.field in ("prompt", "echo", "prompt_logprobs")


def test_a_batch_of_prompts_is_one_request_per_prompt_with_the_same_fields():
    reqs = openai_wire.completion_requests({"prompt": ["a", [5, 6], "c"], "n": 2, "max_tokens": 3, "seed": 9,
                                            "logprobs": 1, "stop": ["."]})
    assert [r.prompt for r in reqs] == ["a", "", "c"] and list(reqs[1].prompt_token_ids) == [5, 6]
    for r in reqs:
        assert (r.n, r.sampling.max_tokens, r.sampling.seed, r.sampling.logprobs, list(r.stop)) == (2, 3, 9, 1, ["."])
    limit = openai_wire.MAX_BATCH_PROMPTS
    assert len(openai_wire.completion_requests({"prompt": ["p"] * limit})) == limit
    for bad, field in (({"prompt": ["p"] * (limit + 1)}, "prompt"),
                       ({"prompt": ["p"] * 17, "n": 16}, "n")):  # 272 choices > MAX_BATCH_CHOICES
        with pytest.raises(InvalidRequest) as info:
            openai_wire.completion_requests(bad)
        assert info.value.field == field


def test_a_batch_reply_numbers_choices_by_prompt_and_sums_usage():
    def body(text, prompt_ids, tokens):
        return {"id": "cmpl-x", "object": "text_completion", "created": 1, "model": "m",
                "choices": [{"index": j, "text": f"{text}{j}", "finish_reason": "length", "logprobs": None,
                             "prompt_token_ids": prompt_ids} for j in range(2)],
                "usage": {"prompt_tokens": tokens}}
    usage = openai_wire.total_usage([common_pb2.Usage(prompt_tokens=3, completion_tokens=4, total_tokens=7,
                                                      cached_prompt_tokens=1),
                                     common_pb2.Usage(prompt_tokens=2, completion_tokens=4, total_tokens=6)])
    merged = openai_wire.merge_completion_bodies([body("a", [1, 2, 3], 3), body("b", [4, 5], 2)], 2, usage)
    assert [(c["index"], c["text"], c["prompt_token_ids"]) for c in merged["choices"]] == [
        (0, "a0", [1, 2, 3]), (1, "a1", [1, 2, 3]), (2, "b0", [4, 5]), (3, "b1", [4, 5])]
    assert merged["id"] == "cmpl-x"
    assert merged["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13,
                               "prompt_tokens_details": {"cached_tokens": 1}}
    single = body("a", [1], 1)
    assert openai_wire.merge_completion_bodies([single], 2, usage) is single  # one prompt: as it was


def test_echo_asks_for_the_prompt_and_its_logprobs():
    plain = completion({"prompt": "x", "echo": True})
    assert plain.return_prompt_token_ids and not plain.sampling.HasField("prompt_logprobs")
    scored = completion({"prompt": "x", "echo": True, "logprobs": 2})
    assert scored.sampling.prompt_logprobs == 2 and scored.sampling.logprobs == 2


def test_prompt_logprobs_on_both_endpoints_streamed_or_not():
    chat = {"messages": [{"role": "user", "content": "x"}]}
    for body in ({"prompt": "x"}, chat):
        make = openai_wire.chat_request if "messages" in body else completion
        for stream in (False, True):
            assert make({**body, "prompt_logprobs": 3, "stream": stream}).sampling.prompt_logprobs == 3
        assert make({**body, "prompt_logprobs": 0}).sampling.HasField("prompt_logprobs")
        assert not make(body).sampling.HasField("prompt_logprobs")
        for bad in (-1, 21, 2**40, 1.5, True, "2"):  # 2**40 would not fit the wire's int32
            with pytest.raises(InvalidRequest) as err:
                make({**body, "prompt_logprobs": bad})
            assert str(err.value).startswith("prompt_logprobs: ")


def _lp(token_id: int, text: str, logprob: float, top=()):
    entry = common_pb2.Logprobs(token_id=token_id, text=text, logprob=logprob, rank=1)
    for t_id, t_text, t_lp in top:
        entry.top.add(token_id=t_id, text=t_text, logprob=t_lp)
    return entry


def test_echoed_completion_reply():
    msg = frontend_pb2.GenerateResponse(request_id="r", model="m", prompt_token_ids=[5, 6, 7])
    msg.prompt_logprobs.extend([_lp(6, " b", -1.5, [(6, " b", -1.5)]), _lp(7, "c", -0.5, [(7, "c", -0.5)])])
    choice = msg.choices.add(index=0, text="!?", finish_reason=common_pb2.FINISH_REASON_LENGTH)
    choice.logprobs.extend([_lp(8, "!", -0.1, [(8, "!", -0.1)]), _lp(9, "?", -0.2, [(9, "?", -0.2)])])
    reply = openai_wire.completion_response(msg, 0, openai_wire.Echo.of({"echo": True}, "a bc", "a"))
    got = reply["choices"][0]
    assert got["text"] == "a bc!?"
    assert got["logprobs"]["tokens"] == ["a", " b", "c", "!", "?"]
    assert got["logprobs"]["token_logprobs"] == [None, -1.5, -0.5, pytest.approx(-0.1), pytest.approx(-0.2)]
    assert got["logprobs"]["top_logprobs"][0] is None and got["logprobs"]["top_logprobs"][1] == {" b": -1.5}
    assert got["logprobs"]["text_offset"] == [0, 1, 3, 4, 5]
    # Echo asked for the prompt logprobs and ids itself: shown only when the body asked too.
    assert "prompt_logprobs" not in got and "prompt_token_ids" not in got
    asked = openai_wire.Echo.of({"echo": True, "prompt_logprobs": 1, "return_token_ids": True}, "a bc", "a")
    both = openai_wire.completion_response(msg, 0, asked)
    assert both["choices"][0]["prompt_logprobs"][0] is None and both["choices"][0]["prompt_token_ids"] == [5, 6, 7]
    assert "prompt_token_ids" not in both  # on the choice, as vLLM's completions (chat: top level)
    assert openai_wire.completion_response(msg, 0)["choices"][0]["text"] == "!?"  # no echo


def test_chat_reply_carries_prompt_logprobs_at_the_top_level():
    msg = frontend_pb2.GenerateResponse(request_id="r", model="m")
    msg.prompt_logprobs.extend([_lp(6, " b", -1.5, [(9, "z", -1.0)])])
    msg.choices.add(index=0, text="ok", finish_reason=common_pb2.FINISH_REASON_STOP)
    reply = openai_wire.chat_response(msg, 0)
    assert reply["prompt_logprobs"] == [None, {9: {"logprob": -1.0, "rank": 1, "decoded_token": "z"},
                                                6: {"logprob": -1.5, "rank": 1, "decoded_token": " b"}}]
    del msg.prompt_logprobs[:]
    assert "prompt_logprobs" not in openai_wire.chat_response(msg, 0)


def test_http_error_shape_and_status():
    status, body = openai_wire.http_error(grpc.StatusCode.INVALID_ARGUMENT, "temperature: must be in [0, 2]")
    assert status == 400
    assert body == {"error": {"message": "temperature: must be in [0, 2]", "type": "invalid_request_error",
                              "param": "temperature", "code": "invalid_argument"}}
    assert openai_wire.http_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")[0] == 429
    assert openai_wire.http_error(grpc.StatusCode.UNAVAILABLE, "x")[0] == 503
    assert openai_wire.http_error(grpc.StatusCode.INTERNAL, "x")[1]["error"]["type"] == "server_error"


def _stream_msg(deltas, usage=None):
    msg = frontend_pb2.GenerateStreamResponse(request_id="r1", model="m")
    for index, text, finish in deltas:
        msg.choices.add(index=index, text=text, finish_reason=finish)
    if usage is not None:
        msg.usage.CopyFrom(common_pb2.Usage(prompt_tokens=4, completion_tokens=2, total_tokens=6))
    return msg


def test_stream_translator_chat_chunks_with_usage_last():
    t = openai_wire.StreamTranslator(chat=True, model="", created=1, include_usage=True)
    first = t.chunks(_stream_msg([(0, "Par", 0)]))
    assert t.usage is None
    last = t.chunks(_stream_msg([(0, "is", common_pb2.FINISH_REASON_STOP)], usage=True))
    assert first[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Par"}
    assert first[0]["usage"] is None and first[0]["id"] == "chatcmpl-r1"
    assert len(last) == 1 and last[0]["choices"][0]["delta"] == {"content": "is"}
    assert last[0]["choices"][0]["finish_reason"] == "stop" and t.usage.total_tokens == 6
    closing = t.usage_chunk(t.usage)  # the caller's, once every request of the call has ended
    assert closing["choices"] == [] and closing["usage"]["total_tokens"] == 6 and closing["id"] == "chatcmpl-r1"


def test_stream_translator_numbers_a_batch_prompts_choices_after_the_earlier_prompts():
    t = openai_wire.StreamTranslator(chat=False, model="m", created=1, include_usage=False, prompt_logprobs=True,
                                     index_offset=4)
    msg = _stream_msg([(0, "x", 0), (1, "y", 0)])
    msg.prompt_logprobs.add(token_id=3, logprob=-1.0, rank=1, text="t")
    out = t.chunks(msg)
    assert [c["choices"][0]["index"] for c in out] == [4, 5]
    assert all(len(c["choices"][0]["prompt_logprobs"]) == 2 for c in out)  # each choice's first chunk


def test_stream_translator_without_usage_has_no_usage_key():
    t = openai_wire.StreamTranslator(chat=False, model="m", created=1, include_usage=False)
    chunks = t.chunks(_stream_msg([(0, "x", common_pb2.FINISH_REASON_LENGTH)], usage=True))
    assert len(chunks) == 1 and "usage" not in chunks[0]
    assert chunks[0]["choices"][0] == {"index": 0, "text": "x", "finish_reason": "length", "logprobs": None}


@pytest.mark.parametrize("chat", [True, False])
def test_stream_translator_sends_prompt_logprobs_once_per_choice_when_complete(chat):
    """Entries come over two messages; choice 1 starts before choice 0 (whose first token marks
    the list complete) and waits; each choice's first chunk has the whole list, later ones none."""
    t = openai_wire.StreamTranslator(chat=chat, model="m", created=1, include_usage=False, prompt_logprobs=True)
    first = _stream_msg([])
    first.prompt_logprobs.append(_lp(6, " b", -1.5))
    assert t.chunks(first) == []
    early = _stream_msg([(1, "A", 0)])
    early.prompt_logprobs.append(_lp(7, "c", -0.5))
    assert t.chunks(early) == []  # choice 0 has not started: the list may be partial
    out = t.chunks(_stream_msg([(0, "B", 0)])) + t.chunks(_stream_msg([(0, "C", 0), (1, "D", 0)], usage=True))
    assert [c["choices"][0]["index"] for c in out] == [1, 0, 0, 1]

    def carried(chunk):
        return chunk.get("prompt_logprobs") if chat else chunk["choices"][0].get("prompt_logprobs")

    expected = [None, {6: {"logprob": -1.5, "rank": 1, "decoded_token": " b"}},
                {7: {"logprob": -0.5, "rank": 1, "decoded_token": "c"}}]
    assert [carried(c) for c in out] == [expected, expected, None, None]
    plain = openai_wire.StreamTranslator(chat=chat, model="m", created=1, include_usage=False)
    assert carried(plain.chunks(_stream_msg([(0, "B", 0)]))[0]) is None


def test_stream_translator_flush_hands_back_held_chunks():
    t = openai_wire.StreamTranslator(chat=True, model="m", created=1, include_usage=False, prompt_logprobs=True)
    assert t.chunks(_stream_msg([(1, "A", 0)])) == []
    held = t.flush()  # the stream ended (an error) before choice 0 started
    assert len(held) == 1 and held[0]["prompt_logprobs"] == [None] and t.flush() == []


def test_bearer_denial_matches_the_grpc_interceptor():
    tokens = ("good",)
    assert bearer_denial((), []) is None
    assert bearer_denial(tokens, [("authorization", "Bearer good")]) is None
    assert bearer_denial(tokens, [("authorization", "Bearer bad")]) == grpc.StatusCode.PERMISSION_DENIED
    assert bearer_denial(tokens, [("x-other", "1")]) == grpc.StatusCode.UNAUTHENTICATED


def test_logit_bias_maps_onto_the_sampling_map():
    req = openai_wire.chat_request({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"42": -100, "7": 2.5}})
    assert dict(req.sampling.logit_bias) == {42: -100.0, 7: 2.5}
    for bad in ({"x": 1}, {"1": "high"}, [1], {str(2**40): 1}):
        with pytest.raises(InvalidRequest) as info:
            completion({"prompt": "x", "logit_bias": bad})
        assert info.value.field == "logit_bias"


def test_priority_and_cache_salt_map_onto_sampling():
    req = completion({"prompt": "x", "priority": -2, "cache_salt": "t1"})
    assert req.sampling.priority == -2 and req.sampling.HasField("priority") and req.sampling.cache_salt == "t1"
    for bad in ({"priority": 2**40}, {"priority": "high"}, {"cache_salt": 5}):
        with pytest.raises(InvalidRequest) as info:
            completion({"prompt": "x", **bad})
        assert info.value.field == next(iter(bad))


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens", "top_k", "min_tokens", "n",
                                   "truncate_prompt_tokens", "logprobs", "priority", "seed"])
def test_integers_wider_than_their_proto_field_are_refused_naming_it(field):
    """JSON integers are unbounded; each goes to an int32 (seed: int64) field, whose setter would
    raise (an HTTP 500 before). Values that fit pass through to the range checks after."""
    bits = 64 if field == "seed" else 32
    for bad in (2 ** (bits - 1), -2 ** (bits - 1) - 1, 2 ** 70):
        with pytest.raises(InvalidRequest) as info:
            completion({"prompt": "x", field: bad})
        assert info.value.field == field and f"{bits}-bit" in str(info.value)
    req = completion({"prompt": "x", field: 2 ** (bits - 1) - 1})
    got = getattr(req, field) if field in ("n", "truncate_prompt_tokens") else getattr(
        req.sampling, "max_tokens" if field == "max_completion_tokens" else field)
    assert got == 2 ** (bits - 1) - 1
    chat = {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2 ** 40}
    with pytest.raises(InvalidRequest) as info:
        openai_wire.chat_request(chat)
    assert info.value.field == "top_logprobs"


def test_token_ids_wider_than_int32_are_refused_naming_the_field():
    for body, field in (({"prompt": [1, 2 ** 40]}, "prompt"), ({"prompt": [-1 - 2 ** 31]}, "prompt"),
                        ({"prompt": "x", "stop_token_ids": [2 ** 31]}, "stop_token_ids")):
        with pytest.raises(InvalidRequest) as info:
            completion(body)
        assert info.value.field == field
