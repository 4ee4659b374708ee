"""OpenAI JSON <-> protobuf translation of the HTTP face (`tandem.frontend.openai_wire`) and the
HTTP bearer-token check (`tandem.security.bearer_denial`)."""

from __future__ import annotations

import grpc
import pytest

from tandem.frontend import openai_wire
from tandem.proto_wire import InvalidRequest
from tandem.security import bearer_denial
from tandem.v1 import common_pb2, frontend_pb2


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
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
])
def test_chat_shape_errors_name_their_field(body, field):
    with pytest.raises(InvalidRequest) as info:
        openai_wire.chat_request(body)
    assert info.value.field == field


def test_completion_prompt_forms():
    assert openai_wire.completion_request({"prompt": "hi"}).prompt == "hi"
    assert list(openai_wire.completion_request({"prompt": [1, 2]}).prompt_token_ids) == [1, 2]
    assert openai_wire.completion_request({"prompt": ["one"]}).prompt == "one"
    assert openai_wire.completion_request({"prompt": "x", "logprobs": 0}).sampling.HasField("logprobs")
    for bad in ({"prompt": ["a", "b"]}, {"prompt": 3}, {}, {"prompt": "x", "echo": True}):
        with pytest.raises(InvalidRequest):
            openai_wire.completion_request(bad)


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
    last = t.chunks(_stream_msg([(0, "is", common_pb2.FINISH_REASON_STOP)], usage=True))
    assert first[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Par"}
    assert first[0]["usage"] is None and first[0]["id"] == "chatcmpl-r1"
    assert last[0]["choices"][0]["delta"] == {"content": "is"} and last[0]["choices"][0]["finish_reason"] == "stop"
    assert last[1]["choices"] == [] and last[1]["usage"]["total_tokens"] == 6


def test_stream_translator_without_usage_has_no_usage_key():
    t = openai_wire.StreamTranslator(chat=False, model="m", created=1, include_usage=False)
    chunks = t.chunks(_stream_msg([(0, "x", common_pb2.FINISH_REASON_LENGTH)], usage=True))
    assert len(chunks) == 1 and "usage" not in chunks[0]
    assert chunks[0]["choices"][0] == {"index": 0, "text": "x", "finish_reason": "length", "logprobs": None}


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
            openai_wire.completion_request({"prompt": "x", "logit_bias": bad})
        assert info.value.field == "logit_bias"


def test_priority_and_cache_salt_map_onto_sampling():
    req = openai_wire.completion_request({"prompt": "x", "priority": -2, "cache_salt": "t1"})
    assert req.sampling.priority == -2 and req.sampling.HasField("priority") and req.sampling.cache_salt == "t1"
    for bad in ({"priority": 2**40}, {"priority": "high"}, {"cache_salt": 5}):
        with pytest.raises(InvalidRequest) as info:
            openai_wire.completion_request({"prompt": "x", **bad})
        assert info.value.field == next(iter(bad))
