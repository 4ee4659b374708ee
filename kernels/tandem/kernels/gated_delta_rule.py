"""Gated delta rule (the linear attention of Gated DeltaNet): chunked prefill and recurrent decode.

Per value head, with a float32 state ``S [K, V]`` and after the optional L2 norm of q and k
(``x * rsqrt(sum(x²) + 1e-6)`` in float32) and ``q *= scale``, every token does

    S = exp(g_t) · S
    S = S + k_t ⊗ (beta_t · (v_t − Sᵀ k_t))        (the delta rule: write only the correction)
    o_t = Sᵀ q_t

— exactly Hugging Face's ``torch_recurrent_gated_delta_rule`` (Qwen3-Next / Qwen3.5). With
``HV = n · H`` value heads, q/k head ``h`` serves value heads ``h·n … h·n + n − 1`` (HF's
``repeat_interleave``).

Tokens of several requests are concatenated (request ``i`` owns rows
``cu_seqlens[i]:cu_seqlens[i+1]``); each request's state lives in slot ``state_indices[i]`` of a
float32 pool ``state [S, HV, K, V]``: read at the start (zeros when ``has_initial_state[i]`` is
False, whatever the slot holds) and overwritten with the final state.

Chunked form (prefill). Within a chunk of ``C`` tokens with cumulative log-decay ``γ`` (``γ_i =
g_1 + … + g_i``), unrolling the recurrence gives a unit lower-triangular system (the "UT
transform" of the DeltaNet papers; WY representation of the product of Householder-like updates):
``M = I + strictlower(beta_i k_i·k_j e^{γ_i−γ_j})``, ``U = M⁻¹ (beta ⊙ V)``,
``W = M⁻¹ (beta e^{γ} ⊙ K)``. With the chunk's entry state ``S``:
``V' = U − W S``, ``O = (Q e^{γ}) S + (lower(Q Kᵀ ⊙ e^{γ_i−γ_j})) V'``,
``S ← e^{γ_C} S + (K e^{γ_C−γ})ᵀ V'``. Chunks of different requests never mix; a request's last
chunk may be short.

Implementations: ``gated_delta_rule_naive`` (the per-token loop; the ground truth for tests),
``chunk_gated_delta_rule_ref`` (the chunked form in PyTorch), ``fused_recurrent_..._ref``
(vectorised one-token step), and the Triton kernels behind the public functions:

* ``chunk_gated_delta_rule``: five launches. Parallel over (chunk, value head): ``kkt`` forms
  ``γ``, ``A = strictlower(β k kᵀ e^{γi−γj})`` and ``K e^{γ_C−γ}``; ``solve`` inverts ``I + A``
  in place by blocked forward substitution (the 16×16 diagonal blocks together in 15 dependent
  steps, then one block row at a time with exact float32 products; a kernel of its own, with few
  registers, so many programs share an SM); ``wu`` forms ``W`` and ``U``. Sequential over a request's chunks,
  parallel over (request, value head, V block): ``state`` carries ``S`` in registers, turns
  ``U`` into ``V'`` and saves each chunk's entry state. Parallel over (chunk, value head, V
  block): ``output``. Scratch is float32 (the entry states in the activation dtype for 16-bit
  models). The chunk → request map is built on the device (no host sync); grids are sized from
  shapes only.
* ``fused_recurrent_gated_delta_rule_update``: one launch for every request and value head; each
  program owns a ``[K, BV]`` tile of one slot's state, reads it once and writes it once (float32).
  No host sync, no value-dependent allocation: CUDA-graph capturable.

Dispatch: Triton on CUDA, or on CPU when ``TRITON_INTERPRET=1`` is set; else the PyTorch twins
(``*_ref``, same signatures).
"""

from __future__ import annotations

import torch

from tandem.kernels._utils import (
    FLOAT_DTYPES,
    PER_REQUEST_VIEWS,
    cast,
    cdiv,
    check_contiguous_last_dim,
    check_dtype,
    check_same_device,
    check_shape,
    dot,
    dot_precision,
    next_power_of_2,
    num_compute_units,
    search_steps,
    tl,
    triton_helper,
    triton_kernel,
)
from tandem.kernels.causal_conv1d import use_triton

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "L2NORM_EPS",
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_ref",
    "fused_recurrent_gated_delta_rule_update",
    "fused_recurrent_gated_delta_rule_update_ref",
    "gated_delta_rule_naive",
]

DEFAULT_CHUNK_SIZE = 64
L2NORM_EPS = 1e-6  # Hugging Face's (and flash-linear-attention's) l2norm epsilon


# --------------------------------------------------------------------------- checks + helpers


