"""Issue 21, acceptance 1: the unmodified `openai` Python client against a real `tandem serve
--http-port` (the embedded model, greedy): models, a chat completion that says Paris, the same
streamed with usage at the end, OpenAI-shaped errors, and the bearer token on HTTP."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import openai
import pytest

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TOKEN = "http-test-token"


SERVED = "gateway-model"


@pytest.fixture(scope="module")
def http_serve(launch_serve, get_free_port):
    # One server for the module: HTTP on, a served name, and the engine's metrics with vLLM names.
    port, metrics_port = get_free_port(), get_free_port()
    _, frontend, _ = launch_serve(["--http-port", str(port), "--frontend-workers", "1", "--served-model-name", SERVED,
                                   "--engine-metrics-port", str(metrics_port), "--metrics-names", "vllm"],
                                  env={"TANDEM_AUTH_TOKEN": TOKEN})
    return {"base": f"http://127.0.0.1:{port}", "frontend": frontend, "metrics": f"http://127.0.0.1:{metrics_port}"}


@pytest.fixture(scope="module")
def oai(http_serve):
    with openai.OpenAI(base_url=http_serve["base"] + "/v1", api_key=TOKEN, max_retries=0, timeout=120) as client:
        yield client


def _post(url: str, body: dict, token: str | None = TOKEN) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_lists_the_served_model(oai):
    models = oai.models.list()
    assert [m.id for m in models.data] == [SERVED]
    assert models.data[0].owned_by == "tandem"


def test_chat_completion_says_paris(oai):
    model = oai.models.list().data[0].id
    reply = oai.chat.completions.create(model=model, messages=QUESTION, max_tokens=32, temperature=0)
    choice = reply.choices[0]
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens > 10
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.model == model


def test_streamed_chat_says_paris_with_usage_last(oai):
    model = oai.models.list().data[0].id
    stream = oai.chat.completions.create(model=model, messages=QUESTION, max_tokens=32, temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes in (["stop"], ["length"])
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens > 0 and last.usage.prompt_tokens > 10
    assert all(c.usage is None for c in chunks[:-1])
    # The stream and the unary call are the same greedy generation.
    unary = oai.chat.completions.create(model=model, messages=QUESTION, max_tokens=32, temperature=0)
    assert text == unary.choices[0].message.content
    assert last.usage.completion_tokens == unary.usage.completion_tokens


def test_completion_streams_and_completes(oai):
    model = oai.models.list().data[0].id
    full = oai.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    streamed = "".join(c.choices[0].text for c in oai.completions.create(
        model=model, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True) if c.choices)
    assert full.choices[0].text and streamed == full.choices[0].text
    assert full.usage.completion_tokens <= 8


def test_bad_request_gets_an_openai_error(oai):
    model = oai.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=model, messages=QUESTION, max_tokens=4, temperature=-1.0)
    assert info.value.status_code == 400
    err = info.value.body
    assert err["type"] == "invalid_request_error" and "temperature" in err["message"]
    assert err["param"] == "temperature"
    # An unknown model is 404, as OpenAI and vLLM answer it (a gateway can tell it from a bad field).
    with pytest.raises(openai.NotFoundError) as info:
        oai.chat.completions.create(model="no-such-model", messages=QUESTION, max_tokens=4)
    assert info.value.status_code == 404
    assert info.value.body["param"] == "model" and info.value.body["type"] == "not_found_error"
    assert "no-such-model" in info.value.body["message"]


def test_bearer_token_applies_to_http(http_serve):
    with openai.OpenAI(base_url=http_serve["base"] + "/v1", api_key="wrong-token", max_retries=0) as bad:
        with pytest.raises(openai.PermissionDeniedError):
            bad.models.list()
    status, body = _post(http_serve["base"] + "/v1/completions", {"prompt": "hi"}, token=None)
    assert status == 401 and body["error"]["type"] == "authentication_error"
    with urllib.request.urlopen(http_serve["base"] + "/health", timeout=30) as resp:  # probes need no token
        assert resp.status == 200 and json.loads(resp.read())["status"] == "SERVING"


def test_tokenize_round_trips_without_generating(http_serve):
    status, tok = _post(http_serve["base"] + "/tokenize", {"prompt": "The capital of France"})
    assert status == 200 and tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] > 0
    status, detok = _post(http_serve["base"] + "/detokenize", {"tokens": tok["tokens"]})
    assert status == 200 and detok["prompt"] == "The capital of France"
    status, chat = _post(http_serve["base"] + "/tokenize", {"messages": QUESTION})
    assert status == 200 and chat["count"] > tok["count"]  # the chat template adds its markers
    status, err = _post(http_serve["base"] + "/detokenize", {"tokens": [10 ** 9]})
    assert status == 400 and err["error"]["param"] == "tokens"


def test_typed_control_plane_over_grpc_matches_http(http_serve):
    import grpc

    from tandem.v1 import frontend_pb2, frontend_pb2_grpc

    auth = (("authorization", f"Bearer {TOKEN}"),)
    with grpc.insecure_channel(http_serve["frontend"]) as channel:
        stub = frontend_pb2_grpc.FrontendStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.GetModelInfo(frontend_pb2.GetModelInfoRequest(), timeout=10)  # the token check covers them too
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        model = stub.GetModelInfo(frontend_pb2.GetModelInfoRequest(), metadata=auth, timeout=10)
        assert model.max_context_length > 0 and model.vocab_size >= 49152 and list(model.eos_token_ids)
        assert model.sampling_defaults.HasField("max_tokens") and model.sampling_defaults.HasField("temperature")
        tok = stub.Tokenize(frontend_pb2.TokenizeRequest(prompt="The capital of France"), metadata=auth, timeout=10)
        status, http_tok = _post(http_serve["base"] + "/tokenize", {"prompt": "The capital of France"})
        assert list(tok.token_ids) == http_tok["tokens"] and tok.count == http_tok["count"]
        text = stub.Detokenize(frontend_pb2.DetokenizeRequest(token_ids=tok.token_ids), metadata=auth, timeout=10)
        assert text.text == "The capital of France"
        with pytest.raises(grpc.RpcError) as info:
            stub.Tokenize(frontend_pb2.TokenizeRequest(prompt="x", model="other"), metadata=auth, timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        loads = stub.GetLoads(frontend_pb2.GetLoadsRequest(), metadata=auth, timeout=10)
        server = stub.GetServerInfo(frontend_pb2.GetServerInfoRequest(), metadata=auth, timeout=10)
        assert [r.address for r in loads.replicas] == [e.address for e in server.engines]
        assert all(r.role == "unified" and not r.error and r.kv_blocks_total > 0 for r in loads.replicas)
        assert server.ready and server.engine_transport == "mux" and server.frontend_workers == 1
        from tandem.v1 import common_pb2

        with pytest.raises(grpc.RpcError) as info:  # 8 was SPEC_DECODE_STATS (constant zeros): reserved
            stub.Utility(common_pb2.UtilityRequest(command=8), metadata=auth, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with urllib.request.urlopen(urllib.request.Request(http_serve["base"] + "/v1/models",
                                                       headers={"Authorization": f"Bearer {TOKEN}"})) as resp:
        assert json.loads(resp.read())["data"][0]["id"] == model.served_model_name


def test_engine_metrics_carry_vllm_names_and_the_served_name(oai, http_serve):
    from prometheus_client.parser import text_string_to_metric_families

    oai.completions.create(model=SERVED, prompt="Hello", max_tokens=2)  # at least one finished request
    with urllib.request.urlopen(http_serve["metrics"] + "/metrics", timeout=30) as resp:
        families = {f.name: f for f in text_string_to_metric_families(resp.read().decode())}
    for family in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                   "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds", "vllm:request_success",
                   "vllm:prompt_tokens", "vllm:generation_tokens", "tandem:num_requests_waiting"):
        assert family in families, family
        assert {s.labels["model_name"] for s in families[family].samples} == {SERVED}, family
    assert families["vllm:num_requests_waiting"].type == "gauge"
    finished = sum(s.value for s in families["vllm:request_success"].samples if s.name.endswith("_total"))
    assert finished >= 1
    assert "vllm:lora_requests_info" in families


def test_logit_bias_bans_a_token_over_grpc_and_http(oai, http_serve):
    from tandem.client import TandemClient

    with TandemClient(http_serve["frontend"], token=TOKEN) as client:
        plain = client.chat(QUESTION, max_tokens=16, temperature=0.0).choices[0]
        paris = [t for t in plain.token_ids if "Paris" in client.detokenize([t])]
        assert paris, plain.text  # the greedy answer has a token that spells Paris
        request = {"messages": QUESTION, "max_tokens": 16, "temperature": 0.0}
        banned = client.stub.Generate(_with_bias(paris[0]), metadata=client.metadata, timeout=60).choices[0]
        assert paris[0] not in banned.token_ids and banned.token_ids != plain.token_ids
    reply = oai.chat.completions.create(model=SERVED, **request, logit_bias={str(paris[0]): -100})
    assert reply.choices[0].message.content == banned.text  # the same request over HTTP


def _with_bias(token: int):
    """The greedy capital question as a GenerateRequest whose sampling bans `token`."""
    from tandem.client import build_request

    req = build_request(messages=QUESTION, max_tokens=16, temperature=0.0)
    req.sampling.logit_bias[token] = -100.0
    return req


def test_cache_salts_do_not_share_cached_prompt_blocks(oai):
    system = "You are a careful geography teacher. " * 20  # many full KV blocks, unique to this test
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Capital of Italy?"}]

    def cached(salt: str) -> int:
        reply = oai.chat.completions.create(model=SERVED, messages=messages, max_tokens=1, temperature=0,
                                            extra_body={"cache_salt": salt})
        return reply.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 100  # the same salt reuses the prompt's blocks
    assert cached("tenant-b") == 0  # another salt: the same prompt hits nothing


def test_prompt_logprobs_and_echo_over_http_equal_grpc(oai, http_serve):
    from tandem.client import TandemClient

    prompt = "The quick brown fox jumps over the lazy dog."
    with TandemClient(http_serve["frontend"], token=TOKEN) as client:
        grpc_reply = client.generate(prompt, max_tokens=1, temperature=0.0, prompt_logprobs=2,
                                     return_prompt_token_ids=True)
    ids = list(grpc_reply.prompt_token_ids)
    reply = oai.completions.create(model=SERVED, prompt=prompt, max_tokens=1, temperature=0,
                                   extra_body={"prompt_logprobs": 2})
    _assert_prompt_logprobs(reply.choices[0].model_extra["prompt_logprobs"], grpc_reply)
    # OpenAI's echo with logprobs: the prompt's text and tokens first, their logprobs the prompt's.
    echoed = oai.completions.create(model=SERVED, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=2)
    lps = echoed.choices[0].logprobs
    assert echoed.choices[0].text == prompt + grpc_reply.choices[0].text
    assert len(lps.tokens) == len(ids) + 1 and lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
    assert lps.tokens[1:len(ids)] == [e.text for e in grpc_reply.prompt_logprobs]
    assert lps.token_logprobs[1:len(ids)] == pytest.approx([e.logprob for e in grpc_reply.prompt_logprobs], abs=1e-5)
    assert lps.text_offset[len(ids)] == len(prompt)  # the generated token starts after the echoed prompt
    # Streamed: once per choice, on its first chunk (the choice's), the same values.
    firsts = {}
    for chunk in oai.completions.create(model=SERVED, prompt=prompt, max_tokens=2, temperature=0, n=2, stream=True,
                                        extra_body={"prompt_logprobs": 2}):
        for choice in chunk.choices:
            carried = (choice.model_extra or {}).get("prompt_logprobs")
            assert (carried is not None) == (choice.index not in firsts), choice.index  # first chunk only
            firsts.setdefault(choice.index, carried)
    assert sorted(firsts) == [0, 1]
    for positions in firsts.values():
        _assert_prompt_logprobs(positions, grpc_reply)
    status, error = _post(http_serve["base"] + "/v1/completions",
                          {"model": SERVED, "prompt": prompt, "prompt_logprobs": 21})
    assert status == 400 and "prompt_logprobs" in error["error"]["message"]


def _assert_prompt_logprobs(positions, grpc_reply) -> None:
    """vLLM's `prompt_logprobs` JSON equals the gRPC reply's prompt logprobs for the same prompt."""
    ids = list(grpc_reply.prompt_token_ids)
    assert positions[0] is None and len(positions) == len(ids)  # vLLM's shape: position 0 has none
    for position, token, entry in zip(positions[1:], ids[1:], grpc_reply.prompt_logprobs, strict=True):
        own = position[str(token)]
        # The two choices of an n=2 request are prefilled in one step or in two, as they arrive,
        # and float32 sums over another batch shape differ in the fifth digit (3e-5 seen): enough
        # to swap the token with a neighbour in rank.
        assert own["logprob"] == pytest.approx(entry.logprob, abs=1e-4) and abs(own["rank"] - entry.rank) <= 1
        assert own["decoded_token"] == entry.text
        assert {str(t.token_id) for t in entry.top} <= set(position)  # the top alternatives too


def test_chat_prompt_logprobs_over_the_templated_prompt_equal_grpc(oai, http_serve):
    from tandem.client import TandemClient

    with TandemClient(http_serve["frontend"], token=TOKEN) as client:
        grpc_reply = client.chat(QUESTION, max_tokens=1, temperature=0.0, prompt_logprobs=2,
                                 return_prompt_token_ids=True)
    assert len(grpc_reply.prompt_token_ids) > 10  # the chat template's tokens, not just the question's
    reply = oai.chat.completions.create(model=SERVED, messages=QUESTION, max_tokens=1, temperature=0,
                                        extra_body={"prompt_logprobs": 2})
    _assert_prompt_logprobs(reply.model_extra["prompt_logprobs"], grpc_reply)  # vLLM: top level on chat
    # Streamed: once per choice, on the chunk that starts the choice, the same values.
    firsts = {}
    for chunk in oai.chat.completions.create(model=SERVED, messages=QUESTION, max_tokens=2, temperature=0, n=2,
                                             stream=True, extra_body={"prompt_logprobs": 2}):
        carried = (chunk.model_extra or {}).get("prompt_logprobs")
        index = chunk.choices[0].index
        assert (carried is not None) == (index not in firsts), index
        firsts.setdefault(index, carried)
    assert sorted(firsts) == [0, 1]
    for positions in firsts.values():
        _assert_prompt_logprobs(positions, grpc_reply)
    for bad in (21, -1, "2"):
        status, error = _post(http_serve["base"] + "/v1/chat/completions",
                              {"model": SERVED, "messages": QUESTION, "prompt_logprobs": bad, "stream": True})
        assert status == 400 and error["error"]["param"] == "prompt_logprobs", (bad, error)


def test_a_batch_of_prompts_answers_each_as_its_own_request(oai, http_serve):
    """OpenAI's batch form of /v1/completions (a list of prompts, as evaluation harnesses send):
    prompt i's choice j is choice i * n + j with the text that prompt alone gets, usage summed,
    streamed too; one bad prompt refuses the whole call."""
    prompts = ["The capital of France is", "One, two, three,"]
    alone = [oai.completions.create(model=SERVED, prompt=p, max_tokens=5, temperature=0) for p in prompts]
    batch = oai.completions.create(model=SERVED, prompt=prompts, max_tokens=5, temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone for _ in range(2)]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 4 * 5
    texts: dict[int, str] = {}
    usage = None
    for chunk in oai.completions.create(model=SERVED, prompt=prompts, max_tokens=5, temperature=0, stream=True,
                                        stream_options={"include_usage": True}):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
        usage = chunk.usage or usage
    assert texts == {i: a.choices[0].text for i, a in enumerate(alone)}
    assert usage.completion_tokens == 10 and usage.prompt_tokens == batch.usage.prompt_tokens
    ids = oai.completions.create(model=SERVED, prompt=[[1, 2, 3], [4, 5]], max_tokens=2, temperature=0,
                                 extra_body={"return_token_ids": True})
    assert [c.model_extra["prompt_token_ids"] for c in ids.choices] == [[1, 2, 3], [4, 5]]
    one = oai.completions.create(model=SERVED, prompt=[1, 2, 3], max_tokens=2, temperature=0,
                                 extra_body={"return_token_ids": True})  # on the choice, as vLLM's
    assert one.choices[0].model_extra["prompt_token_ids"] == [1, 2, 3] and "prompt_token_ids" not in one.model_extra
    for stream in (False, True):  # the second prompt is out of the vocabulary: 400, the first one cancelled
        status, error = _post(http_serve["base"] + "/v1/completions",
                              {"model": SERVED, "prompt": ["fine", [10 ** 8]], "max_tokens": 2000, "ignore_eos": True,
                               "stream": stream})
        assert status == 400 and error["error"]["param"] == "prompt_token_ids", error
    # Raw SSE without a model in the body: every chunk names the served model, not "".
    body = {"prompt": prompts, "max_tokens": 3, "temperature": 0, "stream": True}
    req = urllib.request.Request(http_serve["base"] + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        events = [line[6:] for line in resp.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) > 3
    assert {json.loads(e)["model"] for e in events[:-1]} == {SERVED}
    # A client that hangs up mid-stream of a batch: every prompt's request ends too.
    body = {"model": SERVED, "prompt": ["a", "b", "c"], "max_tokens": 2000, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(http_serve["base"] + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.readline().startswith(b"data: ")  # streaming: then the connection closes
    import grpc

    from tandem.v1 import frontend_pb2, frontend_pb2_grpc

    with grpc.insecure_channel(http_serve["frontend"]) as channel:
        stub = frontend_pb2_grpc.FrontendStub(channel)
        deadline = time.monotonic() + 10
        while True:  # the refused and abandoned calls' prompts leave at once (2000 tokens would take minutes)
            loads = stub.GetLoads(frontend_pb2.GetLoadsRequest(), metadata=(("authorization", f"Bearer {TOKEN}"),),
                                  timeout=10)
            busy = sum(r.num_running + r.num_waiting + r.in_flight for r in loads.replicas)
            if busy == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert busy == 0
