"""Issue #10, failures 2, 3, 5 and 6: cheap checks before work, validation that matches the
arithmetic, and documented limits that hold exactly as written. Each test names its failure."""

from __future__ import annotations

import math
import time

import pytest
import torch

from tandem.frontend.request_builder import (
    MAX_KV_TRANSFER_PARAMS_BYTES,
    MAX_STOP_LEN,
    RequestBuilder,
)
from tandem.frontend.tokenizer import TextTokenizer
from tandem.proto_wire import (
    MAX_SEED,
    MAX_STOP_SEQUENCE_LEN,
    TEMPERATURE_EPSILON,
    InvalidRequest,
    Limits,
    sampling_from_proto,
)
from tandem.v1 import common_pb2, frontend_pb2

LIMITS = Limits(vocab_size=49152, max_model_len=8192, default_max_tokens=16, kv_capacity_tokens=1 << 20)


class CountingTokenizer(TextTokenizer):
    """The real tokenizer, counting how many texts it was asked to encode."""

    encoded = 0

    def encode(self, text, add_special_tokens=True):
        CountingTokenizer.encoded += 1
        return super().encode(text, add_special_tokens)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir) -> TextTokenizer:
    base = TextTokenizer.from_pretrained(smollm2_dir)
    tok = CountingTokenizer(base.hf_tokenizer, kind=base.kind, probe_passed=base.probe_passed,
                            extra_eos_token_ids=base.eos_token_ids)
    assert tok.max_token_bytes > 1
    return tok


@pytest.fixture(scope="module")
def builder(tokenizer) -> RequestBuilder:
    return RequestBuilder(tokenizer, LIMITS, "smollm2")


def request(**kw) -> frontend_pb2.GenerateRequest:
    sampling = kw.pop("sampling", {})
    req = frontend_pb2.GenerateRequest(**kw)
    for k, v in sampling.items():
        setattr(req.sampling, k, v)
    return req


def sampling(**kw) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams()
    for k, v in kw.items():
        setattr(msg, k, v)
    return msg