def _check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
) -> tuple[int, int, int, int, int]:
    """Returns (rows, H, HV, K, V)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        check_dtype(name, t, FLOAT_DTYPES)
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, K], got {list(q.shape)}")
    rows, heads, kdim = q.shape
    check_shape("k", k, (rows, heads, kdim))
    if v.dim() != 3 or v.shape[0] != rows:
        raise ValueError(f"v must be [T={rows}, HV, V], got {list(v.shape)}")
    vheads, vdim = v.shape[1], v.shape[2]
    if vheads % heads:
        raise ValueError(f"value heads ({vheads}) must be a multiple of q/k heads ({heads})")
    check_shape("g", g, (rows, vheads))
    check_shape("beta", beta, (rows, vheads))
    check_dtype("state", state, (torch.float32,))
    check_shape("state", state, (None, vheads, kdim, vdim))
    check_dtype("state_indices", state_indices, (torch.int32, torch.int64))
    if state_indices.dim() != 1:
        raise ValueError(f"state_indices must be 1-D, got {list(state_indices.shape)}")
    check_same_device(q=q, k=k, v=v, g=g, beta=beta, state=state, state_indices=state_indices)
    return rows, heads, vheads, kdim, vdim


def _check_varlen(cu_seqlens: torch.Tensor, has_initial_state: torch.Tensor, batch: int) -> None:
    check_dtype("cu_seqlens", cu_seqlens, (torch.int32, torch.int64))
    check_shape("cu_seqlens", cu_seqlens, (batch + 1,))
    check_dtype("has_initial_state", has_initial_state, (torch.bool,))
    check_shape("has_initial_state", has_initial_state, (batch,))


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``l2norm`` (float32 in, float32 out)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def _prepare_qk(
    q: torch.Tensor, k: torch.Tensor, vheads: int, scale: float, use_qk_l2norm: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 q, k expanded to the value heads, normalised and scaled as the recurrence uses."""
    group = vheads // q.shape[1]
    qf = q.float().repeat_interleave(group, dim=1)
    kf = k.float().repeat_interleave(group, dim=1)
    if use_qk_l2norm:
        qf, kf = _l2norm(qf), _l2norm(kf)
    return qf * scale, kf


# --------------------------------------------------------------------------- PyTorch twins


def gated_delta_rule_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    has_initial_state: torch.Tensor,
    use_qk_l2norm: bool = True,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """The recurrence token by token (float32; ``chunk_size`` is accepted and ignored, so the
    signature matches :func:`chunk_gated_delta_rule`). The ground truth for the tests."""
    rows, _, vheads, kdim, vdim = _check_inputs(q, k, v, g, beta, state, state_indices)
    batch = state_indices.shape[0]
    _check_varlen(cu_seqlens, has_initial_state, batch)
    qf, kf = _prepare_qk(q, k, vheads, scale, use_qk_l2norm)
    vf, gf, bf = v.float(), g.float(), beta.float()
    out = torch.empty(rows, vheads, vdim, dtype=torch.float32, device=v.device)
    bounds = cu_seqlens.tolist()
    for i, slot in enumerate(state_indices.tolist()):
        if has_initial_state[i]:
            s = state[slot].clone()
        else:
            s = torch.zeros(vheads, kdim, vdim, dtype=torch.float32, device=v.device)
        for t in range(bounds[i], bounds[i + 1]):
            s = s * gf[t].exp()[:, None, None]
            predicted = torch.einsum("hkv,hk->hv", s, kf[t])
            delta = (vf[t] - predicted) * bf[t][:, None]
            s = s + kf[t][:, :, None] * delta[:, None, :]
            out[t] = torch.einsum("hkv,hk->hv", s, qf[t])
        state[slot] = s
    return out.to(v.dtype)


