"""Sampling defaults from the model's generation_config.json: what is read, and that a field the
request sets always wins (issue #9, acceptance 3)."""

from __future__ import annotations

import json

import pytest

from tandem.generation_defaults import (
    EMBEDDED_DEFAULTS,
    GenerationConfigError,
    GenerationDefaults,
    load_generation_defaults,
    read_generation_config,
)
from tandem.proto_wire import InvalidRequest, Limits, sampling_from_proto
from tandem.v1 import common_pb2


def _model_dir(tmp_path, **fields):
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, **fields}))
    return tmp_path


def _limits(defaults: GenerationDefaults | None) -> Limits:
    return Limits(vocab_size=1000, max_model_len=512, default_max_tokens=(defaults and defaults.max_tokens) or 64,
                  sampling_defaults=defaults)


def test_explicit_temperature_zero_overrides_a_model_default_of_0_7(tmp_path):
    model = _model_dir(tmp_path, temperature=0.7, top_p=0.8, top_k=20, do_sample=True)
    defaults = load_generation_defaults("auto", str(model), str(model))
    assert defaults.temperature == 0.7
    explicit = sampling_from_proto(common_pb2.SamplingParams(temperature=0.0), _limits(defaults), 5)
    assert explicit.temperature == 0.0 and explicit.greedy
    # the fields it left unset still default (float fields travel as float32, like a client's)
    assert explicit.top_p == pytest.approx(0.8) and explicit.top_k == 20
    unset = sampling_from_proto(common_pb2.SamplingParams(), _limits(defaults), 5)
    assert (unset.temperature, unset.top_p, unset.top_k) == pytest.approx((0.7, 0.8, 20))


def test_every_read_field_and_max_new_tokens(tmp_path):
    model = _model_dir(tmp_path, temperature=0.6, top_p=0.95, top_k=-1, min_p=0.05, repetition_penalty=1.1,
                       max_new_tokens=100)
    d = read_generation_config(model)
    assert (d.temperature, d.top_p, d.top_k, d.min_p, d.repetition_penalty, d.max_tokens) == (
        0.6, 0.95, 0, 0.05, 1.1, 100)
    p = sampling_from_proto(common_pb2.SamplingParams(), _limits(d), 5)
    assert (p.min_p, p.repetition_penalty, p.max_tokens) == pytest.approx((0.05, 1.1, 100))
    assert d.effective(256)["max_tokens"] == d.default_max_tokens(256) == 100
    assert GenerationDefaults().default_max_tokens(256) == GenerationDefaults().effective(256)["max_tokens"] == 256
    # a request's own values win field by field
    p = sampling_from_proto(common_pb2.SamplingParams(top_p=0.5, repetition_penalty=1.0, max_tokens=7),
                            _limits(d), 5)
    assert (p.temperature, p.top_p, p.repetition_penalty, p.max_tokens) == pytest.approx((0.6, 0.5, 1.0, 7))


def test_none_path_and_auto_sources(tmp_path):
    (tmp_path / "m").mkdir()
    model = _model_dir(tmp_path / "m", temperature=0.3)
    assert load_generation_defaults("none", str(model), str(model)).sampling_fields() == {}
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"temperature": 0.9}))
    assert load_generation_defaults(str(other), str(model), str(model)).temperature == 0.9
    # a model without the file has no defaults: requests keep the neutral temperature 1.0
    empty = tmp_path / "empty"
    empty.mkdir()
    d = load_generation_defaults("auto", str(empty), str(empty))
    assert sampling_from_proto(common_pb2.SamplingParams(), _limits(d), 5).temperature == 1.0
    # the embedded model ships its measured defaults (its GGUF file has none)
    embedded = load_generation_defaults("auto", "smollm2-135m-instruct", str(empty))
    assert embedded.sampling_fields() == EMBEDDED_DEFAULTS["smollm2-135m-instruct"]
    assert embedded.effective(256)["source"].startswith("shipped")


@pytest.mark.parametrize("fields,needle", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": 2.5}, "top_k"),
    ({"max_new_tokens": 0}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
])
def test_invalid_values_are_refused_at_load(tmp_path, fields, needle):
    with pytest.raises(GenerationConfigError, match=needle):
        read_generation_config(_model_dir(tmp_path, **fields))


@pytest.mark.parametrize("penalty", [0.001, 0.0099, 100.5, 1000.0])
def test_repetition_penalty_outside_the_request_range_is_refused_at_load(tmp_path, penalty):
    """The defaults and the wire share one range table: a default the wire would refuse (it
    accepted any positive value once) cannot load, so filling it never fails a request."""
    with pytest.raises(GenerationConfigError, match=f"invalid repetition_penalty {penalty}"):
        read_generation_config(_model_dir(tmp_path, repetition_penalty=penalty))
    with pytest.raises(InvalidRequest, match="repetition_penalty"):
        sampling_from_proto(common_pb2.SamplingParams(repetition_penalty=penalty), _limits(None), 5)


@pytest.mark.parametrize("penalty", [0.01, 100.0])
def test_repetition_penalty_bounds_load_and_pass_the_wire_check(tmp_path, penalty):
    d = read_generation_config(_model_dir(tmp_path, repetition_penalty=penalty))
    assert sampling_from_proto(common_pb2.SamplingParams(), _limits(d), 5).repetition_penalty == pytest.approx(penalty)


def test_unreadable_file_names_the_path(tmp_path):
    with pytest.raises(GenerationConfigError, match="cannot read"):
        read_generation_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(GenerationConfigError, match="not valid JSON"):
        read_generation_config(bad)