# -- failure 2: unbounded work before validation --------------------------------------------------
def test_oversized_prompt_is_refused_by_bytes_before_tokenizing(builder, tokenizer):
    """Failure 2: a prompt that cannot fit the context is refused by its size, never tokenized."""
    bound = builder.max_prompt_bytes
    assert bound == LIMITS.max_model_len * tokenizer.max_token_bytes < 4 * 1024 * 1024
    before = CountingTokenizer.encoded
    started = time.perf_counter()
    with pytest.raises(InvalidRequest) as err:
        builder.check_request(request(prompt="a" * (bound + 1)))
    assert err.value.field == "prompt" and str(bound) in str(err.value)
    assert time.perf_counter() - started < 0.05
    assert CountingTokenizer.encoded == before
    # Multi-byte text is measured in bytes, not characters.
    with pytest.raises(InvalidRequest, match="prompt"):
        builder.check_request(request(prompt="é" * (bound // 2 + 1)))
    with pytest.raises(InvalidRequest, match="messages"):
        builder.check_request(request(messages=[frontend_pb2.ChatMessage(role="user", content="b" * (bound // 2 + 1))] * 2))
    with pytest.raises(InvalidRequest, match="prompt_token_ids"):
        builder.check_request(request(prompt_token_ids=[1] * LIMITS.max_model_len))
    assert CountingTokenizer.encoded == before


def test_byte_bound_is_an_upper_bound_on_what_fits(builder, tokenizer):
    """Failure 2: the bound never refuses a prompt that would fit: the densest text the
    tokenizer knows (its longest token repeated) still needs fewer tokens than the context."""
    vocab = tokenizer.hf_tokenizer.get_vocab()
    texts = tokenizer.hf_tokenizer.batch_decode([[i] for i in vocab.values()], skip_special_tokens=True)
    densest = max((t for t in texts if t), key=lambda t: len(t.encode()))
    per_token = len(densest.encode())
    assert per_token < tokenizer.max_token_bytes
    reps = builder.max_prompt_bytes // per_token
    text = densest * reps
    builder.check_request(request(prompt=text))  # within the byte bound
    assert len(tokenizer.encode(text)) >= len(text.encode()) / tokenizer.max_token_bytes


# -- failure 3: silent garbage on tiny values ------------------------------------------------------------
@pytest.mark.parametrize("t", [1e-38, 1e-45, TEMPERATURE_EPSILON / 2])
def test_tiny_temperature_is_greedy(t):
    """Failure 3: a temperature below the documented epsilon samples greedily, not token 0."""
    params = sampling_from_proto(sampling(temperature=t), LIMITS, 5)
    assert params.greedy
    assert not sampling_from_proto(sampling(temperature=TEMPERATURE_EPSILON * 2), LIMITS, 5).greedy


def test_tiny_temperature_picks_the_argmax_in_the_sampler():
    """Failure 3: through the real sampler, 1e-38 gives the argmax (before: inf logits, NaN, token 0)."""
    from tandem.engine_service.worker.sampler import Sampler
    from tandem.engine_service.sequence import Sequence

    params = sampling_from_proto(sampling(temperature=1e-38, seed=3), LIMITS, 3)
    seq = Sequence("r", [1, 2, 3], params)
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(0))
    logits[0, 0] = -5.0
    token = Sampler(vocab_size=64).sample(logits, [seq]).token_ids[0]
    assert int(token) == int(logits.argmax())


@pytest.mark.parametrize("value", [1e-40, 1e-3, 1e6, 0.0])
def test_out_of_range_repetition_penalty_is_refused(value):
    """Failure 3: repetition_penalty outside the documented [0.01, 100] is INVALID_ARGUMENT."""
    with pytest.raises(InvalidRequest) as err:
        sampling_from_proto(sampling(repetition_penalty=value), LIMITS, 5)
    assert err.value.field == "repetition_penalty"
    for ok in (0.01, 1.2, 100.0):
        assert sampling_from_proto(sampling(repetition_penalty=ok), LIMITS, 5).repetition_penalty == pytest.approx(ok)


# -- failure 5: seed overflow -----------------------------------------------------------------------------
def test_largest_int64_seed_with_n_2_is_invalid_argument_not_overflow(builder):
    """Failure 5: seed 2^63-1 with n=2 is refused naming `seed` (before: seed + 1 overflowed int64)."""
    with pytest.raises(InvalidRequest) as err:
        req = request(prompt="Hi", n=2, sampling={"seed": 2**63 - 1})
        builder.prepare(req, "x", ["x-0", "x-1"])
    assert err.value.field == "seed"


def test_every_seed_in_range_fits_every_choice(builder):
    """Failure 5: the documented range leaves room for seed + i, i < 16."""
    assert MAX_SEED + 15 == 2**63 - 1
    req = request(prompt="Hi", n=16, sampling={"seed": MAX_SEED})
    prepared = builder.prepare(req, "x", [f"x-{i}" for i in range(16)])
    assert [er.sampling.seed for er in prepared.engine_requests] == [MAX_SEED + i for i in range(16)]


# -- failure 6: documented limits hold as written ---------------------------------------------------------
def test_stop_string_within_limit_with_long_encoding_is_matched_as_text(builder, tokenizer):
    """Failure 6: 100 emoji (within 256 characters) is accepted; its long encoding is not sent to
    the engine (the text match handles it), and no internal field name reaches the client."""
    stop = "🙂" * 100
    assert len(stop) <= MAX_STOP_LEN
    assert len(tokenizer.encode(stop, add_special_tokens=False)) > MAX_STOP_SEQUENCE_LEN
    req = request(prompt="Hi", stop=[stop, "\n\n"])
    builder.check_request(req)
    prepared = builder.prepare(req, "x", ["x"])
    assert prepared.stops == [stop, "\n\n"]
    seqs = [list(s.token_ids) for s in prepared.engine_requests[0].stop_token_sequences]
    assert seqs and all(len(s) <= MAX_STOP_SEQUENCE_LEN for s in seqs)
    assert all(prepared.stop_sequence_owner[i] == 1 for i in range(len(seqs)))  # only "\n\n" hints remain
    # The text match still ends a choice at the emoji stop.
    state = builder.choice_state(prepared, 0)
    from tandem.v1 import engine_pb2

    ids = tokenizer.encode("ok " + stop + " more", add_special_tokens=False)
    delta = state.on_engine(engine_pb2.EngineResponse(token_ids=ids))
    assert state.finished and state.stop_str == stop and delta.text == "ok "


def test_unknown_long_model_name_is_not_echoed_whole(builder):
    """Failure 6: a 100,000-character `model` gets INVALID_ARGUMENT with a short message."""
    with pytest.raises(InvalidRequest) as err:
        builder.check_request(request(prompt="Hi", model="m" * 100_000))
    assert err.value.field == "model"
    assert len(str(err.value)) < 300 and "100000 characters" in str(err.value)


def test_oversized_kv_transfer_params_are_refused_at_the_door(builder):
    """Failure 6: kv_transfer_params above the documented bound are INVALID_ARGUMENT before any
    work (before: the request ran and its echoed reply broke the 16 MiB message limit)."""
    big = request(prompt="Hi")
    big.kv_transfer_params.extra.update({"blob": "x" * (MAX_KV_TRANSFER_PARAMS_BYTES + 1)})
    with pytest.raises(InvalidRequest) as err:
        builder.check_request(big)
    assert err.value.field == "kv_transfer_params"
    small = request(prompt="Hi")
    small.kv_transfer_params.remote_host = "10.0.0.1"
    small.kv_transfer_params.remote_block_ids.extend([1, 2, 3])
    builder.check_request(small)
    bad_port = request(prompt="Hi")
    bad_port.kv_transfer_params.remote_port = 70000
    with pytest.raises(InvalidRequest) as err:
        builder.check_request(bad_port)
    assert err.value.field == "kv_transfer_params.remote_port"
    assert not math.isnan(MAX_KV_TRANSFER_PARAMS_BYTES)