def chunk_gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    has_initial_state: torch.Tensor,
    use_qk_l2norm: bool = True,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """PyTorch twin of :func:`chunk_gated_delta_rule`: the chunked (UT-transform) form, one
    request at a time (host syncs on ``cu_seqlens``)."""
    rows, _, vheads, kdim, vdim = _check_inputs(q, k, v, g, beta, state, state_indices)
    batch = state_indices.shape[0]
    _check_varlen(cu_seqlens, has_initial_state, batch)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    qf, kf = _prepare_qk(q, k, vheads, scale, use_qk_l2norm)
    # Head-major for batched matmuls: [HV, T, D].
    qf, kf, vf = qf.transpose(0, 1), kf.transpose(0, 1), v.float().transpose(0, 1)
    gf, bf = g.float().t(), beta.float().t()
    out = torch.empty(vheads, rows, vdim, dtype=torch.float32, device=v.device)
    bounds = cu_seqlens.tolist()
    for i, slot in enumerate(state_indices.tolist()):
        if has_initial_state[i]:
            s = state[slot].clone()
        else:
            s = torch.zeros(vheads, kdim, vdim, dtype=torch.float32, device=v.device)
        for c0 in range(bounds[i], bounds[i + 1], chunk_size):
            c1 = min(c0 + chunk_size, bounds[i + 1])
            qc, kc, vc = qf[:, c0:c1], kf[:, c0:c1], vf[:, c0:c1]
            bc = bf[:, c0:c1, None]
            gamma = gf[:, c0:c1].cumsum(-1)  # [HV, L]
            # decay[h, i, j] = exp(gamma_i - gamma_j) on and below the diagonal, 0 above.
            diff = gamma[:, :, None] - gamma[:, None, :]
            lower = torch.ones(c1 - c0, c1 - c0, dtype=torch.bool, device=v.device).tril()
            decay = torch.where(lower, diff, float("-inf")).exp()
            m = (bc * kc) @ kc.transpose(1, 2) * decay  # solve_triangular ignores its diagonal
            u = torch.linalg.solve_triangular(m, bc * vc, upper=False, unitriangular=True)
            w = torch.linalg.solve_triangular(m, bc * gamma.exp()[:, :, None] * kc, upper=False,
                                              unitriangular=True)
            v_new = u - w @ s
            attn = (qc @ kc.transpose(1, 2)) * decay
            out[:, c0:c1] = (qc * gamma.exp()[:, :, None]) @ s + attn @ v_new
            last = gamma[:, -1:]
            s = s * last.exp()[:, :, None] + ((last - gamma).exp()[:, :, None] * kc).transpose(1, 2) @ v_new
        state[slot] = s
    return out.transpose(0, 1).to(v.dtype)


def fused_recurrent_gated_delta_rule_update_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """PyTorch twin of :func:`fused_recurrent_gated_delta_rule_update` (vectorised over requests
    and heads; gathers and scatters the slots, no host syncs)."""
    rows, _, vheads, _, _ = _check_inputs(q, k, v, g, beta, state, state_indices)
    check_shape("state_indices", state_indices, (rows,))
    qf, kf = _prepare_qk(q, k, vheads, scale, use_qk_l2norm)
    idx = state_indices.long()
    s = state[idx] * g.float().exp()[:, :, None, None]  # [B, HV, K, V]
    predicted = torch.einsum("bhkv,bhk->bhv", s, kf)
    delta = (v.float() - predicted) * beta.float()[:, :, None]
    s = s + kf[:, :, :, None] * delta[:, :, None, :]
    out = torch.einsum("bhkv,bhk->bhv", s, qf)
    state.index_copy_(0, idx, s)
    return out.to(v.dtype)


# --------------------------------------------------------------------------- Triton kernels


@triton_kernel
def _recurrent_update_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    state_ptr,
    idx_ptr,
    o_ptr,
    scale,
    stride_q_row,
    stride_q_head,
    stride_k_row,
    stride_k_head,
    stride_v_row,
    stride_v_head,
    stride_g_row,
    stride_b_row,
    stride_s_slot,
    HV: tl.constexpr,
    GROUP: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    L2NORM: tl.constexpr,
    EPS: tl.constexpr,
):
    """One (request, value head, V block): the [K, BV] state tile is read once, written once."""
    row = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1)
    vv = tl.program_id(2) * BV + tl.arange(0, BV)
    kk = tl.arange(0, BK)
    k_ok = kk < K
    v_ok = vv < V
    h = hv // GROUP
    q = tl.load(q_ptr + row * stride_q_row + h * stride_q_head + kk, mask=k_ok, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + row * stride_k_row + h * stride_k_head + kk, mask=k_ok, other=0.0).to(tl.float32)
    if L2NORM:
        q = q * tl.rsqrt(tl.sum(q * q, 0) + EPS)
        k = k * tl.rsqrt(tl.sum(k * k, 0) + EPS)
    q = q * scale
    v = tl.load(v_ptr + row * stride_v_row + hv * stride_v_head + vv, mask=v_ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * stride_g_row + hv).to(tl.float32)
    beta = tl.load(beta_ptr + row * stride_b_row + hv).to(tl.float32)
    slot = tl.load(idx_ptr + row).to(tl.int64)
    s_ptrs = state_ptr + slot * stride_s_slot + hv * (K * V) + kk[:, None] * V + vv[None, :]
    s_mask = k_ok[:, None] & v_ok[None, :]
    s = tl.load(s_ptrs, mask=s_mask, other=0.0) * tl.exp(g)
    delta = (v - tl.sum(s * k[:, None], 0)) * beta
    s = s + k[:, None] * delta[None, :]
    o = tl.sum(s * q[:, None], 0)
    tl.store(s_ptrs, s, mask=s_mask)
    tl.store(o_ptr + (row * HV + hv) * V + vv, cast(o, o_ptr.dtype.element_ty), mask=v_ok)


