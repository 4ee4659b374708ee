"""`tandem.proto_wire`'s request validation at every documented bound (docs/api.md), with the whole
message a client sees. Found by mutation testing (docs/testing.md): the limits are written here
as literal numbers, as documented, so a changed constant in the code fails too."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest

from tandem.core_protocol import FinishReason, KVTransferParams, SamplingParams
from tandem.proto_wire import (
    FINISH_TO_PROTO,
    InvalidRequest,
    Limits,
    check_prompt_token_ids,
    kv_transfer_from_proto,
    sampling_from_proto,
)
from tandem.v1 import common_pb2

VOCAB = 1000
LIMITS = Limits(vocab_size=VOCAB, max_model_len=4096, default_max_tokens=100)


def sampling(**kw) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams()
    for k, v in kw.items():
        if isinstance(v, list):
            getattr(msg, k).extend(v)
        else:
            setattr(msg, k, v)
    return msg


def refused(msg: common_pb2.SamplingParams, limits: Limits = LIMITS, prompt: int = 10,
            sequences: list[list[int]] | None = None) -> str:
    """The whole message of the InvalidRequest that validation raises; checks its field too."""
    with pytest.raises(InvalidRequest) as err:
        sampling_from_proto(msg, limits, prompt, sequences)
    field = str(err.value).split(":", 1)[0]
    assert err.value.field == field
    return str(err.value)


def accepted(msg: common_pb2.SamplingParams, limits: Limits = LIMITS, prompt: int = 10,
             sequences: list[list[int]] | None = None) -> SamplingParams:
    return sampling_from_proto(msg, limits, prompt, sequences)


def test_invalid_request_names_its_field():
    err = InvalidRequest("top_p", "must be in (0, 1]")
    assert isinstance(err, ValueError)
    assert str(err) == "top_p: must be in (0, 1]" and err.field == "top_p"


def test_limits_defaults():
    limits = Limits(vocab_size=10, max_model_len=20)
    assert limits.default_max_tokens == 256
    assert limits.kv_capacity_tokens is None and limits.sampling_defaults is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        limits.max_model_len = 30  # type: ignore[misc]  # shared by every request: immutable


def test_empty_message_gives_the_engine_defaults():
    p = accepted(sampling())
    assert p == SamplingParams(max_tokens=100)


def test_prompt_length_bounds():
    assert refused(sampling(), prompt=0) == "prompt: must not be empty"
    assert accepted(sampling(), prompt=1).max_tokens == 100  # one token is a prompt
    assert refused(sampling(), prompt=4096) == "prompt: 4096 tokens leave no room in the context of 4096"
    assert accepted(sampling(), prompt=4095).max_tokens == 1  # the default is capped by the room


def test_max_tokens_bounds():
    assert refused(sampling(max_tokens=0)) == "max_tokens: must be >= 1"
    assert accepted(sampling(max_tokens=1)).max_tokens == 1
    assert accepted(sampling(max_tokens=4086)).max_tokens == 4086
    assert refused(sampling(max_tokens=4087)) == (
        "max_tokens: prompt (10) + max_tokens (4087) exceeds the context length 4096")
    assert accepted(sampling(), prompt=4000).max_tokens == 96
    assert accepted(sampling(), prompt=3996).max_tokens == 100


def test_kv_capacity_bound():
    limits = Limits(vocab_size=VOCAB, max_model_len=4096, default_max_tokens=100, kv_capacity_tokens=500)
    assert accepted(sampling(max_tokens=490), limits).max_tokens == 490
    assert refused(sampling(max_tokens=491), limits) == (
        "max_tokens: prompt + max_tokens (501) exceeds the KV cache capacity of this engine (500 tokens)")
    assert refused(sampling(), limits, prompt=401) == (
        "max_tokens: prompt + max_tokens (501) exceeds the KV cache capacity of this engine (500 tokens)")


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "repetition_penalty",
                                   "presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_floats_are_refused(field, value):
    assert refused(sampling(**{field: value})) == f"{field}: must be a finite number"


def test_temperature_bounds():
    assert refused(sampling(temperature=-1e-7)) == "temperature: must be >= 0"
    assert accepted(sampling(temperature=0.0)).temperature == 0.0
    assert accepted(sampling(temperature=9e-6)).temperature == 0.0  # below 1e-5: greedy
    kept = accepted(sampling(temperature=2e-5)).temperature
    assert kept == pytest.approx(2e-5) and kept > 0
    assert accepted(sampling(temperature=1.5)).temperature == 1.5


def test_top_p_bounds():
    assert refused(sampling(top_p=0.0)) == "top_p: must be in (0, 1]"
    assert refused(sampling(top_p=1.0000001)) == "top_p: must be in (0, 1]"
    assert refused(sampling(top_p=-0.5)) == "top_p: must be in (0, 1]"
    assert accepted(sampling(top_p=1.0)).top_p == 1.0
    assert accepted(sampling(top_p=0.5)).top_p == 0.5


def test_top_k_bounds():
    assert refused(sampling(top_k=-2)) == "top_k: must be -1, 0 (off) or a positive count"
    assert accepted(sampling(top_k=-1)).top_k == 0
    assert accepted(sampling(top_k=0)).top_k == 0
    assert accepted(sampling(top_k=1)).top_k == 1
    assert accepted(sampling(top_k=50)).top_k == 50


def test_min_p_bounds():
    assert refused(sampling(min_p=-0.001)) == "min_p: must be in [0, 1]"
    assert refused(sampling(min_p=1.001)) == "min_p: must be in [0, 1]"
    assert accepted(sampling(min_p=0.0)).min_p == 0.0
    assert accepted(sampling(min_p=1.0)).min_p == 1.0
    assert accepted(sampling(min_p=0.25)).min_p == 0.25


def test_seed_bounds():
    message = "seed: must be in [0, 9223372036854775792] (2^63 - 16)"
    assert refused(sampling(seed=-1)) == message
    assert refused(sampling(seed=2**63 - 15)) == message
    assert accepted(sampling(seed=0)).seed == 0
    assert accepted(sampling(seed=2**63 - 16)).seed == 2**63 - 16
    assert accepted(sampling()).seed is None


def test_stop_token_ids_bounds():
    assert refused(sampling(stop_token_ids=[1] * 65)) == "stop_token_ids: at most 64 entries"
    assert accepted(sampling(stop_token_ids=list(range(64)))).stop_token_ids == list(range(64))
    assert accepted(sampling(stop_token_ids=[0, 999])).stop_token_ids == [0, 999]
    assert refused(sampling(stop_token_ids=[1000])) == (
        "stop_token_ids: token id 1000 is outside the vocabulary [0, 1000)")
    assert refused(sampling(stop_token_ids=[-1])) == (
        "stop_token_ids: token id -1 is outside the vocabulary [0, 1000)")


def test_ignore_eos_is_taken_as_sent():
    assert accepted(sampling(ignore_eos=True)).ignore_eos is True
    assert accepted(sampling(ignore_eos=False)).ignore_eos is False
    assert accepted(sampling()).ignore_eos is False


def test_logprobs_bounds():
    assert refused(sampling(logprobs=-1)) == "logprobs: must be in [0, 20]"
    assert refused(sampling(logprobs=21)) == "logprobs: must be in [0, 20]"
    assert accepted(sampling(logprobs=0)).logprobs == 0
    assert accepted(sampling(logprobs=20)).logprobs == 20
    assert accepted(sampling()).logprobs is None


def test_repetition_penalty_bounds():
    message = "repetition_penalty: must be in [0.01, 100.0]"
    assert refused(sampling(repetition_penalty=0.0099)) == message
    assert refused(sampling(repetition_penalty=100.01)) == message
    assert accepted(sampling(repetition_penalty=0.01)).repetition_penalty == pytest.approx(0.01)
    assert accepted(sampling(repetition_penalty=100.0)).repetition_penalty == 100.0
    assert accepted(sampling(repetition_penalty=1.5)).repetition_penalty == 1.5


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
def test_presence_and_frequency_penalty_bounds(field):
    assert refused(sampling(**{field: -2.01})) == f"{field}: must be in [-2, 2]"
    assert refused(sampling(**{field: 2.01})) == f"{field}: must be in [-2, 2]"
    for value in (-2.0, 2.0, 0.5):
        p = accepted(sampling(**{field: value}))
        assert getattr(p, field) == value
        other = "frequency_penalty" if field == "presence_penalty" else "presence_penalty"
        assert getattr(p, other) == 0.0


def test_min_tokens_bounds():
    assert refused(sampling(max_tokens=5, min_tokens=-1)) == "min_tokens: must be in [0, max_tokens]"
    assert refused(sampling(max_tokens=5, min_tokens=6)) == "min_tokens: must be in [0, max_tokens]"
    assert accepted(sampling(max_tokens=5, min_tokens=5)).min_tokens == 5
    assert accepted(sampling(max_tokens=5, min_tokens=0)).min_tokens == 0
    assert accepted(sampling(min_tokens=100)).min_tokens == 100  # against the default max_tokens


def test_stop_token_sequences_bounds():
    assert refused(sampling(), sequences=[[1]] * 65) == "stop_token_sequences: at most 64 sequences"
    assert accepted(sampling(), sequences=[[1]] * 64).stop_token_sequences == [[1]] * 64
    message = "stop_token_sequences: each needs 1..64 tokens"
    assert refused(sampling(), sequences=[[]]) == message
    assert refused(sampling(), sequences=[[1] * 65]) == message
    assert accepted(sampling(), sequences=[[1] * 64]).stop_token_sequences == [[1] * 64]
    assert refused(sampling(), sequences=[[1, 1000]]) == (
        "stop_token_sequences: token id 1000 is outside the vocabulary [0, 1000)")
    seqs = [[5, 6], [999]]
    p = accepted(sampling(), sequences=seqs)
    assert p.stop_token_sequences == seqs and p.stop_token_sequences[0] is not seqs[0]
    assert accepted(sampling()).stop_token_sequences == []


def test_sampling_defaults_fill_unset_fields_before_validation():
    class Defaults:
        def fill(self, msg):
            filled = common_pb2.SamplingParams()
            filled.CopyFrom(msg)
            if not filled.HasField("temperature"):
                filled.temperature = 0.25
            return filled

    limits = Limits(vocab_size=VOCAB, max_model_len=4096, sampling_defaults=Defaults())
    assert accepted(sampling(), limits).temperature == 0.25
    assert accepted(sampling(temperature=0.75), limits).temperature == 0.75


def test_prompt_token_ids_bounds():
    assert check_prompt_token_ids("prompt_token_ids", (0, 999), VOCAB) == [0, 999]
    with pytest.raises(InvalidRequest) as err:
        check_prompt_token_ids("prompt_token_ids", [], VOCAB)
    assert str(err.value) == "prompt_token_ids: must not be empty"
    with pytest.raises(InvalidRequest) as err:
        check_prompt_token_ids("prompt_token_ids", [3, 1000], VOCAB)
    assert str(err.value) == "prompt_token_ids: token id 1000 is outside the vocabulary [0, 1000)"


def test_kv_transfer_params_from_the_typed_message():
    good = common_pb2.KVTransferParams(do_remote_decode=True, remote_block_ids=[1, 2])
    assert kv_transfer_from_proto(good) == KVTransferParams(do_remote_decode=True, remote_block_ids=[1, 2])
    with pytest.raises(InvalidRequest) as err:
        kv_transfer_from_proto(common_pb2.KVTransferParams(block_size=0))
    assert err.value.field == "kv_transfer_params.block_size"
    assert str(err.value) == "kv_transfer_params.block_size: must be >= 1"


def test_finish_reasons_map_to_the_wire():
    assert FINISH_TO_PROTO == {
        None: common_pb2.FINISH_REASON_UNSPECIFIED,
        FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
        FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
        FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
        FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR,
    }


def test_logit_bias_bounds():
    def biased(entries: dict) -> common_pb2.SamplingParams:
        msg = common_pb2.SamplingParams()
        for token, value in entries.items():
            msg.logit_bias[token] = value
        return msg

    assert accepted(biased({0: -100.0, VOCAB - 1: 100.0})).logit_bias == {0: -100.0, VOCAB - 1: 100.0}
    assert accepted(sampling()).logit_bias == {}
    assert refused(biased({VOCAB: 1.0})) == f"logit_bias: token id {VOCAB} is outside the vocabulary [0, {VOCAB})"
    assert refused(biased({-1: 1.0})) == f"logit_bias: token id -1 is outside the vocabulary [0, {VOCAB})"
    assert refused(biased({3: 100.5})) == "logit_bias: the bias of token 3 must be in [-100, 100]"
    assert refused(biased({3: math.nan})) == "logit_bias: the bias of token 3 must be in [-100, 100]"
    big = Limits(vocab_size=5000, max_model_len=4096, default_max_tokens=100)
    assert len(accepted(biased({i: 1.0 for i in range(1024)}), limits=big).logit_bias) == 1024
    assert refused(biased({i: 1.0 for i in range(1025)}), limits=big) == "logit_bias: at most 1024 entries"


def test_cache_salt_bound():
    assert accepted(sampling(cache_salt="tenant-a")).cache_salt == "tenant-a"
    assert accepted(sampling()).cache_salt == ""
    assert accepted(sampling(cache_salt="é" * 128)).cache_salt == "é" * 128  # 256 bytes
    assert refused(sampling(cache_salt="é" * 128 + "x")) == "cache_salt: at most 256 bytes"


def test_priority_passes_through():
    assert accepted(sampling(priority=-3)).priority == -3
    assert accepted(sampling()).priority == 0


def test_structured_output_oneof_checked_to_compile():
    from tandem.core_protocol import StructuredOutputKind
    from tandem.proto_wire import with_constrained_prompt_tokens

    assert accepted(sampling()).structured_output is None
    so = accepted(sampling(regex="[0-9]{3}")).structured_output
    assert (so.kind, so.spec, so.num_constrained_prompt_tokens) == (StructuredOutputKind.REGEX, "[0-9]{3}", 0)
    assert accepted(sampling(json_schema='{"type": "object"}')).structured_output.kind == StructuredOutputKind.JSON_SCHEMA
    assert accepted(sampling(grammar='start: "a" | "b"')).structured_output.kind == StructuredOutputKind.GRAMMAR
    assert accepted(sampling(json_object=True)).structured_output.kind == StructuredOutputKind.JSON_OBJECT
    assert refused(sampling(json_object=False)).startswith("structured_output.json_object: only true is valid")
    assert refused(sampling(regex="")) == "structured_output.regex: must not be empty"
    assert refused(sampling(json_schema="[1")).startswith("structured_output.json_schema: not valid JSON")
    assert refused(sampling(json_schema="3")) == "structured_output.json_schema: a JSON Schema is an object (or true/false)"
    assert "unknown name" in refused(sampling(grammar="start: foo"))
    assert refused(sampling(regex="a" * (64 * 1024 + 1))) == "structured_output.regex: at most 65536 bytes"
    params = accepted(sampling(regex="[0-9]+"))
    assert with_constrained_prompt_tokens(params, 1, 10).structured_output.num_constrained_prompt_tokens == 1
    for n, prompt, message in ((1, 1, "must be in [0, 1)"), (10, 10, "must be in [0, 10)")):
        with pytest.raises(InvalidRequest, match=re.escape(message)):
            with_constrained_prompt_tokens(params, n, prompt)
    with pytest.raises(InvalidRequest, match="needs sampling.structured_output"):
        with_constrained_prompt_tokens(accepted(sampling()), 1, 10)
