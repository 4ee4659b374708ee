"""Paged decode/prefill attention: Triton kernels (CPU interpreter) vs the PyTorch references,
and the references vs a naive dense causal attention built here from unpaged K/V."""

import os

# Triton reads this when triton.language is first imported (kernels import it lazily, at launch).
os.environ["TRITON_INTERPRET"] = "1"

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tandem.kernels.paged_attention import (  # noqa: E402
    choose_num_splits,
    paged_decode_attention,
    paged_decode_attention_reference,
    paged_prefill_attention,
    paged_prefill_attention_reference,
)

TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}


class PagedBatch:
    """Dense per-sequence K/V scattered into a paged cache through shuffled block tables.

    Unused cache blocks and padded block-table entries hold random data and valid block ids, so
    a kernel that reads past a sequence's length produces wrong numbers rather than an error.
    """

    def __init__(self, seq_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, gen: torch.Generator) -> None:
        self.seq_lens = seq_lens
        self.block_size = block_size
        self.keys = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype) for n in seq_lens]
        self.values = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype) for n in seq_lens]
        need = [math.ceil(n / block_size) for n in seq_lens]
        num_blocks = sum(need) + 3
        self.kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim,
                                    generator=gen).to(dtype)
        perm = torch.randperm(num_blocks, generator=gen)
        width = max(need + [1]) + 2  # padded, as the engine pads to a fixed width
        self.block_tables = torch.randint(0, num_blocks, (len(seq_lens), width), generator=gen,
                                          dtype=torch.int32)
        used = 0
        for b, n in enumerate(seq_lens):
            blocks = perm[used : used + need[b]]
            used += need[b]
            self.block_tables[b, : need[b]] = blocks.to(torch.int32)
            for p in range(n):
                blk, row = blocks[p // block_size], p % block_size
                self.kv_cache[0, blk, row] = self.keys[b][p]
                self.kv_cache[1, blk, row] = self.values[b][p]
        self.seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int,
                    scale: float) -> torch.Tensor:
    """float64 causal attention of q rows at positions first_pos.. over dense k/v [L, Hkv, D]."""
    n, heads, _ = q.shape
    group = heads // k.shape[1]
    out = torch.empty(n, heads, q.shape[2], dtype=torch.float64)
    for i in range(n):
        visible = first_pos + i + 1
        for h in range(heads):
            kh = k[:visible, h // group].double()
            vh = v[:visible, h // group].double()
            weights = torch.softmax(kh @ q[i, h].double() * scale, dim=0)
            out[i, h] = weights @ vh
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


# (heads, kv_heads, head_dim): MHA, GQA group 2, SmolLM2's group of 3, a group of 8 at head_dim 128
SHAPES = [(2, 2, 64), (4, 2, 64), (9, 3, 64), (8, 1, 128)]


# --------------------------------------------------------------------------- references


def test_references_match_naive_dense_attention() -> None:
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, bs = 6, 2, 32, 4
    batch = PagedBatch([1, 9, 21], kv_heads, dim, bs, torch.float32, gen)
    scale = 0.3
    q = torch.randn(3, heads, dim, generator=gen)
    ref = paged_decode_attention_reference(q, batch.kv_cache, batch.block_tables, batch.seq_lens_t, scale)
    for b, n in enumerate(batch.seq_lens):
        naive = naive_attention(q[b : b + 1], batch.keys[b], batch.values[b], n - 1, scale)[0]
        torch.testing.assert_close(ref[b].double(), naive, rtol=1e-5, atol=1e-5)

    q_lens = [1, 4, 21]  # decode-like, a chunk after a cached prefix, a fresh prompt
    qsl = torch.tensor([0, 1, 5, 26], dtype=torch.int32)
    qp = torch.randn(26, heads, dim, generator=gen)
    ref = paged_prefill_attention_reference(qp, batch.kv_cache, qsl, batch.seq_lens_t,
                                            batch.block_tables, scale)
    for b, n in enumerate(batch.seq_lens):
        lo, hi = qsl[b].item(), qsl[b + 1].item()
        naive = naive_attention(qp[lo:hi], batch.keys[b], batch.values[b], n - q_lens[b], scale)
        torch.testing.assert_close(ref[lo:hi].double(), naive, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- decode


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s[0]}kv{s[1]}d{s[2]}")
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_reference(dtype: torch.dtype, shape: tuple[int, int, int],
                                  num_splits: int) -> None:
    heads, kv_heads, dim = shape
    gen = torch.Generator().manual_seed(1)
    # one token, a partial block, exactly one tile, and several tiles ending mid-block
    batch = PagedBatch([1, 13, 64, 150], kv_heads, dim, 16, dtype, gen)
    q = torch.randn(4, heads, dim, generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"))
    scale = dim**-0.5
    paged_decode_attention(q, batch.kv_cache, batch.block_tables, batch.seq_lens_t, scale,
                           num_splits=num_splits, out=out)
    ref = paged_decode_attention_reference(q, batch.kv_cache, batch.block_tables, batch.seq_lens_t,
                                           scale)
    assert not out.isnan().any()
    assert rel_err(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("block_size", [1, 8, 128])
def test_decode_block_sizes_and_surplus_splits(block_size: int) -> None:
    gen = torch.Generator().manual_seed(2)
    batch = PagedBatch([5, 70, 129], 1, 64, block_size, torch.float32, gen)
    q = torch.randn(3, 3, 64, generator=gen)
    # 7 splits over contexts of 1..3 tiles: most splits are empty and must not disturb the merge
    out = paged_decode_attention(q, batch.kv_cache, batch.block_tables, batch.seq_lens_t, 0.125,
                                 num_splits=7)
    ref = paged_decode_attention_reference(q, batch.kv_cache, batch.block_tables, batch.seq_lens_t,
                                           0.125)
    assert rel_err(out, ref) <= 1e-4


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_empty_sequences_give_zeros(num_splits: int) -> None:
    gen = torch.Generator().manual_seed(3)
    batch = PagedBatch([0, 40], 2, 64, 16, torch.float32, gen)
    q = torch.randn(2, 4, 64, generator=gen)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, batch.kv_cache, batch.block_tables, batch.seq_lens_t, 0.125,
                           num_splits=num_splits, out=out)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    ref = paged_decode_attention_reference(q, batch.kv_cache, batch.block_tables, batch.seq_lens_t,
                                           0.125)
    assert rel_err(out[1], ref[1]) <= 1e-4


def test_decode_default_splits_and_fp16() -> None:
    gen = torch.Generator().manual_seed(4)
    batch = PagedBatch([300, 77], 2, 128, 16, torch.float16, gen)
    q = torch.randn(2, 4, 128, generator=gen).half()
    out = paged_decode_attention(q, batch.kv_cache, batch.block_tables, batch.seq_lens_t, 0.09)
    ref = paged_decode_attention_reference(q, batch.kv_cache, batch.block_tables, batch.seq_lens_t,
                                           0.09)
    assert rel_err(out, ref) <= 1e-2


def test_choose_num_splits() -> None:
    # Big batches fill the GPU alone; small batches with long contexts split; short contexts don't.
    assert choose_num_splits(256, 8, 8192, 132) == 1
    assert choose_num_splits(1, 8, 8192, 132) == 64
    assert choose_num_splits(4, 8, 8192, 132) == 16
    assert choose_num_splits(32, 8, 8192, 132) == 2
    assert choose_num_splits(1, 8, 1024, 132) == 16  # at least one 64-token tile per split
    assert choose_num_splits(1, 8, 64, 132) == 1


def test_decode_rejects_bad_arguments() -> None:
    gen = torch.Generator().manual_seed(5)
    batch = PagedBatch([4], 2, 64, 16, torch.float32, gen)
    q = torch.randn(1, 4, 64, generator=gen)
    with pytest.raises(TypeError):
        paged_decode_attention(q.half(), batch.kv_cache, batch.block_tables, batch.seq_lens_t, 1.0)
    with pytest.raises(ValueError):
        paged_decode_attention(torch.randn(1, 3, 64), batch.kv_cache, batch.block_tables,
                               batch.seq_lens_t, 1.0)
    with pytest.raises(TypeError):
        paged_decode_attention(q, batch.kv_cache, batch.block_tables.long(), batch.seq_lens_t, 1.0)


# --------------------------------------------------------------------------- prefill


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s[0]}kv{s[1]}d{s[2]}")
def test_prefill_matches_reference(dtype: torch.dtype, shape: tuple[int, int, int]) -> None:
    heads, kv_heads, dim = shape
    gen = torch.Generator().manual_seed(6)
    # fresh prompt over two query tiles; chunk of 3 after a 97-token cached prefix; a decode row;
    # a 16-token chunk ending mid-block after a prefix that is not tile-aligned
    q_lens = [70, 3, 1, 16]
    ctxs = [70, 100, 33, 61]
    batch = PagedBatch(ctxs, kv_heads, dim, 16, dtype, gen)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    total = starts[-1]
    qsl = torch.tensor(starts, dtype=torch.int32)
    q = torch.randn(total + 2, heads, dim, generator=gen).to(dtype)  # 2 padding rows at the end
    out = torch.full_like(q, float("nan"))
    scale = dim**-0.5
    paged_prefill_attention(q, batch.kv_cache, qsl, batch.seq_lens_t, batch.block_tables, scale,
                            max(q_lens), out=out)
    ref = paged_prefill_attention_reference(q[:total], batch.kv_cache, qsl, batch.seq_lens_t,
                                            batch.block_tables, scale)
    assert not out[:total].isnan().any()
    assert out[total:].isnan().all()  # rows outside every sequence are left alone
    assert rel_err(out[:total], ref) <= TOL[dtype]


def test_prefill_small_blocks_prefix_hits() -> None:
    gen = torch.Generator().manual_seed(7)
    # block size 4: every tile spans many blocks; long prefix with short chunks
    q_lens, ctxs = [5, 2, 64], [133, 66, 64]
    batch = PagedBatch(ctxs, 2, 64, 4, torch.float32, gen)
    qsl = torch.tensor([0, 5, 7, 71], dtype=torch.int32)
    q = torch.randn(71, 4, 64, generator=gen)
    out = paged_prefill_attention(q, batch.kv_cache, qsl, batch.seq_lens_t, batch.block_tables, 0.2,
                                  64)
    ref = paged_prefill_attention_reference(q, batch.kv_cache, qsl, batch.seq_lens_t,
                                            batch.block_tables, 0.2)
    assert rel_err(out, ref) <= 1e-4


def test_prefill_single_query_rows_match_decode() -> None:
    """A batch of 1-token chunks is a decode batch: both kernels must agree."""
    gen = torch.Generator().manual_seed(8)
    batch = PagedBatch([17, 90], 3, 64, 16, torch.float32, gen)
    q = torch.randn(2, 9, 64, generator=gen)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
    pre = paged_prefill_attention(q, batch.kv_cache, qsl, batch.seq_lens_t, batch.block_tables, 0.1, 1)
    dec = paged_decode_attention(q, batch.kv_cache, batch.block_tables, batch.seq_lens_t, 0.1,
                                 num_splits=2)
    assert rel_err(pre, dec) <= 1e-5


# --------------------------------------------------------------------------- sliding window


def naive_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int,
                           scale: float, window: int) -> torch.Tensor:
    """float64 attention of q rows at positions first_pos.. over keys p - window + 1 .. p."""
    n, heads, _ = q.shape
    group = heads // k.shape[1]
    out = torch.empty(n, heads, q.shape[2], dtype=torch.float64)
    for i in range(n):
        p = first_pos + i
        lo = max(0, p - window + 1)
        for h in range(heads):
            kh, vh = k[lo : p + 1, h // group].double(), v[lo : p + 1, h // group].double()
            out[i, h] = torch.softmax(kh @ q[i, h].double() * scale, dim=0) @ vh
    return out


def poison_before(batch: PagedBatch, b: int, first_needed_pos: int) -> int:
    """Fill sequence b's blocks wholly before position `first_needed_pos` with NaN (a kernel that
    reads them returns NaN); returns how many blocks were poisoned."""
    n = max(0, first_needed_pos) // batch.block_size
    for j in range(n):
        batch.kv_cache[:, int(batch.block_tables[b, j])] = float("nan")
    return n


def test_window_references_match_naive() -> None:
    gen = torch.Generator().manual_seed(10)
    heads, kv_heads, dim, bs, window = 4, 2, 16, 4, 7
    batch = PagedBatch([3, 9, 30], kv_heads, dim, bs, torch.float32, gen)
    q = torch.randn(3, heads, dim, generator=gen)
    ref = paged_decode_attention_reference(q, batch.kv_cache, batch.block_tables, batch.seq_lens_t, 0.3,
                                           sliding_window=window)
    for b, n in enumerate(batch.seq_lens):
        naive = naive_window_attention(q[b : b + 1], batch.keys[b], batch.values[b], n - 1, 0.3, window)[0]
        torch.testing.assert_close(ref[b].double(), naive, rtol=1e-5, atol=1e-5)
    q_lens = [3, 4, 20]
    qsl = torch.tensor([0, 3, 7, 27], dtype=torch.int32)
    qp = torch.randn(27, heads, dim, generator=gen)
    ref = paged_prefill_attention_reference(qp, batch.kv_cache, qsl, batch.seq_lens_t, batch.block_tables,
                                            0.3, sliding_window=window)
    for b, n in enumerate(batch.seq_lens):
        lo, hi = qsl[b].item(), qsl[b + 1].item()
        naive = naive_window_attention(qp[lo:hi], batch.keys[b], batch.values[b], n - q_lens[b], 0.3, window)
        torch.testing.assert_close(ref[lo:hi].double(), naive, rtol=1e-5, atol=1e-5)
    # The window matters: the full-context answer differs.
    full = paged_prefill_attention_reference(qp, batch.kv_cache, qsl, batch.seq_lens_t, batch.block_tables, 0.3)
    assert (full - ref).abs().max() > 1e-3


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_window_reads_only_the_window(num_splits: int, block_size: int) -> None:
    gen = torch.Generator().manual_seed(11)
    window = 37
    # shorter than the window, exactly the window, and several windows long
    batch = PagedBatch([20, 37, 150, 333], 2, 64, block_size, torch.float32, gen)
    clean = batch.kv_cache.clone()
    q = torch.randn(4, 4, 64, generator=gen)
    ref = paged_decode_attention_reference(q, clean, batch.block_tables, batch.seq_lens_t, 0.125,
                                           sliding_window=window)
    poisoned = sum(poison_before(batch, b, n - window) for b, n in enumerate(batch.seq_lens))
    assert poisoned > 0
    out = paged_decode_attention(q, batch.kv_cache, batch.block_tables, batch.seq_lens_t, 0.125,
                                 num_splits=num_splits, sliding_window=window)
    assert not out.isnan().any()
    assert rel_err(out, ref) <= 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_window_reads_only_the_window(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(12)
    window = 21
    # a fresh prompt over two query tiles, a chunk after a long prefix, a decode row
    q_lens, ctxs = [100, 9, 1], [100, 140, 57]
    batch = PagedBatch(ctxs, 2, 64, 4, dtype, gen)
    clean = batch.kv_cache.clone()
    qsl = torch.tensor([0, 100, 109, 110], dtype=torch.int32)
    q = torch.randn(110, 4, 64, generator=gen).to(dtype)
    ref = paged_prefill_attention_reference(q, clean, qsl, batch.seq_lens_t, batch.block_tables, 0.125,
                                            sliding_window=window)
    poisoned = sum(poison_before(batch, b, n - q_lens[b] - window + 1) for b, n in enumerate(ctxs))
    assert poisoned > 0
    out = paged_prefill_attention(q, batch.kv_cache, qsl, batch.seq_lens_t, batch.block_tables, 0.125,
                                  max(q_lens), sliding_window=window)
    assert not out.isnan().any()
    assert rel_err(out, ref) <= TOL[dtype]


def test_window_argument_is_checked() -> None:
    gen = torch.Generator().manual_seed(13)
    batch = PagedBatch([4], 2, 64, 16, torch.float32, gen)
    q = torch.randn(1, 4, 64, generator=gen)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_decode_attention(q, batch.kv_cache, batch.block_tables, batch.seq_lens_t, 1.0, sliding_window=0)
