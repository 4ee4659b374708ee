"""Causal depthwise conv1d with state slots: Triton kernels (CPU interpreter) and their PyTorch
twins, against Hugging Face's Qwen3-Next conv and against each other (state round-trips)."""

import os

# Triton reads this when triton.language is first imported (kernels import it lazily, at launch).
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers.models.qwen3_next.modeling_qwen3_next import causal_conv1d_fn  # noqa: E402

from tandem.kernels.causal_conv1d import (  # noqa: E402
    causal_conv1d_prefill,
    causal_conv1d_prefill_ref,
    causal_conv1d_update,
    causal_conv1d_update_ref,
)

IMPLS = {
    "triton": (causal_conv1d_prefill, causal_conv1d_update),
    "ref": (causal_conv1d_prefill_ref, causal_conv1d_update_ref),
}
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DIM, WIDTH = 40, 4  # 40 channels: not a power of two, so the channel mask matters


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread is faster than several fighting over a shared box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def make_weights(dtype: torch.dtype, seed: int, bias: bool = True):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(DIM, WIDTH, generator=gen) * 0.5).to(dtype)
    b = (torch.randn(DIM, generator=gen) * 0.1).to(dtype) if bias else None
    return weight, b


def cu(lengths: list[int]) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def same(out: torch.Tensor, ref: torch.Tensor, exact: bool) -> bool:
    """Bitwise equal (Triton: the taps are summed in the same order on every path), or within a
    rounding (the torch twin: torch's vectorised SiLU rounds the last bit by position)."""
    if exact:
        return torch.equal(out, ref)
    return rel_err(out, ref) <= (1e-6 if out.dtype == torch.float32 else 1e-2)


