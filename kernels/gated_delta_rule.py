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

* ``chunk_gated_delta_rule``: kernel 1, parallel over (chunk, value head), forms ``M`` in
  registers, inverts it by forward substitution and writes ``W``, ``U`` and ``γ`` (float32
  scratch); kernel 2, parallel over (request, value head, V block), walks the request's chunks
  carrying ``S`` in registers and writes ``O`` and the final state. The chunk → request map is
  built on the device (no host sync); the grid is sized from shapes only.
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
    cast,
    cdiv,
    check_contiguous_last_dim,
    check_dtype,
    check_same_device,
    check_shape,
    dot,
    next_power_of_2,
    tl,
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
    raise NotImplementedError("Triton chunked gated delta rule: not written yet")


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
    raise NotImplementedError("Triton recurrent gated delta rule: not written yet")
