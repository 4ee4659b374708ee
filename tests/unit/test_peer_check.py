"""The HF peer's verification (`tandem.bench.peer_check`), on CPU in float32.

- on the engine's own weights every layer's teacher-forced mixer and feed-forward and the head agree (and end
  to end), for a hybrid (GDN + gated attention, MoE), a Qwen3-MoE and a dense model;
- one wrong tensor in one HF sub-layer (mixer or feed-forward) fails that sub-layer (teacher
  forcing stops the error from reaching later layers), and fails the verdict;
- the verdict needs end to end only for models without top-k expert routing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.bench.hf_peer import build_hf_model, copy_weights_to_hf
from tandem.bench.peer_check import capture_engine_layers, compare_logits, hf_last_logits, is_routed, \
    teacher_forced_check, verdict
from tandem.bench.roofline import PlannedBatch, fake_plan, make_worker, num_paged_groups, num_state_slots
from tandem.engine_service.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tandem.engine_service.dummy_configs import get_dummy_config


def _engine_and_peer(name: str):
    from tandem.engine_service.worker.model_runner import ModelRunner

    runner = ModelRunner(EngineConfig(
        ModelConfig(model=f"dummy:{name}", device="cpu", dtype="float32", attention_backend="torch", max_model_len=256),
        CacheConfig(block_size=4, num_blocks=32), SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=256)))
    hf = build_hf_model(get_dummy_config(name), "cpu", torch.float32)
    copy_weights_to_hf(runner.model, hf)
    plan, _ = fake_plan(1, 16, 16, runner.block_size, runner.num_blocks, runner.vocab_size, np.random.default_rng(7),
                        num_groups=num_paged_groups(runner), num_state_slots=num_state_slots(runner))
    planned = PlannedBatch(make_worker(runner), plan)
    logits, states = capture_engine_layers(runner.model.model.layers, planned.execute)
    planned.release()
    return runner, hf, plan.new_requests[0].token_ids, logits[0], states


@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-qwen3-moe", "tiny-qwen3"])
def test_same_weights_pass_every_layer_and_end_to_end(name: str, one_torch_thread) -> None:
    runner, hf, prompt, logits, states = _engine_and_peer(name)
    assert len(states) == len(runner.model.model.layers)
    # The captured states are the engine's: its last hidden state through its own head gives its logits.
    last = states[-1]["out"][-1:].to(runner.dtype)
    torch.testing.assert_close(runner.model.compute_logits(runner.model.model.norm(last))[0], logits,
                               atol=1e-4, rtol=0)
    layers = teacher_forced_check(hf, prompt, states, logits, torch.float32)
    assert layers["verified"], layers
    assert layers["min_sublayer_cosine"] > 0.9999 and layers["head"]["same_argmax"]
    mixers = [set(c) - {"mlp"} for c in layers["sublayer_cosine"]]
    assert all(len(m) == 1 and "mlp" in c for m, c in zip(mixers, layers["sublayer_cosine"], strict=True))
    end_to_end = compare_logits(logits, hf_last_logits(hf, prompt), torch.float32)
    assert end_to_end["verified"], end_to_end
    assert verdict(end_to_end, layers, is_routed(get_dummy_config(name)))["verified"]


@pytest.mark.parametrize("name, layer, tensor, sublayer", [
    ("tiny-qwen3-next", 2, "linear_attn.out_proj.weight", "linear_attn"),  # a GDN layer
    ("tiny-qwen3-next", 3, "mlp.experts.down_proj", "mlp"),  # an MoE layer's experts
    ("tiny-qwen3-next", 3, "self_attn.q_proj.weight", "self_attn"),  # gated attention (query and gate rows)
    ("tiny-qwen3-moe", 1, "mlp.down_proj.weight", "mlp"),  # a dense feed-forward between MoE layers
])
def test_one_wrong_tensor_fails_its_sublayer_alone(name: str, layer: int, tensor: str, sublayer: str,
                                                   one_torch_thread) -> None:
    _, hf, prompt, logits, states = _engine_and_peer(name)
    params = dict(hf.named_parameters())
    target = params.get(f"model.layers.{layer}.{tensor}")
    assert target is not None, sorted(k for k in params if k.startswith(f"model.layers.{layer}."))
    with torch.no_grad():
        target.copy_(target.flip(-1))  # the same values, in the wrong columns
    layers = teacher_forced_check(hf, prompt, states, logits, torch.float32)
    cos = layers["sublayer_cosine"]
    assert cos[layer][sublayer] < 0.99, cos
    # Everything before it is untouched, and teacher forcing keeps it from everything after.
    others = [c for i, per in enumerate(cos) for n, c in per.items() if (i, n) != (layer, sublayer)
              and not (i == layer and n == "mlp")]  # the same layer's feed-forward reads its mixer's output
    assert others and min(others) > 0.9999, cos
    assert layers["head"]["verified"]  # the head is fed the engine's last state: unaffected
    assert not layers["verified"]
    end_to_end = compare_logits(logits, hf_last_logits(hf, prompt), torch.float32)
    assert not verdict(end_to_end, layers, routed=True)["verified"]


def test_verdict_requires_end_to_end_only_without_routing() -> None:
    good, bad = {"verified": True}, {"verified": False}
    assert verdict(bad, good, routed=True)["verified"]
    assert not verdict(bad, good, routed=False)["verified"]
    assert not verdict(good, bad, routed=False)["verified"] and not verdict(good, bad, routed=True)["verified"]
    assert verdict(good, good, routed=False)["end_to_end_required"]
    assert is_routed(get_dummy_config("qwen3-next-80b-a3b")) and is_routed(get_dummy_config("tiny-qwen3-moe"))
    assert not is_routed(get_dummy_config("qwen3.5-9b")) and not is_routed(get_dummy_config("tiny-qwen3"))
