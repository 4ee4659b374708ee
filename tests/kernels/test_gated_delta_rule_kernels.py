"""Gated delta rule: chunked prefill and recurrent decode, Triton (CPU interpreter) and PyTorch
twins, against the per-token loop and against Hugging Face's own Qwen3-Next functions (which pins
the convention: decay, delta rule, l2norm, grouping of value heads)."""

import os

# Triton reads this when triton.language is first imported (kernels import it lazily, at launch).
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers.models.qwen3_next.modeling_qwen3_next import (  # noqa: E402
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from tandem.kernels.gated_delta_rule import (  # noqa: E402
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_ref,
    fused_recurrent_gated_delta_rule_update,
    fused_recurrent_gated_delta_rule_update_ref,
    gated_delta_rule_naive,
)

CHUNK = {"triton": chunk_gated_delta_rule, "ref": chunk_gated_delta_rule_ref}
UPDATE = {"triton": fused_recurrent_gated_delta_rule_update,
          "ref": fused_recurrent_gated_delta_rule_update_ref}
# Small shapes for the interpreter: K, V powers of two >= 16 (tl.dot), HV = 2 * H.
H, HV, K, V = 2, 4, 16, 32
SCALE = K**-0.5


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread is faster than several fighting over a shared box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def cu(lengths: list[int]) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def make_inputs(tokens: int, dtype: torch.dtype, seed: int, heads: int = H, vheads: int = HV):
    """Qwen3-Next-like inputs: g = -exp(A)·softplus(a) (log-decay <= 0), beta = sigmoid(b)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, K, generator=gen).to(dtype)
    k = torch.randn(tokens, heads, K, generator=gen).to(dtype)
    v = torch.randn(tokens, vheads, V, generator=gen).to(dtype)
    a = torch.randn(tokens, vheads, generator=gen)
    g = -torch.rand(vheads, generator=gen).add(0.1) * torch.nn.functional.softplus(a)
    beta = torch.sigmoid(torch.randn(tokens, vheads, generator=gen)).to(dtype)
    return q, k, v, g, beta


def random_pool(slots: int, seed: int, vheads: int = HV) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(slots, vheads, K, V, generator=gen) * 0.3


# --------------------------------------------------------------------------- the convention


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("heads,vheads", [(2, 2), (2, 4)])
def test_twins_match_transformers(with_state: bool, heads: int, vheads: int) -> None:
    tokens = 45  # not a multiple of the chunk
    q, k, v, g, beta = make_inputs(tokens, torch.float32, 1, heads, vheads)
    pool = random_pool(3, 2, vheads)
    initial = pool[1].clone()
    idx = torch.tensor([1], dtype=torch.int32)
    has = torch.tensor([with_state])
    hf_args = dict(initial_state=initial[None] if with_state else None, output_final_state=True,
                   use_qk_l2norm_in_kernel=True)
    hf_rec, hf_rec_state = torch_recurrent_gated_delta_rule(q[None], k[None], v[None], g[None],
                                                            beta[None], **hf_args)
    hf_chunk, hf_chunk_state = torch_chunk_gated_delta_rule(q[None], k[None], v[None], g[None],
                                                            beta[None], chunk_size=16, **hf_args)
    naive_pool = pool.clone()
    naive = gated_delta_rule_naive(q, k, v, g, beta, SCALE, naive_pool, idx, cu([tokens]), has)
    assert rel_err(naive, hf_rec[0]) <= 1e-6
    assert rel_err(naive_pool[1], hf_rec_state[0]) <= 1e-6
    chunk_pool = pool.clone()
    chunked = chunk_gated_delta_rule_ref(q, k, v, g, beta, SCALE, chunk_pool, idx, cu([tokens]), has,
                                         chunk_size=16)
    assert rel_err(chunked, hf_chunk[0]) <= 1e-5
    assert rel_err(chunk_pool[1], hf_chunk_state[0]) <= 1e-5
    # The decode step, token by token, is HF's recurrent form too.
    step_pool = pool.clone()
    if not with_state:
        step_pool[1] = 0
    steps = [fused_recurrent_gated_delta_rule_update_ref(q[t : t + 1], k[t : t + 1], v[t : t + 1],
                                                         g[t : t + 1], beta[t : t + 1], SCALE,
                                                         step_pool, idx)
             for t in range(tokens)]
    assert rel_err(torch.cat(steps), hf_rec[0]) <= 1e-6
    assert rel_err(step_pool[1], hf_rec_state[0]) <= 1e-6
    # Other slots are untouched by every path.
    for p in (naive_pool, chunk_pool, step_pool):
        assert torch.equal(p[0], pool[0]) and torch.equal(p[2], pool[2])


# --------------------------------------------------------------------------- prefill


def run_varlen(fn, dtype: torch.dtype, lengths: list[int], has: list[bool], seed: int,
               chunk_size: int = 16):
    q, k, v, g, beta = make_inputs(sum(lengths), dtype, seed)
    pool = random_pool(len(lengths) + 2, seed + 1)
    pool[-1] = float("nan")  # a fresh slot's garbage must not leak (has_initial_state False)
    # Distinct slots in reverse order; the last request gets the NaN slot; two slots unused.
    slots = torch.tensor([len(lengths) - 1 - i for i in range(len(lengths))], dtype=torch.int32)
    slots[-1] = len(lengths) + 1
    has_t = torch.tensor(has)
    has_t[-1] = False
    out_pool = pool.clone()
    out = fn(q, k, v, g, beta, SCALE, out_pool, slots, cu(lengths), has_t, chunk_size=chunk_size)
    return out, out_pool, pool, slots


@pytest.mark.parametrize("impl", CHUNK)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_matches_naive_varlen(impl: str, dtype: torch.dtype) -> None:
    lengths = [37, 1, 16, 5, 0, 20]  # a full chunk, partial chunks, one token, an empty request
    has = [True, False, True, True, True, False]
    naive, naive_pool, pool, slots = run_varlen(gated_delta_rule_naive, dtype, lengths, has, 3)
    out, out_pool, _, _ = run_varlen(CHUNK[impl], dtype, lengths, has, 3)
    assert out.dtype == dtype and not out.isnan().any()
    assert rel_err(out, naive) <= (2e-5 if dtype == torch.float32 else 2e-2)
    used = slots.long()
    assert rel_err(out_pool[used], naive_pool[used]) <= 2e-5
    unused = [s for s in range(pool.shape[0]) if s not in slots.tolist()]
    assert torch.equal(out_pool[unused], pool[unused])


@pytest.mark.parametrize("impl", CHUNK)
def test_chunked_is_stable_on_repeated_keys(impl: str) -> None:
    """A repeated token (identical keys, beta near 1, no decay) makes I + A the worst-conditioned
    unit-triangular system (A all ones below the diagonal, whose inverse's Neumann series has
    terms of size C(63, 31)); forward substitution must still agree with the loop."""
    tokens = 64
    q, k, v, g, beta = make_inputs(tokens, torch.float32, 11)
    k[:] = k[0]
    q[:] = q[0]
    g.zero_()
    beta.fill_(0.99)
    pool = random_pool(1, 12)
    args = (torch.tensor([0], dtype=torch.int32), cu([tokens]), torch.tensor([True]))
    naive_pool, out_pool = pool.clone(), pool.clone()
    naive = gated_delta_rule_naive(q, k, v, g, beta, SCALE, naive_pool, *args)
    out = CHUNK[impl](q, k, v, g, beta, SCALE, out_pool, *args, chunk_size=64)
    assert rel_err(out, naive) <= 2e-5
    assert rel_err(out_pool, naive_pool) <= 2e-5


@pytest.mark.parametrize("impl", CHUNK)
def test_chunk_size_independent(impl: str) -> None:
    lengths = [50, 7]
    has = [True, False]
    results = [run_varlen(CHUNK[impl], torch.float32, lengths, has, 4, chunk_size=c)
               for c in (16, 32, 64)]
    for out, out_pool, _, slots in results[1:]:
        assert rel_err(out, results[0][0]) <= 2e-5
        assert rel_err(out_pool[slots.long()], results[0][1][slots.long()]) <= 2e-5


@pytest.mark.parametrize("impl", CHUNK)
def test_prefill_in_pieces_carries_state(impl: str) -> None:
    """Three prefill chunks (the scheduler's chunked prefill) == one prefill of the whole."""
    tokens = 41
    q, k, v, g, beta = make_inputs(tokens, torch.float32, 5)
    pool = random_pool(2, 6)
    idx = torch.tensor([0], dtype=torch.int32)
    whole_pool = pool.clone()
    whole = CHUNK[impl](q, k, v, g, beta, SCALE, whole_pool, idx, cu([tokens]),
                        torch.tensor([False]), chunk_size=16)
    piece_pool = pool.clone()
    outs = []
    for i, (a, b) in enumerate(((0, 9), (9, 30), (30, 41))):
        outs.append(CHUNK[impl](q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], SCALE, piece_pool, idx,
                                cu([b - a]), torch.tensor([i > 0]), chunk_size=16))
    assert rel_err(torch.cat(outs), whole) <= 2e-5
    assert rel_err(piece_pool[0], whole_pool[0]) <= 2e-5
    assert torch.equal(piece_pool[1], pool[1])


# --------------------------------------------------------------------------- decode


@pytest.mark.parametrize("impl", UPDATE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recurrent_update_matches_naive_and_spares_other_slots(impl: str, dtype: torch.dtype) -> None:
    batch, steps, num_slots = 3, 4, 5
    scratch = num_slots  # the pool's extra slot for padded rows
    pool = random_pool(num_slots + 1, 7)
    q, k, v, g, beta = make_inputs(batch * steps, dtype, 8)
    slots = [3, 0, 4]
    # Naive: each request's tokens as one sequence from its slot's state.
    naive_pool = pool.clone()

    def pick(x):  # step-major rows -> request-major rows
        return x.view(steps, batch, *x.shape[1:]).transpose(0, 1).reshape(x.shape)

    naive = gated_delta_rule_naive(pick(q), pick(k), pick(v), pick(g), pick(beta), SCALE, naive_pool,
                                   torch.tensor(slots, dtype=torch.int32), cu([steps] * batch),
                                   torch.tensor([True] * batch))
    # Decode: step t has one row per request plus two padded rows on the scratch slot.
    dec_pool = pool.clone()
    outs = []
    for t in range(steps):
        rows = slice(t * batch, (t + 1) * batch)

        def pad(x):
            return torch.cat([x[rows], x[rows][:2]])

        idx = torch.tensor(slots + [scratch, scratch], dtype=torch.int32)
        out = UPDATE[impl](pad(q), pad(k), pad(v), pad(g), pad(beta), SCALE, dec_pool, idx)
        assert out.dtype == dtype
        outs.append(out[:batch])
    decoded = pick(torch.cat(outs))
    assert rel_err(decoded, naive) <= (1e-5 if dtype == torch.float32 else 2e-2)
    assert rel_err(dec_pool[slots], naive_pool[slots]) <= 1e-5
    for s in (1, 2):
        assert torch.equal(dec_pool[s], pool[s])


def test_invalid_inputs() -> None:
    q, k, v, g, beta = make_inputs(4, torch.float32, 9)
    pool = random_pool(2, 10)
    idx = torch.tensor([0], dtype=torch.int32)
    has = torch.tensor([True])
    with pytest.raises(ValueError):  # value heads not a multiple of q/k heads
        chunk_gated_delta_rule(q, k, v[:, :3], g[:, :3], beta[:, :3], SCALE, pool[:, :3], idx,
                               cu([4]), has)
    with pytest.raises(TypeError):  # the state pool must be float32
        chunk_gated_delta_rule(q, k, v, g, beta, SCALE, pool.bfloat16(), idx, cu([4]), has)
    with pytest.raises(ValueError):  # cu_seqlens must have B + 1 entries
        chunk_gated_delta_rule(q, k, v, g, beta, SCALE, pool, idx, cu([2, 2]), has)
    with pytest.raises(ValueError):  # one index per decode row
        fused_recurrent_gated_delta_rule_update(q, k, v, g, beta, SCALE, pool, idx)
