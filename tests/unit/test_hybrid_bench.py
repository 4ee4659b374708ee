"""`tandem bench` on hybrid models (Gated DeltaNet + gated attention), on CPU.

- accounting: parameter counts equal the built module's; K/V bytes come from the attention
  layers only; each decode step moves every sequence's state slot twice (read, write back), as
  many bytes as the runner's state pools hold per slot; weight bytes against a hand count;
- the roofline's fake batches give every sequence its own state slot and run prefill and decode
  through the runner (the decode continuing the slot the prefill left equals a fresh prefill);
- the throughput bench's peer: the engine's caches shrink (KV and state), and transformers'
  `generate` over left-padded static batches (continuous batching cannot serve these models)
  gives the engine's greedy tokens on the same weights.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.bench import accounting
from tandem.engine_service.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tandem.engine_service.dummy_configs import get_dummy_config
from tandem.engine_service.layers.backend_select import select_attention_backend
from tandem.engine_service.layers.moe import expected_distinct_experts
from tandem.engine_service.models.registry import get_model_class

TINY_HYBRIDS = ["tiny-qwen3-next", "tiny-qwen3.5", "tiny-qwen3.5-moe"]


def _meta_module(name: str) -> torch.nn.Module:
    cfg = get_dummy_config(name)
    cls = get_model_class(cfg)
    with torch.device("meta"):
        return cls(cls.config_from_hf(cfg), select_attention_backend(torch.device("cpu")))


def _runner(name: str, slots: int = 4, num_blocks: int = 32):
    from tandem.engine_service.worker.model_runner import ModelRunner

    return ModelRunner(EngineConfig(
        ModelConfig(model=f"dummy:{name}", device="cpu", dtype="float32", attention_backend="torch",
                    max_model_len=256),
        CacheConfig(block_size=4, num_blocks=num_blocks),
        SchedulerConfig(max_num_seqs=slots, max_num_batched_tokens=256)))


# -- accounting ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [*TINY_HYBRIDS, "qwen3-next-80b-a3b", "qwen3.5-9b"])
def test_param_count_equals_the_built_module(name: str) -> None:
    shape = accounting.shape_from_hf_config(get_dummy_config(name))
    assert accounting.total_params(shape) == sum(p.numel() for p in _meta_module(name).parameters())


def test_tiny_qwen3_next_param_count_equals_transformers() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = get_dummy_config("tiny-qwen3-next")
    hf_cfg = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_cfg)
    assert accounting.total_params(accounting.shape_from_hf_config(cfg)) == sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize("name", TINY_HYBRIDS)
def test_kv_from_attention_layers_and_state_equal_to_the_pools(name: str) -> None:
    """Layer 3 is the only attention layer: its K/V alone; the state moved per decode step is
    the state pools' per-slot bytes (every GDN layer, conv + recurrent) read and written back."""
    cfg = get_dummy_config(name)
    shape = accounting.shape_from_hf_config(cfg)
    per_layer_token = 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    assert shape.attention_layers == (3,)
    assert accounting.kv_bytes_per_token(shape, 4) == per_layer_token
    assert accounting.decode_kv_bytes(shape, 5, 40, 4) == 5 * 40 * per_layer_token
    assert accounting.attention_windows(shape) == (None,)

    runner = _runner(name)
    (state_group,) = runner.memory_plan.state_groups
    pools = [t for layers in runner.cache_tensors.state.values() for ts in layers.values() for t in ts]
    slot_bytes = sum(t[0].numel() * t.element_size() for t in pools)
    assert state_group.bytes_per_slot == slot_bytes == accounting.state_bytes_per_request(shape, 4) > 0
    for batch in (1, 3, 64):
        assert accounting.decode_state_bytes(shape, batch, 4) == 2 * batch * slot_bytes
    # By hand: 3 GDN layers, conv state [2*2*16 + 4*16, 3] in float32 here, recurrent [4, 16, 16] float32.
    assert slot_bytes == 3 * ((2 * 2 * 16 + 4 * 16) * 3 * 4 + 4 * 16 * 16 * 4)


