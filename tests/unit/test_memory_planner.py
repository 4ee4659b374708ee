"""Cache sizing per group: block arithmetic, CPU and GPU budgets, overrides, state groups first,
sliding-window caps, layout invariants."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tandem.engine_service.config import CacheConfig
from tandem.engine_service.dummy_configs import get_dummy_config
from tandem.engine_service.cache.cache_spec import (
    CacheGroup,
    CacheLayout,
    FullAttentionSpec,
    SlidingWindowSpec,
    StateSpec,
    attention_layout,
)
from tandem.engine_service.cache.memory_plan import (
    estimate_activation_bytes,
    full_attention_layout,
    kv_bytes_per_block,
    plan_cache,
)
from tandem.engine_service.models.registry import get_model_class


@dataclass
class Shape:
    num_hidden_layers: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64


def arch(name: str):
    config = get_dummy_config(name)
    return get_model_class(config).config_from_hf(config)


def test_qwen3_8b_kv_bytes_match_published_per_token_size() -> None:
    # Qwen3-8B in bf16 keeps 144 KiB of K/V per token (36 layers x 8 KV heads x 128 x 2 x 2 B).
    assert kv_bytes_per_block(arch("qwen3-8b"), 16, torch.bfloat16) == 16 * 144 * 1024
    assert kv_bytes_per_block(arch("qwen3-8b"), 32, torch.float32) == 32 * 2 * 144 * 1024


def test_block_bytes_formula() -> None:
    s = Shape(num_hidden_layers=3, num_key_value_heads=5, head_dim=7)
    assert kv_bytes_per_block(s, 8, torch.float16) == 2 * 3 * 8 * 5 * 7 * 2


def plan(shape, cache: CacheConfig, device="cpu", dtype=torch.float32, layout=None, **kw):
    layout = layout or full_attention_layout(shape, dtype)
    kw = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 256} | kw
    return plan_cache(layout, cache, device, **kw)


def test_cpu_budget_and_override() -> None:
    per_block = 2 * 4 * 16 * 2 * 64 * 4
    p = plan(Shape(), CacheConfig(cpu_kv_cache_bytes=10 * per_block + per_block - 1))
    assert (p.num_blocks, p.bytes_per_block, p.kv_cache_bytes) == (10, per_block, 10 * per_block)
    assert [g.name for g in p.groups] == ["full_attention"]
    fixed = plan(Shape(), CacheConfig(num_blocks=3, cpu_kv_cache_bytes=1))
    assert fixed.num_blocks == 3


def state_layout(conv_shape=(6, 3), ssm_shape=(2, 8, 8)) -> CacheLayout:
    """Two full-attention layers and two recurrent layers with a conv and an ssm state each."""
    return CacheLayout((
        CacheGroup("full_attention", FullAttentionSpec(2, 64, "bfloat16"), (0, 2)),
        CacheGroup("linear_state", StateSpec((conv_shape, ssm_shape), ("bfloat16", "float32")), (1, 3)),
    ))


def test_state_groups_are_reserved_before_blocks() -> None:
    layout = state_layout()
    per_block = layout.groups[0].bytes_per_block(16)
    per_slot = 2 * (6 * 3 * 2 + 2 * 8 * 8 * 4)  # two layers: bf16 conv + fp32 ssm state
    assert layout.groups[1].bytes_per_slot() == per_slot
    budget = 100 * per_block
    # No state checkpoints here (their sizing: tests/unit/test_hybrid_prefix_cache.py).
    p = plan(Shape(), CacheConfig(cpu_kv_cache_bytes=budget, state_checkpoint_memory_fraction=0.0), layout=layout,
             max_num_seqs=8)
    state = p.state_groups[0]
    assert (state.num_slots, state.bytes_per_slot, p.num_state_slots) == (8, per_slot, 8)
    assert p.state_bytes == 8 * per_slot
    assert p.num_blocks == (budget - 8 * per_slot) // per_block
    assert [g["name"] for g in p.as_dict()["groups"]] == ["full_attention", "linear_state"]


def test_sliding_group_is_capped_and_the_rest_goes_to_full_layers() -> None:
    windows = (None, 64, None, 64)  # Qwen3-style alternating layers
    layout = attention_layout(windows, 2, 64, "float32")
    full, sliding = layout.groups
    assert (full.layer_ids, sliding.layer_ids, sliding.sliding_window) == ((0, 2), (1, 3), 64)
    per_block = full.bytes_per_block(16)  # both groups have two layers of the same shape
    budget = 1000 * per_block
    p = plan(Shape(), CacheConfig(cpu_kv_cache_bytes=budget), layout=layout,
             max_num_seqs=4, max_num_batched_tokens=64, max_model_len=4096)
    cap = 4 * (-(-63 // 16) + 2) + 64 // 16  # live window blocks per request, plus one step's chunk
    got = {g.name: g.num_blocks for g in p.groups}
    assert got["sliding_window_64"] == cap == 28
    assert got["full_attention"] == (budget - cap * per_block) // per_block
    # Every paged group windowed (Mistral): the budget is split evenly, nothing capped.
    all_sliding = attention_layout((64,) * 4, 2, 64, "float32")
    q = plan(Shape(), CacheConfig(cpu_kv_cache_bytes=budget), layout=all_sliding, max_model_len=4096)
    assert q.num_blocks == 500 and len(q.groups) == 1


def test_layout_invariants() -> None:
    spec = FullAttentionSpec(2, 64, "float32")
    with pytest.raises(ValueError, match="unique"):
        CacheLayout((CacheGroup("a", spec, (0,)), CacheGroup("a", spec, (1,))))
    with pytest.raises(ValueError, match="two paged"):
        CacheLayout((CacheGroup("a", spec, (0, 1)), CacheGroup("b", spec, (1,))))
    with pytest.raises(ValueError, match="no layer"):
        CacheGroup("a", spec, ())
    with pytest.raises(ValueError, match="sliding_window"):
        SlidingWindowSpec(2, 64, "float32", sliding_window=0)
    with pytest.raises(ValueError):
        StateSpec(((2, 2),), ())


def test_gpu_budget_is_fraction_of_free_memory_minus_reservations(monkeypatch) -> None:
    free = 10 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * 2**30))
    layout = state_layout()
    per_block = layout.groups[0].bytes_per_block(16)
    cache = CacheConfig(memory_fraction=0.5, cpu_kv_cache_bytes=1)  # the CPU budget must not matter
    p = plan(Shape(), cache, torch.device("cuda", 0), layout=layout, reserved_bytes=2**29, max_num_seqs=4)
    per_slot = layout.groups[1].bytes_per_slot()
    left = free // 2 - 4 * per_slot - 2**29
    checkpoints = int(left * cache.state_checkpoint_memory_fraction) // per_slot  # state checkpoints' share
    assert p.num_checkpoint_slots == checkpoints > 0
    assert p.num_blocks == (left - checkpoints * per_slot) // per_block


def test_not_enough_memory_is_an_error() -> None:
    per_block = kv_bytes_per_block(Shape(), 16, torch.float32)
    with pytest.raises(ValueError, match="not enough memory"):
        plan(Shape(), CacheConfig(cpu_kv_cache_bytes=per_block))
    big = state_layout(ssm_shape=(64, 128, 128))
    with pytest.raises(ValueError, match="not enough memory"):
        plan(Shape(), CacheConfig(cpu_kv_cache_bytes=100 * per_block), layout=big, max_num_seqs=64)


def test_activation_estimate_grows_with_the_step_budget() -> None:
    a = arch("qwen3-8b")
    args = (a.hidden_size, a.intermediate_size, a.num_attention_heads, a.head_dim, a.vocab_size)
    small = estimate_activation_bytes(*args, 256, 16, torch.bfloat16)
    large = estimate_activation_bytes(*args, 8192, 16, torch.bfloat16)
    # At least the bf16 MLP intermediates of one full step must fit; bounded so it leaves the
    # cache most of an H200 (a few GiB at most for an 8k-token step).
    assert large > 8192 * 2 * a.intermediate_size * 2 > small
    assert large < 4 * 2**30


def test_latent_group_gets_the_full_groups_block_count_and_its_own_entry_size() -> None:
    from tandem.engine_service.cache.cache_spec import LatentSpec
    from tandem.engine_service.cache.cache_tensors import allocate_cache_tensors

    layout = CacheLayout((
        CacheGroup("full_attention", FullAttentionSpec(2, 16, "float32"), (0,)),
        CacheGroup("compressed", LatentSpec(40, "bfloat16"), (1, 2)),
    ))
    full_block = 16 * 2 * 2 * 16 * 4  # one layer, K and V
    latent_block = 2 * 16 * 40 * 2  # two layers of 40 bf16 elements per token
    assert layout.groups[1].bytes_per_block(16) == latent_block
    budget = 50 * (full_block + latent_block) + 7
    p = plan(Shape(), CacheConfig(cpu_kv_cache_bytes=budget), layout=layout)
    assert [g.num_blocks for g in p.groups] == [50, 50]
    assert p.kv_cache_bytes == 50 * (full_block + latent_block)
    tensors = allocate_cache_tensors(layout, p, num_layers=3, device=torch.device("cpu"))
    assert tensors.kv_caches[0].shape == (2, 51, 16, 2, 16) and tensors.kv_caches[1] is None
    assert tensors.latent[1].shape == (51, 16, 40) and tensors.latent[2].dtype == torch.bfloat16
    # Planned bytes plus one scratch block per group and layer are what gets allocated.
    assert tensors.total_bytes() == p.kv_cache_bytes + full_block + latent_block