def hf_conv(x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """Hugging Face's prefill conv of one fresh request: x [L, D] -> [L, D]."""
    return causal_conv1d_fn(x.t()[None], weight, bias, activation="silu")[0].t()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_go_equals_chunks_equals_token_updates(impl: str, dtype: torch.dtype) -> None:
    prefill, update = IMPLS[impl]
    weight, bias = make_weights(dtype, 1)
    gen = torch.Generator().manual_seed(2)
    lengths = [13, 2, 7]  # one request shorter than W - 1: its state keeps part of the old one
    xs = [torch.randn(n, DIM, generator=gen).to(dtype) for n in lengths]
    slots = torch.tensor([4, 0, 2], dtype=torch.int32)
    pool = torch.randn(6, DIM, WIDTH - 1, generator=gen).to(dtype)  # garbage: fresh requests

    # All three requests in one varlen call, fresh.
    one = pool.clone()
    y_one = prefill(torch.cat(xs), weight, bias, one, slots, cu(lengths),
                    torch.zeros(3, dtype=torch.bool))
    for i, x in enumerate(xs):
        start = sum(lengths[:i])
        assert rel_err(y_one[start : start + len(x)], hf_conv(x, weight, bias)) <= TOL[dtype]

    # The same in three chunks per request, carrying state (chunk lengths 0..6, some < W - 1).
    chunked = pool.clone()
    y_parts: list[list[torch.Tensor]] = [[] for _ in xs]
    cuts = [[0, 5, 6, 13], [0, 1, 1, 2], [0, 3, 5, 7]]
    for step in range(3):
        pieces = [x[c[step] : c[step + 1]] for x, c in zip(xs, cuts)]
        y = prefill(torch.cat(pieces), weight, bias, chunked, slots,
                    cu([len(p) for p in pieces]), torch.tensor([step > 0] * 3))
        start = 0
        for i, p in enumerate(pieces):
            y_parts[i].append(y[start : start + len(p)])
            start += len(p)
    exact = impl == "triton"
    assert same(torch.cat([torch.cat(p) for p in y_parts]), y_one, exact)
    assert torch.equal(chunked[slots.long()], one[slots.long()])

    # Token by token through the decode update, after a zero-length fresh prefill of each
    # request (which zeroes its slot's history).
    tokens = pool.clone()
    prefill(torch.empty(0, DIM, dtype=dtype), weight, bias, tokens, slots, cu([0, 0, 0]),
            torch.zeros(3, dtype=torch.bool))
    assert not tokens[slots.long()].any()
    outs: list[list[torch.Tensor]] = [[] for _ in xs]
    for t in range(max(lengths)):
        live = [i for i, n in enumerate(lengths) if t < n]
        x = torch.stack([xs[i][t] for i in live])
        y = update(x, weight, bias, tokens, slots[live])
        for row, i in enumerate(live):
            outs[i].append(y[row])
    assert same(torch.cat([torch.stack(o) for o in outs]), y_one, exact)
    assert torch.equal(tokens[slots.long()], one[slots.long()])
    # Slots nobody owns are untouched.
    for s in (1, 3, 5):
        assert torch.equal(one[s], pool[s]) and torch.equal(chunked[s], pool[s])
        assert torch.equal(tokens[s], pool[s])
    # The state holds the last W - 1 inputs (zeros in front for the 2-token request).
    assert torch.equal(one[4], xs[0][-3:].t())
    assert torch.equal(one[0], torch.cat([torch.zeros(DIM, 1, dtype=dtype), xs[1].t()], 1))


@pytest.mark.parametrize("impl", IMPLS)
def test_fresh_slot_ignores_garbage_and_initial_state_is_used(impl: str) -> None:
    prefill, _ = IMPLS[impl]
    weight, bias = make_weights(torch.float32, 3, bias=False)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(9, DIM, generator=gen)
    pool = torch.full((3, DIM, WIDTH - 1), 1e4)
    pool[1] = float("nan")
    y_fresh = prefill(x, weight, None, pool, torch.tensor([1], dtype=torch.int32), cu([9]),
                      torch.tensor([False]))
    assert rel_err(y_fresh, hf_conv(x, weight, None)) <= 1e-5
    assert torch.equal(pool[1], x[-3:].t())
    # With a history: the same as the conv over [history; x], keeping only x's rows.
    history = torch.randn(4, DIM, generator=gen)
    pool[2] = history[-3:].t()
    y_hist = prefill(x, weight, None, pool, torch.tensor([2], dtype=torch.int32), cu([9]),
                     torch.tensor([True]))
    full = hf_conv(torch.cat([history, x]), weight, None)
    assert rel_err(y_hist, full[4:]) <= 1e-5
    assert not torch.allclose(y_hist, y_fresh)


@pytest.mark.parametrize("impl", IMPLS)
def test_padded_rows_on_scratch_slot_leave_other_slots_untouched(impl: str) -> None:
    prefill, update = IMPLS[impl]
    weight, bias = make_weights(torch.bfloat16, 5)
    gen = torch.Generator().manual_seed(6)
    num_slots = 4
    pool = torch.randn(num_slots + 1, DIM, WIDTH - 1, generator=gen).to(torch.bfloat16)
    scratch = num_slots
    before = pool.clone()
    x = torch.randn(5, DIM, generator=gen).to(torch.bfloat16)
    # Two live requests (slots 2, 0) and three padded CUDA-graph rows on the scratch slot.
    slots = torch.tensor([2, scratch, 0, scratch, scratch], dtype=torch.int32)
    y = update(x, weight, bias, pool, slots)
    for s in (1, 3):
        assert torch.equal(pool[s], before[s])
    for row, s in ((0, 2), (2, 0)):
        expected = causal_conv1d_update_ref(x[row : row + 1], weight, bias, before.clone(),
                                            torch.tensor([s], dtype=torch.int32))
        assert torch.equal(y[row : row + 1], expected)
        assert torch.equal(pool[s], torch.cat([before[s][:, 1:], x[row][:, None]], 1))
    # A prefill with an empty padded request on the scratch slot.
    pool2 = before.clone()
    prefill(x[:3], weight, bias, pool2, torch.tensor([1, scratch], dtype=torch.int32),
            cu([3, 0]), torch.tensor([True, False]))
    for s in (0, 2, 3):
        assert torch.equal(pool2[s], before[s])
    assert torch.equal(pool2[1], x[:3].t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_twin(dtype: torch.dtype) -> None:
    weight, bias = make_weights(dtype, 7)
    gen = torch.Generator().manual_seed(8)
    lengths = [1, 40, 0, 6]
    x_wide = torch.randn(sum(lengths), DIM + 8, generator=gen).to(dtype)
    x = x_wide[:, 4 : 4 + DIM]  # strided rows, as a slice of a projection
    pool = torch.randn(5, DIM, WIDTH - 1, generator=gen).to(dtype)
    slots = torch.tensor([3, 1, 4, 0], dtype=torch.int32)
    init = torch.tensor([True, False, True, True])
    p_tri, p_ref = pool.clone(), pool.clone()
    y_tri = causal_conv1d_prefill(x, weight, bias, p_tri, slots, cu(lengths), init)
    y_ref = causal_conv1d_prefill_ref(x, weight, bias, p_ref, slots, cu(lengths), init)
    assert rel_err(y_tri, y_ref) <= TOL[dtype] / 10
    assert torch.equal(p_tri, p_ref)
    u_tri = causal_conv1d_update(x[:4], weight, None, p_tri, slots, activation=None)
    u_ref = causal_conv1d_update_ref(x[:4], weight, None, p_ref, slots, activation=None)
    assert rel_err(u_tri, u_ref) <= TOL[dtype] / 10
    assert torch.equal(p_tri, p_ref)


def test_invalid_inputs() -> None:
    weight, bias = make_weights(torch.float32, 9)
    pool = torch.zeros(2, DIM, WIDTH - 1)
    x = torch.zeros(3, DIM)
    idx = torch.tensor([0], dtype=torch.int32)
    with pytest.raises(ValueError):
        causal_conv1d_prefill(x, weight, bias, torch.zeros(2, DIM, WIDTH), idx, cu([3]),
                              torch.tensor([False]))
    with pytest.raises(ValueError):
        causal_conv1d_prefill(x, weight, bias, pool, idx, cu([1, 2]), torch.tensor([False]))
    with pytest.raises(ValueError):
        causal_conv1d_update(x, weight, bias, pool, idx)  # 3 rows, 1 index
    with pytest.raises(ValueError):
        causal_conv1d_update(x[:1], weight, bias, pool, idx, activation="gelu")
    with pytest.raises(TypeError):
        causal_conv1d_prefill(x, weight, bias, pool, idx, cu([3]), torch.tensor([0]))
