"""KV-cache sizing: block arithmetic, CPU and GPU budgets, overrides, state pools first."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tandem.engine_service.config import CacheConfig
from tandem.engine_service.dummy_configs import get_dummy_config
from tandem.engine_service.memory import (
    StatePoolSpec,
    estimate_activation_bytes,
    kv_bytes_per_block,
    plan_kv_cache,
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


def test_cpu_budget_and_override() -> None:
    per_block = 2 * 4 * 16 * 2 * 64 * 4
    plan = plan_kv_cache(Shape(), CacheConfig(cpu_kv_cache_bytes=10 * per_block + per_block - 1), "cpu", torch.float32)
    assert (plan.num_blocks, plan.bytes_per_block, plan.kv_cache_bytes) == (10, per_block, 10 * per_block)
    fixed = plan_kv_cache(Shape(), CacheConfig(num_blocks=3, cpu_kv_cache_bytes=1), "cpu", torch.float32)
    assert fixed.num_blocks == 3


def test_state_pools_are_reserved_before_blocks() -> None:
    per_block = kv_bytes_per_block(Shape(), 16, torch.bfloat16)
    pools = [StatePoolSpec("conv", 1000, 8), StatePoolSpec("ssm", 3 * per_block, 2)]
    budget = 100 * per_block
    plan = plan_kv_cache(Shape(), CacheConfig(cpu_kv_cache_bytes=budget), "cpu", torch.bfloat16, state_pools=pools)
    # 8000 B of conv state costs one more (partial) block; the ssm pool costs exactly six.
    assert plan.num_blocks == (budget - 8000 - 6 * per_block) // per_block == 93
    assert plan.state_pool_entries == {"conv": 8, "ssm": 2}
    assert plan.state_pool_bytes == 8000 + 6 * per_block


def test_invalid_state_pools_are_refused() -> None:
    with pytest.raises(ValueError, match="unique"):
        plan_kv_cache(Shape(), CacheConfig(), "cpu", torch.float32, state_pools=[StatePoolSpec("a", 1, 1)] * 2)
    with pytest.raises(ValueError, match="non-negative"):
        plan_kv_cache(Shape(), CacheConfig(), "cpu", torch.float32, state_pools=[StatePoolSpec("a", -1, 1)])


def test_gpu_budget_is_fraction_of_free_memory_minus_reservations(monkeypatch) -> None:
    free = 10 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * 2**30))
    per_block = kv_bytes_per_block(Shape(), 16, torch.bfloat16)
    cache = CacheConfig(memory_fraction=0.5, cpu_kv_cache_bytes=1)  # the CPU budget must not matter
    plan = plan_kv_cache(
        Shape(), cache, torch.device("cuda", 0), torch.bfloat16,
        state_pools=[StatePoolSpec("s", 2**20, 4)], reserved_bytes=2**29,
    )
    assert plan.num_blocks == (free // 2 - 4 * 2**20 - 2**29) // per_block


def test_not_enough_memory_is_an_error() -> None:
    per_block = kv_bytes_per_block(Shape(), 16, torch.float32)
    with pytest.raises(ValueError, match="not enough memory"):
        plan_kv_cache(Shape(), CacheConfig(cpu_kv_cache_bytes=per_block), "cpu", torch.float32)
    with pytest.raises(ValueError, match="not enough memory"):
        plan_kv_cache(
            Shape(), CacheConfig(cpu_kv_cache_bytes=100 * per_block), "cpu", torch.float32,
            state_pools=[StatePoolSpec("big", per_block, 99)],
        )


def test_activation_estimate_grows_with_the_step_budget() -> None:
    a = arch("qwen3-8b")
    args = (a.hidden_size, a.intermediate_size, a.num_attention_heads, a.head_dim, a.vocab_size)
    small = estimate_activation_bytes(*args, 256, 16, torch.bfloat16)
    large = estimate_activation_bytes(*args, 8192, 16, torch.bfloat16)
    # At least the bf16 MLP intermediates of one full step must fit; bounded so it leaves the
    # cache most of an H200 (a few GiB at most for an 8k-token step).
    assert large > 8192 * 2 * a.intermediate_size * 2 > small
    assert large < 4 * 2**30