def test_qwen3_next_decode_bytes_against_a_hand_count() -> None:
    """The 12-layer Qwen3-Next dummy (9 GDN + 3 gated attention layers, MoE everywhere):
    weights read at batch B, K/V of 3 layers, state of 9 — and a floor that grows with B."""
    cfg = get_dummy_config("qwen3-next-80b-a3b")
    shape = accounting.shape_from_hf_config(cfg)
    h, vocab, layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    heads, kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, w = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]
    e, k = cfg["num_experts"], cfg["num_experts_per_tok"]
    conv_dim = 2 * hk * dk + hv * dv
    gdn = h * (2 * hk * dk + 2 * hv * dv) + h * 2 * hv + hv * dv * h + conv_dim * w + 2 * hv + dv
    attn = h * 2 * heads * d + 2 * h * kv * d + heads * d * h + 2 * d  # q_proj twice as wide; q/k norms
    router_shared = e * h + 3 * h * cfg["shared_expert_intermediate_size"] + h
    expert = 3 * h * cfg["moe_intermediate_size"]
    n_attn, n_gdn = layers // 4, layers - layers // 4
    assert (n_attn, n_gdn) == (3, 9) and shape.attention_layers == (3, 7, 11)

    def weights(batch: int) -> int:
        experts = expected_distinct_experts(e, k, batch)
        fixed = n_gdn * gdn + n_attn * attn + layers * (2 * h + router_shared)
        return 2 * (round(fixed + layers * experts * expert) + h + vocab * h + batch * h)

    for batch in (1, 64, 256):
        assert accounting.decode_weight_bytes(shape, batch, 2) == pytest.approx(weights(batch), abs=2)
    # Active experts only: batch 1 reads a fraction of the model.
    assert accounting.decode_weight_bytes(shape, 1, 2) < 0.2 * accounting.total_params(shape) * 2
    assert accounting.decode_kv_bytes(shape, 64, 1024, 2) == 64 * 1024 * n_attn * 2 * kv * d * 2
    state = n_gdn * (conv_dim * (w - 1) * 2 + hv * dk * dv * 4)  # conv state bf16, recurrent float32
    assert accounting.decode_state_bytes(shape, 64, 2) == 2 * 64 * state
    floors = [accounting.decode_floor_s(accounting.decode_weight_bytes(shape, b, 2),
                                        accounting.decode_kv_bytes(shape, b, 1024, 2), 4.0e12,
                                        accounting.decode_state_bytes(shape, b, 2)) for b in (1, 16, 64, 256)]
    assert floors == sorted(floors) and len(set(floors)) == 4


