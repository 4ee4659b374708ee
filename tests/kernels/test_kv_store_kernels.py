"""K/V cache writes by slot mapping: Triton kernel (CPU interpreter) vs a naive per-token loop
and the PyTorch reference."""

import os

# Triton reads this when triton.language is first imported (kernels import it lazily, at launch).
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from tandem.kernels.kv_store import store_kv, store_kv_reference  # noqa: E402


def naive_store(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                slots: list[int]) -> None:
    block_size = kv_cache.shape[2]
    for t, slot in enumerate(slots):
        if slot >= 0:
            kv_cache[0, slot // block_size, slot % block_size] = key[t]
            kv_cache[1, slot // block_size, slot % block_size] = value[t]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kv_heads,dim,block_size", [(2, 64, 16), (3, 64, 4), (1, 128, 1), (8, 128, 32)])
def test_store_kv_matches_naive(dtype: torch.dtype, kv_heads: int, dim: int, block_size: int) -> None:
    gen = torch.Generator().manual_seed(kv_heads * dim + block_size)
    tokens, num_blocks = 9, max(4, 40 // block_size)
    # k and v sliced out of one fused projection: strided rows
    kv = torch.randn(tokens, 2 * kv_heads * dim, generator=gen).to(dtype)
    key = kv[:, : kv_heads * dim].view(tokens, kv_heads, dim)
    value = kv[:, kv_heads * dim :].view(tokens, kv_heads, dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[3] = -1  # a padding token
    cache = torch.full((2, num_blocks, block_size, kv_heads, dim), float("nan"), dtype=dtype)
    expected = cache.clone()
    store_kv(key, value, cache, slots)
    naive_store(key, value, expected, slots.tolist())
    assert torch.equal(cache.isnan(), expected.isnan())
    assert torch.equal(cache.nan_to_num(), expected.nan_to_num())
    reference = torch.full_like(cache, float("nan"))
    store_kv_reference(key, value, reference, slots)
    assert torch.equal(reference.nan_to_num(), expected.nan_to_num())


def test_store_kv_casts_to_cache_dtype_and_int32_slots() -> None:
    gen = torch.Generator().manual_seed(31)
    key = torch.randn(4, 2, 64, generator=gen)
    value = torch.randn(4, 2, 64, generator=gen)
    cache = torch.zeros(2, 3, 8, 2, 64, dtype=torch.bfloat16)
    slots = torch.tensor([1, 8, 23, 0], dtype=torch.int32)
    store_kv(key, value, cache, slots)
    expected = torch.zeros_like(cache)
    naive_store(key.bfloat16(), value.bfloat16(), expected, slots.tolist())
    assert torch.equal(cache, expected)  # round to nearest even, as torch's .to(bfloat16)


def test_store_kv_rejects_mismatched_shapes() -> None:
    cache = torch.zeros(2, 3, 8, 2, 64)
    with pytest.raises(ValueError):
        store_kv(torch.randn(4, 2, 32), torch.randn(4, 2, 32), cache, torch.arange(4))
    with pytest.raises(ValueError):
        store_kv(torch.randn(4, 2, 64), torch.randn(4, 2, 64), cache, torch.arange(5))
    with pytest.raises(ValueError):
        store_kv(torch.randn(4, 2, 64), torch.randn(4, 2, 64), cache[0], torch.arange(4))
