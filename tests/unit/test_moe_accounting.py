"""The roofline's byte and FLOP counts for mixture-of-experts models (`tandem/bench/accounting.py`).

The decode floor of an MoE model counts only the routed experts a batch is expected to read
(uniform routing: E * (1 - (1 - k/E)^B) distinct experts per sparse layer); parameter counts
are checked against transformers' own model and our built module.
"""

from __future__ import annotations

import pytest
import torch

from tandem.bench import accounting
from tandem.engine_service.dummy_configs import get_dummy_config
from tandem.engine_service.layers.moe import expected_distinct_experts
from tandem.engine_service.worker.loader import build_model, resolve_model


def hf_param_count(cfg: dict) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_cfg)
    return sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "tiny-qwen3-moe"])
def test_param_count_matches_transformers(name: str) -> None:
    cfg = get_dummy_config(name)
    shape = accounting.shape_from_hf_config(cfg)
    assert accounting.total_params(shape) == hf_param_count(cfg)


def test_param_count_matches_the_built_module() -> None:
    model = build_model(resolve_model("dummy:tiny-qwen3-moe"), "cpu", torch.float32)
    shape = accounting.shape_from_hf_config(get_dummy_config("tiny-qwen3-moe"))
    assert accounting.total_params(shape) == sum(p.numel() for p in model.parameters())


def test_qwen3_30b_a3b_decode_bytes_count_active_experts() -> None:
    cfg = get_dummy_config("qwen3-30b-a3b")
    shape = accounting.shape_from_hf_config(cfg)
    h, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads, kv_heads, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    e, k, inter = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    attn = 2 * h * heads * hd + 2 * h * kv_heads * hd
    norms = 2 * h + 2 * hd
    expert = 3 * h * inter

    def expected(batch: int, experts: float) -> int:
        per_layer = attn + e * h + experts * expert + norms  # the router is read in full
        return 2 * (round(layers * per_layer) + h + vocab * h + batch * h)

    assert accounting.decode_weight_bytes(shape, 1, 2) == expected(1, k)
    # About 3.3 B parameters active per token (the model card's "A3B"), embedding row included.
    assert 3.2e9 <= accounting.decode_weight_bytes(shape, 1, 2) / 2 + vocab * h <= 3.5e9
    for batch in (64, 256):
        distinct = e * (1 - (1 - k / e) ** batch)
        assert accounting.decode_weight_bytes(shape, batch, 2) == expected(batch, distinct)
    # Large batches read (nearly) every expert: the whole 30 B model.
    full = accounting.decode_weight_bytes(shape, 4096, 2) / 2
    assert full == pytest.approx(accounting.total_params(shape) - vocab * h + 4096 * h, rel=1e-6)
    assert accounting.decode_experts_read(shape, 1) == pytest.approx(k)
    assert accounting.decode_experts_read(accounting.shape_from_hf_config(get_dummy_config("qwen3-8b")), 1) is None


def test_moe_prefill_flops_run_k_experts_per_token() -> None:
    cfg = get_dummy_config("qwen3-30b-a3b")
    shape = accounting.shape_from_hf_config(cfg)
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads, kv_heads, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    e, k, inter = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    per_token = layers * (2 * h * heads * hd + 2 * h * kv_heads * hd + e * h + k * 3 * h * inter)
    flops = accounting.prefill_flops(shape, [1024] * 4)
    assert flops["linear"] == 2 * per_token * 4096


def test_sparse_layers_and_floor_on_the_tiny_config() -> None:
    """The tiny test model: layer 1 dense (mlp_only_layers), layers 0 and 2 sparse; its floor at
    batch B counts E(1-(1-k/E)^B) experts in each sparse layer and the dense MLP in full."""
    cfg = get_dummy_config("tiny-qwen3-moe")
    shape = accounting.shape_from_hf_config(cfg)
    assert shape.moe.sparse_layers == (True, False, True)
    h, e, k = cfg["hidden_size"], cfg["num_experts"], cfg["num_experts_per_tok"]
    expert = 3 * h * cfg["moe_intermediate_size"]
    b1, b4 = (accounting.decode_weight_bytes(shape, b, 4) for b in (1, 4))
    distinct4 = expected_distinct_experts(e, k, 4)
    # Between batch 1 and 4: 2 sparse layers read (distinct4 - k) more experts, plus 3 embedding rows.
    assert b4 - b1 == 4 * (round(2 * (e * h + distinct4 * expert)) - round(2 * (e * h + k * expert)) + 3 * h)
    bw = 1e12
    assert accounting.decode_floor_s(b4, 0, bw) > accounting.decode_floor_s(b1, 0, bw)


def test_roofline_decode_point_reports_the_moe_floor(monkeypatch) -> None:
    """`bench roofline`'s decode point on the tiny MoE model (CPU; the CUDA timing replaced by a
    stub that runs the fake batch once): weight bytes and floor are the active-expert ones, the
    expected experts per sparse layer are reported, and the fake batch runs through the MoE layers."""
    import numpy as np

    from tandem.bench import roofline
    from tandem.bench.results import BenchRecord, Deadline
    from tandem.engine_service.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from tandem.engine_service.worker.model_runner import ModelRunner

    runner = ModelRunner(EngineConfig(ModelConfig(model="dummy:tiny-qwen3-moe", dtype="float32"),
                                      CacheConfig(block_size=4, num_blocks=64), SchedulerConfig()))
    shape = accounting.shape_from_hf_config(get_dummy_config("tiny-qwen3-moe"))
    ran = []

    def fake_time(runner_, planned, point, aliased, batch, context, step_bytes, *rest):
        ran.append(planned.execute().shape)
        return {**point, "step_bytes": step_bytes}

    monkeypatch.setattr(roofline, "_time_decode", fake_time)
    bandwidth = 1e12
    point = roofline._decode_point(roofline.make_worker(runner), shape, 4, 3, 16, bandwidth,
                                   roofline.RooflineOptions(), Deadline(None), np.random.default_rng(0), 256,
                                   BenchRecord(kind="roofline", model="dummy:tiny-qwen3-moe"))
    assert ran == [(3, 320)]
    assert point["experts_read_per_layer"] == pytest.approx(expected_distinct_experts(8, 2, 3), abs=0.01)
    weight_bytes = accounting.decode_weight_bytes(shape, 3, 4)
    assert point["weight_bytes"] == weight_bytes < accounting.total_params(shape) * 4
    kv = accounting.decode_kv_bytes(shape, 3, 16, 4)
    assert point["floor_ms"] == pytest.approx((weight_bytes + kv) / bandwidth * 1e3)