def test_hybrid_prefill_flops_count_attention_layers_and_the_delta_rule() -> None:
    cfg = get_dummy_config("tiny-qwen3.5")  # dense MLP: the matmul count is plain
    shape = accounting.shape_from_hf_config(cfg)
    h, inter, heads, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"], cfg["head_dim"]
    flops = accounting.prefill_flops(shape, [100, 30])
    # Attention: the one full-attention layer only, causal pairs per head.
    assert flops["attention"] == 2 * 2 * heads * d * (100 * 101 // 2 + 30 * 31 // 2)
    matmul = sum(p.numel() for n, p in _meta_module("tiny-qwen3.5").named_parameters()
                 if p.dim() == 2 and "embed_tokens" not in n and "lm_head" not in n)
    assert flops["linear"] == 2 * matmul * 130
    assert matmul == 3 * accounting.layer_counts(shape)[0].mixer_matmul + 4 * 3 * h * inter + (
        accounting.layer_counts(shape)[3].mixer_matmul)
    # The delta rule: per value head, c^2 (3K + 2V) in chunks + 3 K V per token; and the conv.
    g = shape.gdn
    per_seq = [2 * (n * g.conv_dim * g.conv_kernel + g.num_v_heads * (
        (n // 64 * 64 * 64 + (n % 64) ** 2) * (3 * 16 + 2 * 16) + n * 3 * 16 * 16)) for n in (100, 30)]
    assert flops["linear_attention"] == 3 * sum(per_seq)
    assert flops["total"] == flops["linear"] + flops["lm_head"] + flops["attention"] + flops["linear_attention"]


# -- the roofline's fake batches -----------------------------------------------------------------


def test_fake_plan_state_slots_run_prefill_and_decode(one_torch_thread) -> None:
    """Every sequence gets its own slot; a decode continuing the slots a prefill of the first
    L-1 tokens left gives the logits of a fresh prefill of all L tokens."""
    from tandem.bench.roofline import PlannedBatch, StateSlotsExceeded, fake_plan, make_worker, num_paged_groups, \
        num_state_slots

    runner = _runner("tiny-qwen3-next", slots=4)
    assert num_state_slots(runner) == 4 and num_paged_groups(runner) == 1
    worker = make_worker(runner)
    args = (runner.block_size, runner.num_blocks, runner.vocab_size)
    with pytest.raises(StateSlotsExceeded, match="state slots"):
        fake_plan(5, 10, 1, *args, np.random.default_rng(0), num_state_slots=4)
    assert issubclass(StateSlotsExceeded, ValueError)
    n, length = 3, 10
    decode, _ = fake_plan(n, length, 1, *args, np.random.default_rng(0), tag="-d", num_state_slots=4)
    assert [r.state_slot for r in decode.new_requests] == [0, 1, 2]
    assert all(r.num_computed_tokens == length - 1 for r in decode.new_requests)
    no_state, _ = fake_plan(n, length, 1, *args, np.random.default_rng(0))
    assert all(r.state_slot is None for r in no_state.new_requests)

    first, _ = fake_plan(n, length - 1, length - 1, *args, np.random.default_rng(1), tag="-f", num_state_slots=4)
    whole, _ = fake_plan(n, length, length, *args, np.random.default_rng(1), tag="-w", num_state_slots=4)
    for f, d, w in zip(first.new_requests, decode.new_requests, whole.new_requests, strict=True):
        f.token_ids, w.token_ids = d.token_ids[: length - 1], list(d.token_ids)
        assert f.block_ids == d.block_ids == w.block_ids  # 9 and 10 tokens: the same 3 blocks
    for plan in (first,):
        planned = PlannedBatch(worker, plan)
        planned.execute()
        planned.release()
    planned = PlannedBatch(worker, decode)
    stepped = planned.execute()
    planned.release()
    planned = PlannedBatch(worker, whole)
    fresh = planned.execute()
    planned.release()
    assert stepped.shape == (n, runner.vocab_size) and len(worker.rows) == 0
    torch.testing.assert_close(stepped, fresh, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(stepped[0], stepped[1])  # different sequences, different slots


def test_roofline_decode_point_counts_state_and_skips_past_the_slots(monkeypatch, one_torch_thread) -> None:
    from tandem.bench import roofline
    from tandem.bench.results import BenchRecord, Deadline

    runner = _runner("tiny-qwen3-next", slots=4)
    shape = accounting.shape_from_hf_config(get_dummy_config("tiny-qwen3-next"))
    ran = []

    def fake_time(runner_, planned, point, aliased, batch, context, step_bytes, *rest):
        ran.append(planned.execute().shape)
        return {**point, "step_bytes": step_bytes}

    monkeypatch.setattr(roofline, "_time_decode", fake_time)
    worker = roofline.make_worker(runner)
    record = BenchRecord(kind="roofline", model="dummy:tiny-qwen3-next")

    def point(batch: int) -> dict:
        return roofline._decode_point(worker, shape, 4, batch, 16, 1e12, roofline.RooflineOptions(), Deadline(None),
                                      np.random.default_rng(0), 256, record)

    p = point(3)
    assert ran == [(3, 320)] and p["status"] == "ok"
    state = accounting.decode_state_bytes(shape, 3, 4)
    assert p["state_bytes"] == state > 0
    assert p["step_bytes"] == p["weight_bytes"] + p["kv_bytes"] + state
    assert p["floor_ms"] == pytest.approx((p["weight_bytes"] + p["kv_bytes"] + state) / 1e12 * 1e3)
    skipped = point(5)
    assert skipped["status"] == "skipped" and "state slots" in skipped["reason"] and len(ran) == 1


def test_plan_num_blocks_sets_the_state_pool_aside() -> None:
    from tandem.bench.roofline import RooflineOptions, plan_num_blocks

    shape = accounting.shape_from_hf_config(get_dummy_config("qwen3-next-80b-a3b"))
    options = RooflineOptions(batches=[1, 256], contexts=[8192], headroom_gib=0)
    free = 100 << 30
    without = plan_num_blocks(shape, 2, 16, options, free, 32768)
    with_state = plan_num_blocks(shape, 2, 16, options, free, 32768, num_state_slots=256)
    assert with_state["state_pool_bytes"] == 257 * accounting.state_bytes_per_request(shape, 2)
    assert without["fit_blocks"] - with_state["fit_blocks"] == pytest.approx(
        with_state["state_pool_bytes"] / with_state["bytes_per_block"], abs=1)


# -- the throughput bench's HF peer -------------------------------------------------------------


def test_shrink_engine_caches_keeps_every_kind_usable(one_torch_thread) -> None:
    from tandem.bench.roofline import PlannedBatch, fake_plan, make_worker, num_paged_groups, num_state_slots
    from tandem.bench.throughput import shrink_engine_caches

    runner = _runner("tiny-qwen3-next", slots=4, num_blocks=32)
    per_block, per_slot = runner.memory_plan.bytes_per_block, runner.memory_plan.state_groups[0].bytes_per_slot
    assert runner.cache_tensors.total_bytes() == 33 * per_block + 5 * per_slot
    info = shrink_engine_caches(runner, 5, 1)
    assert info["state_slots"] == 1
    assert info["bytes"] == runner.cache_tensors.total_bytes() == 5 * per_block + 2 * per_slot
    kv = runner.kv_caches
    assert [t is None for t in kv] == [True, True, True, False] and kv[3].shape[1] == 5
    assert all(t.shape[0] == 2 for layers in runner.cache_tensors.state.values() for ts in layers.values() for t in ts)
    assert num_state_slots(runner) == 1 and runner.memory_plan.scratch_state_slot == 1
    assert runner.num_blocks == 4
    plan, _ = fake_plan(1, 16, 16, runner.block_size, runner.num_blocks, runner.vocab_size,
                        np.random.default_rng(0), num_groups=num_paged_groups(runner),
                        num_state_slots=num_state_slots(runner))
    planned = PlannedBatch(make_worker(runner), plan)
    assert planned.execute().shape == (1, runner.vocab_size)
    planned.release()


def test_static_batch_peer_matches_the_engine_greedy_tokens(one_torch_thread) -> None:
    """Continuous batching refuses the hybrid (the reason is recorded); left-padded static
    `generate` batches on the engine's weights give the engine's greedy tokens, float32."""
    from tandem.bench.hf_peer import build_hf_model, cb_unsupported_reason, copy_weights_to_hf, run_static_batches, \
        static_batches
    from tandem.bench.results import Deadline
    from tandem.bench.workloads import BenchRequest
    from tandem.engine_service.core.engine import LLMEngine
    from tandem.engine_service.sequence import SamplingParams

    engine = LLMEngine(EngineConfig(
        ModelConfig(model="dummy:tiny-qwen3-next", device="cpu", dtype="float32", attention_backend="torch",
                    max_model_len=256),
        CacheConfig(block_size=4, num_blocks=64), SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256)))
    prompts = [[5, 17, 33, 90, 101, 7, 250, 3, 44], list(range(11, 26)) + [300, 200], [77, 3]]
    lengths = [8, 5, 8]
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    ours: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    while engine.has_work():
        for o in engine.step():
            ours[o.request_id].extend(o.new_token_ids)
    hf = build_hf_model(get_dummy_config("tiny-qwen3-next"), "cpu", torch.float32)
    copy_weights_to_hf(engine.runner.model, hf)
    assert "linear_attention" in cb_unsupported_reason(hf)

    requests = [BenchRequest(prompt_token_ids=p, output_len=n) for p, n in zip(prompts, lengths, strict=True)]
    assert static_batches(requests, 2) == [[1, 2], [0]]  # by output length, then prompt length
    got = run_static_batches(hf, requests, Deadline(None), batch_size=3, collect_tokens=True)
    assert got["completed"] == 3 and not got["timed_out"] and got["num_batches"] == 1
    assert got["output_tokens"] == sum(lengths) and got["input_tokens"] == sum(map(len, prompts))
    assert got["discarded_tokens"] == 3 * 8 - sum(lengths) and got["requests_not_at_target_length"] == 0
    assert got["tokens"] == [ours[f"r{i}"] for i in range(3)]
    assert len({t for toks in ours.values() for t in toks}) > 5  # not a degenerate model


def test_peer_mode_follows_what_continuous_batching_serves(monkeypatch) -> None:
    from tandem.bench import hf_peer
    from tandem.bench.results import Deadline

    hybrid = hf_peer.build_hf_model(get_dummy_config("tiny-qwen3-next"), "meta", torch.float32)
    dense = hf_peer.build_hf_model(get_dummy_config("tiny-qwen3"), "meta", torch.float32)
    assert "['linear_attention'] have no continuous-batching cache" in hf_peer.cb_unsupported_reason(hybrid)
    assert hf_peer.cb_unsupported_reason(dense) is None
    # Also where transformers' own grouping would accept the layer type (5.17 does, then fails later).
    monkeypatch.setattr("transformers.generation.continuous_batching.cache.group_layers_by_attn_type",
                        lambda config: None, raising=False)
    assert "linear_attention" in hf_peer.cb_unsupported_reason(hybrid)
    assert hf_peer.cb_unsupported_reason(dense) is None
    calls = []
    monkeypatch.setattr(hf_peer, "run_static_batches", lambda *a, **k: calls.append("static") or {"completed": 0})
    monkeypatch.setattr(hf_peer, "_run_continuous_batching", lambda *a, **k: calls.append("cb") or {"completed": 0})
    got = hf_peer.run_hf_peer(hybrid, [], Deadline(None))
    assert got["mode"] == "generate_static_batches" and "linear_attention" in got["mode_reason"]
    assert hf_peer.run_hf_peer(dense, [], Deadline(None))["mode"] == "continuous_batching"
    assert calls == ["static", "cb"]