@triton_helper()
def _chunk_rows(cu_ptr, chunk_offsets_ptr, num_seqs, chunk, C: tl.constexpr,
                SEARCH_STEPS: tl.constexpr):
    """Rows ``[start, end)`` of global chunk ``chunk``: its request is the last ``i`` with
    ``chunk_offsets[i] <= chunk`` (requests without chunks share their offset with the next one,
    which wins)."""
    lo = 0
    hi = num_seqs - 1
    for _ in range(SEARCH_STEPS):
        mid = (lo + hi + 1) // 2
        ok = tl.load(chunk_offsets_ptr + mid) <= chunk
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    start = tl.load(cu_ptr + lo) + (chunk - tl.load(chunk_offsets_ptr + lo)) * C
    end = tl.minimum(start + C, tl.load(cu_ptr + lo + 1))
    return start, end


@triton_kernel(do_not_specialize=("num_seqs",), do_not_specialize_on_alignment=("cu_ptr",))
def _chunk_kkt_kernel(
    k_ptr,
    g_ptr,
    beta_ptr,
    cu_ptr,
    chunk_offsets_ptr,
    a_ptr,
    kd_ptr,
    gamma_ptr,
    num_seqs,
    stride_k_row,
    stride_k_head,
    stride_g_row,
    stride_b_row,
    HV: tl.constexpr,
    GROUP: tl.constexpr,
    K: tl.constexpr,
    BK: tl.constexpr,
    C: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    L2NORM: tl.constexpr,
    EPS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One (chunk, value head): γ (cumulative log-decay), A = strictlower(β k kᵀ e^{γi−γj}) into
    a [C, C] scratch tile, and K e^{γ_C−γ} (the keys decayed to the chunk's end)."""
    chunk = tl.program_id(0)
    hv = tl.program_id(1)
    if chunk >= tl.load(chunk_offsets_ptr + num_seqs):
        return
    start, end = _chunk_rows(cu_ptr, chunk_offsets_ptr, num_seqs, chunk, C, SEARCH_STEPS)
    ci = tl.arange(0, C)
    rows = start + ci
    r_ok = rows < end
    rows64 = rows.to(tl.int64)
    kk = tl.arange(0, BK)
    k_mask = r_ok[:, None] & (kk < K)[None, :]
    k = tl.load(k_ptr + rows64[:, None] * stride_k_row + (hv // GROUP) * stride_k_head + kk[None, :],
                mask=k_mask, other=0.0).to(tl.float32)
    if L2NORM:
        k = k * tl.rsqrt(tl.sum(k * k, 1) + EPS)[:, None]
    beta = tl.load(beta_ptr + rows64 * stride_b_row + hv, mask=r_ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + rows64 * stride_g_row + hv, mask=r_ok, other=0.0).to(tl.float32)
    gamma = tl.cumsum(g, 0)
    tl.store(gamma_ptr + rows64 * HV + hv, gamma, mask=r_ok)
    # Rows past the chunk's end are masked too: their γ (0) minus a valid γ would overflow exp.
    strict = (ci[:, None] > ci[None, :]) & r_ok[:, None]
    decay = tl.exp(tl.where(strict, gamma[:, None] - gamma[None, :], 0.0))
    a = tl.where(strict, dot(k * beta[:, None], tl.trans(k), PRECISION) * decay, 0.0)
    tl.store(a_ptr + (chunk.to(tl.int64) * HV + hv) * (C * C) + ci[:, None] * C + ci[None, :], a)
    gamma_last = tl.sum(tl.where(rows == end - 1, gamma, 0.0), 0)
    tl.store(kd_ptr + (rows64[:, None] * HV + hv) * K + kk[None, :],
             k * tl.exp(gamma_last - gamma)[:, None], mask=k_mask)


@triton_kernel(do_not_specialize=("num_seqs",))
def _chunk_solve_kernel(
    a_ptr,
    chunk_offsets_ptr,
    num_seqs,
    HV: tl.constexpr,
    C: tl.constexpr,
    BS: tl.constexpr,
):
    """One (chunk, value head): T = (I + A)⁻¹ over A's [C, C] scratch tile, written in place.

    Blocked forward substitution with BS-row blocks: first the inverses of all C/BS diagonal
    blocks at once (BS − 1 dependent steps on a [C/BS, BS, BS] tile), then block row r of T is
    ``Dr⁻¹ (E_r − A[r, :r] T[:r])`` — two exact float32 products per block row. The dependent
    chain is BS − 1 + C/BS steps instead of C − 1.
    """
    chunk = tl.program_id(0)
    hv = tl.program_id(1)
    if chunk >= tl.load(chunk_offsets_ptr + num_seqs):
        return
    NB: tl.constexpr = C // BS
    base = a_ptr + (chunk.to(tl.int64) * HV + hv) * (C * C)
    nb = tl.arange(0, NB)
    ri = tl.arange(0, BS)
    # Stage 1: D_b⁻¹ for every diagonal block b; row s = e_s − Σ_{j<s} D_b[s, j] D_b⁻¹[j].
    diag = (nb[:, None, None] * BS + ri[None, :, None]) * C + nb[:, None, None] * BS + ri[None, None, :]
    dinv = tl.where(ri[None, :, None] == ri[None, None, :], 1.0, 0.0) + tl.zeros([NB, BS, BS], tl.float32)
    for s in range(1, BS):
        d_s = tl.load(base + (nb[:, None] * BS + s) * C + nb[:, None] * BS + ri[None, :])  # [NB, BS]
        row = tl.where(ri[None, :] == s, 1.0, 0.0) - tl.sum(d_s[:, :, None] * dinv, 1)
        dinv = tl.where(ri[None, :, None] == s, row[:, None, :], dinv)
    tl.debug_barrier()  # every thread has read the diagonal blocks of A
    tl.store(base + diag, dinv)  # D_b⁻¹ replaces D_b (A's diagonal blocks are no longer needed)
    tl.debug_barrier()
    # Stage 2: block rows in order; rows of T replace rows of A as they are done.
    cols = tl.arange(0, C)
    for r in tl.static_range(NB):
        rows = r * BS + ri
        rhs = tl.where(rows[:, None] == cols[None, :], 1.0, 0.0)  # E_r
        if r > 0:
            a_r = tl.load(base + rows[:, None] * C + cols[None, :],
                          mask=(cols < r * BS)[None, :], other=0.0)
            t_done = tl.load(base + cols[:, None] * C + cols[None, :],
                             mask=(cols < r * BS)[:, None], other=0.0)
            rhs = rhs - dot(a_r, t_done, "ieee")
        d_inv = tl.load(base + rows[:, None] * C + r * BS + ri[None, :])
        t_r = dot(d_inv, rhs, "ieee")
        tl.debug_barrier()  # the block row's A (and D_r⁻¹) are read before T overwrites them
        tl.store(base + rows[:, None] * C + cols[None, :], t_r)
        tl.debug_barrier()  # the next block row reads these rows of T


@triton_kernel(do_not_specialize=("num_seqs",), do_not_specialize_on_alignment=("cu_ptr",))
def _chunk_wu_kernel(
    k_ptr,
    v_ptr,
    beta_ptr,
    gamma_ptr,
    t_ptr,
    cu_ptr,
    chunk_offsets_ptr,
    w_ptr,
    u_ptr,
    num_seqs,
    stride_k_row,
    stride_k_head,
    stride_v_row,
    stride_v_head,
    stride_b_row,
    HV: tl.constexpr,
    GROUP: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    C: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    L2NORM: tl.constexpr,
    EPS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One (chunk, value head): W = T (β e^γ K) and U = T (β V), float32 scratch."""
    chunk = tl.program_id(0)
    hv = tl.program_id(1)
    if chunk >= tl.load(chunk_offsets_ptr + num_seqs):
        return
    start, end = _chunk_rows(cu_ptr, chunk_offsets_ptr, num_seqs, chunk, C, SEARCH_STEPS)
    ci = tl.arange(0, C)
    rows = start + ci
    r_ok = rows < end
    rows64 = rows.to(tl.int64)
    t = tl.load(t_ptr + (chunk.to(tl.int64) * HV + hv) * (C * C) + ci[:, None] * C + ci[None, :])
    kk = tl.arange(0, BK)
    k_mask = r_ok[:, None] & (kk < K)[None, :]
    k = tl.load(k_ptr + rows64[:, None] * stride_k_row + (hv // GROUP) * stride_k_head + kk[None, :],
                mask=k_mask, other=0.0).to(tl.float32)
    if L2NORM:
        k = k * tl.rsqrt(tl.sum(k * k, 1) + EPS)[:, None]
    beta = tl.load(beta_ptr + rows64 * stride_b_row + hv, mask=r_ok, other=0.0).to(tl.float32)
    gamma = tl.load(gamma_ptr + rows64 * HV + hv, mask=r_ok, other=0.0)
    out_rows = rows64[:, None] * HV + hv
    w = dot(t, k * (beta * tl.exp(gamma))[:, None], PRECISION)
    tl.store(w_ptr + out_rows * K + kk[None, :], w, mask=k_mask)
    for vb in tl.static_range(0, V, BV):  # U in V blocks: fewer live registers
        vv = vb + tl.arange(0, BV)
        v_mask = r_ok[:, None] & (vv < V)[None, :]
        v = tl.load(v_ptr + rows64[:, None] * stride_v_row + hv * stride_v_head + vv[None, :],
                    mask=v_mask, other=0.0).to(tl.float32)
        u = dot(t, v * beta[:, None], PRECISION)
        tl.store(u_ptr + out_rows * V + vv[None, :], u, mask=v_mask)


@triton_kernel(do_not_specialize_on_alignment=PER_REQUEST_VIEWS)
def _chunk_state_kernel(
    kd_ptr,
    w_ptr,
    u_ptr,
    gamma_ptr,
    h_ptr,
    state_ptr,
    idx_ptr,
    cu_ptr,
    init_ptr,
    chunk_offsets_ptr,
    stride_s_slot,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    C: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One (request, value head, V block), the only sequential part: walks the request's chunks
    carrying S [K, BV] in registers; saves each chunk's entry state to ``h``, turns U into
    V' = U − W S in place, and writes the final state."""
    seq = tl.program_id(0)
    hv = tl.program_id(1)
    vv = tl.program_id(2) * BV + tl.arange(0, BV)
    kk = tl.arange(0, BK)
    k_ok = kk < K
    v_ok = vv < V
    start = tl.load(cu_ptr + seq)
    end = tl.load(cu_ptr + seq + 1)
    slot = tl.load(idx_ptr + seq).to(tl.int64)
    has_init = tl.load(init_ptr + seq) != 0
    s_off = kk[:, None] * V + vv[None, :]
    s_mask = k_ok[:, None] & v_ok[None, :]
    s_ptrs = state_ptr + slot * stride_s_slot + hv * (K * V) + s_off
    s = tl.load(s_ptrs, mask=s_mask, other=0.0)
    s = tl.where(has_init, s, 0.0)  # a fresh slot's contents (even NaN) never enter
    chunk = tl.load(chunk_offsets_ptr + seq).to(tl.int64)
    ci = tl.arange(0, C)
    for c0 in range(start, end, C):
        tl.store(h_ptr + (chunk * HV + hv) * (K * V) + s_off, cast(s, h_ptr.dtype.element_ty),
                 mask=s_mask)
        rows = c0 + ci
        r_ok = rows < end
        rows64 = rows.to(tl.int64)
        k_mask = r_ok[:, None] & k_ok[None, :]
        out_rows = rows64[:, None] * HV + hv
        last = tl.minimum(c0 + C, end) - 1
        gamma_last = tl.load(gamma_ptr + last.to(tl.int64) * HV + hv)
        w = tl.load(w_ptr + out_rows * K + kk[None, :], mask=k_mask, other=0.0)
        u_ptrs = u_ptr + out_rows * V + vv[None, :]
        u_mask = r_ok[:, None] & v_ok[None, :]
        v_new = tl.load(u_ptrs, mask=u_mask, other=0.0) - dot(w, s, PRECISION)
        tl.store(u_ptrs, v_new, mask=u_mask)
        k_decayed = tl.load(kd_ptr + out_rows * K + kk[None, :], mask=k_mask, other=0.0)
        s = s * tl.exp(gamma_last) + dot(tl.trans(k_decayed), v_new, PRECISION)
        chunk += 1
    tl.store(s_ptrs, s, mask=s_mask)


@triton_kernel(do_not_specialize=("num_seqs",), do_not_specialize_on_alignment=("cu_ptr",))
def _chunk_output_kernel(
    q_ptr,
    k_ptr,
    v_new_ptr,
    gamma_ptr,
    h_ptr,
    cu_ptr,
    chunk_offsets_ptr,
    o_ptr,
    num_seqs,
    scale,
    stride_q_row,
    stride_q_head,
    stride_k_row,
    stride_k_head,
    HV: tl.constexpr,
    GROUP: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    C: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    L2NORM: tl.constexpr,
    EPS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One (chunk, value head, V block), all in parallel:
    O = (Q e^γ) S_entry + lower(Q Kᵀ ⊙ e^{γ_i−γ_j}) V'."""
    chunk = tl.program_id(0)
    hv = tl.program_id(1)
    vv = tl.program_id(2) * BV + tl.arange(0, BV)
    if chunk >= tl.load(chunk_offsets_ptr + num_seqs):
        return
    start, end = _chunk_rows(cu_ptr, chunk_offsets_ptr, num_seqs, chunk, C, SEARCH_STEPS)
    ci = tl.arange(0, C)
    rows = start + ci
    r_ok = rows < end
    rows64 = rows.to(tl.int64)
    kk = tl.arange(0, BK)
    k_ok = kk < K
    v_ok = vv < V
    h = hv // GROUP
    qk_mask = r_ok[:, None] & k_ok[None, :]
    q = tl.load(q_ptr + rows64[:, None] * stride_q_row + h * stride_q_head + kk[None, :],
                mask=qk_mask, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + rows64[:, None] * stride_k_row + h * stride_k_head + kk[None, :],
                mask=qk_mask, other=0.0).to(tl.float32)
    if L2NORM:
        q = q * tl.rsqrt(tl.sum(q * q, 1) + EPS)[:, None]
        k = k * tl.rsqrt(tl.sum(k * k, 1) + EPS)[:, None]
    q = q * scale
    gamma = tl.load(gamma_ptr + rows64 * HV + hv, mask=r_ok, other=0.0)
    causal = (ci[:, None] >= ci[None, :]) & r_ok[:, None]  # rows past the end: exp would overflow
    decay = tl.exp(tl.where(causal, gamma[:, None] - gamma[None, :], 0.0))
    attn = tl.where(causal, dot(q, tl.trans(k), PRECISION) * decay, 0.0)
    s_mask = k_ok[:, None] & v_ok[None, :]
    s = tl.load(h_ptr + (chunk.to(tl.int64) * HV + hv) * (K * V) + kk[:, None] * V + vv[None, :],
                mask=s_mask, other=0.0).to(tl.float32)
    out_rows = rows64[:, None] * HV + hv
    o_mask = r_ok[:, None] & v_ok[None, :]
    v_new = tl.load(v_new_ptr + out_rows * V + vv[None, :], mask=o_mask, other=0.0)
    o = dot(q * tl.exp(gamma)[:, None], s, PRECISION) + dot(attn, v_new, PRECISION)
    tl.store(o_ptr + out_rows * V + vv[None, :], cast(o, o_ptr.dtype.element_ty), mask=o_mask)


def _check_state_layout(state: torch.Tensor) -> None:
    _, vheads, kdim, vdim = state.shape
    if state.stride()[1:] != (kdim * vdim, vdim, 1):
        raise ValueError("each slot of state must be contiguous ([HV, K, V] row-major)")


def _check_rows(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        check_contiguous_last_dim(name, t)


# Launch shapes of the chunk kernels (V block widths, pipelining of the state kernel's loop).
# tests/kernels/test_gdn_kernels_compile.py compiles the kernels with these for sm_90 and
# gfx942 offline and checks they fit (the default 3 stages of the state kernel need 232 KiB of
# shared memory at C = 64, K = 128: more than an H100/H200 block may have).
_PREPARE_BV = 32
_SOLVE_WARPS = 4
_SOLVE_BLOCK = 16  # rows per block of the blocked forward substitution (tl.dot needs >= 16)
_STATE_BV = 32
_STATE_STAGES = 2
_OUTPUT_BV = 64


def _warps(chunk_size: int, block_k: int) -> int:
    """Warps for the chunk kernels: their [C, K] float32 tiles spill registers below 8 warps at
    C = 64, K = 128 (ptxas resource usage for sm_90, checked offline)."""
    return 8 if chunk_size * block_k >= 4096 else 4


def _chunk_triton(q, k, v, g, beta, scale, state, state_indices, cu_seqlens, has_initial_state,
                  use_qk_l2norm, chunk_size) -> torch.Tensor:
    rows, heads, vheads, kdim, vdim = _check_inputs(q, k, v, g, beta, state, state_indices)
    batch = state_indices.shape[0]
    _check_varlen(cu_seqlens, has_initial_state, batch)
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"chunk_size must be 16, 32 or 64 for the Triton kernel, got {chunk_size}")
    _check_state_layout(state)
    _check_rows(q=q, k=k, v=v)
    if g.stride(1) != 1 or beta.stride(1) != 1:
        raise ValueError("g and beta must be contiguous in their head dimension")
    device = q.device
    out = torch.empty(rows, vheads, vdim, dtype=v.dtype, device=device)
    if batch == 0:
        return out
    # The chunk -> request map, on the device: no host sync, grid sized from shapes only.
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int32)
    chunk_offsets = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    torch.cumsum((lengths + chunk_size - 1) // chunk_size, 0, out=chunk_offsets[1:])
    w = torch.empty(rows, vheads, kdim, dtype=torch.float32, device=device)
    kd = torch.empty_like(w)
    u = torch.empty(rows, vheads, vdim, dtype=torch.float32, device=device)
    gamma = torch.empty(rows, vheads, dtype=torch.float32, device=device)
    bk = next_power_of_2(kdim)
    bv_full = next_power_of_2(vdim)
    precision = dot_precision(v.dtype)
    group = vheads // heads
    search = search_steps(batch)
    max_chunks = rows // chunk_size + batch  # >= sum(ceil(len_i / C)) whatever the lengths
    # Entry state of every chunk, in the activation dtype for 16-bit models (halves the scratch;
    # it only feeds the output product), float32 otherwise.
    h = torch.empty(max_chunks, vheads, kdim, vdim, device=device,
                    dtype=torch.float32 if v.dtype == torch.float32 else v.dtype)
    if rows:
        grid = (max_chunks, vheads)
        a_scratch = torch.empty(max_chunks, vheads, chunk_size, chunk_size, dtype=torch.float32,
                                device=device)
        warps = _warps(chunk_size, bk)
        _chunk_kkt_kernel.on(device)[grid](
            k, g, beta, cu_seqlens, chunk_offsets, a_scratch, kd, gamma, batch,
            k.stride(0), k.stride(1), g.stride(0), beta.stride(0),
            HV=vheads, GROUP=group, K=kdim, BK=bk, C=chunk_size, SEARCH_STEPS=search,
            L2NORM=use_qk_l2norm, EPS=L2NORM_EPS, PRECISION=precision, num_warps=warps,
        )
        _chunk_solve_kernel.on(device)[grid](  # T = (I + A)⁻¹, in place
            a_scratch, chunk_offsets, batch, HV=vheads, C=chunk_size, BS=_SOLVE_BLOCK,
            num_warps=_SOLVE_WARPS,
        )
        _chunk_wu_kernel.on(device)[grid](
            k, v, beta, gamma, a_scratch, cu_seqlens, chunk_offsets, w, u, batch,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), beta.stride(0),
            HV=vheads, GROUP=group, K=kdim, V=vdim, BK=bk, BV=min(_PREPARE_BV, bv_full),
            C=chunk_size, SEARCH_STEPS=search, L2NORM=use_qk_l2norm, EPS=L2NORM_EPS,
            PRECISION=precision, num_warps=warps,
        )
    bv = min(_STATE_BV, bv_full)
    _chunk_state_kernel.on(device)[(batch, vheads, cdiv(vdim, bv))](
        kd, w, u, gamma, h, state, state_indices, cu_seqlens, has_initial_state.view(torch.uint8),
        chunk_offsets, state.stride(0),
        HV=vheads, K=kdim, V=vdim, BK=bk, BV=bv, C=chunk_size, PRECISION=precision,
        num_warps=_warps(chunk_size, bk), num_stages=_STATE_STAGES,
    )
    if rows:
        bvo = min(_OUTPUT_BV, bv_full)
        _chunk_output_kernel.on(device)[(max_chunks, vheads, cdiv(vdim, bvo))](
            q, k, u, gamma, h, cu_seqlens, chunk_offsets, out, batch, scale,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            HV=vheads, GROUP=group, K=kdim, V=vdim, BK=bk, BV=bvo, C=chunk_size,
            SEARCH_STEPS=search, L2NORM=use_qk_l2norm, EPS=L2NORM_EPS, PRECISION=precision,
            num_warps=_warps(chunk_size, bk),
        )
    return out


def _recurrent_triton(q, k, v, g, beta, scale, state, state_indices, use_qk_l2norm) -> torch.Tensor:
    rows, heads, vheads, kdim, vdim = _check_inputs(q, k, v, g, beta, state, state_indices)
    check_shape("state_indices", state_indices, (rows,))
    _check_state_layout(state)
    _check_rows(q=q, k=k, v=v)
    if g.stride(1) != 1 or beta.stride(1) != 1:
        raise ValueError("g and beta must be contiguous in their head dimension")
    out = torch.empty(rows, vheads, vdim, dtype=v.dtype, device=q.device)
    if rows == 0:
        return out
    bk = next_power_of_2(kdim)
    # [K, BV] float32 tiles of 16 KiB at K = 128; narrower when there are few requests, so the
    # grid still covers the device.
    bv = min(32, next_power_of_2(vdim))
    if rows * vheads * cdiv(vdim, bv) < 2 * num_compute_units(q.device):
        bv = min(16, bv)
    _recurrent_update_kernel.on(q.device)[(rows, vheads, cdiv(vdim, bv))](
        q, k, v, g, beta, state, state_indices, out, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), beta.stride(0), state.stride(0),
        HV=vheads, GROUP=vheads // heads, K=kdim, V=vdim, BK=bk, BV=bv, L2NORM=use_qk_l2norm,
        EPS=L2NORM_EPS, num_warps=4,
    )
    return out


# --------------------------------------------------------------------------- public entry points


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    has_initial_state: torch.Tensor,
    use_qk_l2norm: bool = True,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """Prefill: the gated delta rule over the concatenated requests, chunked. ``q, k [T, H, K]``,
    ``v [T, HV, V]``, ``g, beta [T, HV]``; ``state [S, HV, K, V]`` float32 pool read from and
    written back to ``state_indices``. Returns ``o [T, HV, V]`` in ``v``'s dtype."""
    if not use_triton(q.device):
        return chunk_gated_delta_rule_ref(q, k, v, g, beta, scale, state, state_indices, cu_seqlens,
                                          has_initial_state, use_qk_l2norm, chunk_size)
    return _chunk_triton(q, k, v, g, beta, scale, state, state_indices, cu_seqlens,
                         has_initial_state, use_qk_l2norm, chunk_size)


def fused_recurrent_gated_delta_rule_update(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """Decode: one token per request (``q, k [B, H, K]``, ``v [B, HV, V]``, ``g, beta [B, HV]``),
    state slot ``state_indices[b]`` updated in place. Returns ``o [B, HV, V]`` in ``v``'s dtype."""
    if not use_triton(q.device):
        return fused_recurrent_gated_delta_rule_update_ref(q, k, v, g, beta, scale, state,
                                                           state_indices, use_qk_l2norm)
    return _recurrent_triton(q, k, v, g, beta, scale, state, state_indices, use_qk_l2norm)
