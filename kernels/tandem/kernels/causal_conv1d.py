"""Causal depthwise conv1d with per-request state slots (the short convolution of Gated DeltaNet).

Each channel ``d`` of a request's inputs is convolved with its own ``W``-tap filter over the
request's history: ``y_t = act(sum_j weight[d, j] * seq[t + j] + bias[d])`` where ``seq`` is the
request's last ``W - 1`` earlier inputs (its conv state) followed by this step's inputs — the same
cross-correlation as ``F.conv1d(..., padding=W-1, groups=D)`` in Hugging Face's Qwen3-Next, so
``weight[:, W-1]`` multiplies the current token.

State lives in a slot pool ``conv_state[S, D, W-1]`` indexed by ``state_indices`` (one slot per
request; padded CUDA-graph rows point at the pool's scratch slot). After a call the slot holds the
request's last ``W - 1`` inputs; when a prefill chunk is shorter than ``W - 1`` the older state is
shifted in front of it. ``has_initial_state[i] = False`` treats the history as zeros, whatever a
fresh slot holds.

Roundings follow Hugging Face: the conv is accumulated in float32, bias added, rounded to the
activation dtype, then SiLU in float32 and rounded again.

Bytes moved: prefill reads ``T·D·e`` (each input once; the ``W`` taps reuse it from cache) and
writes ``T·D·e``; the single-token update reads and writes ``D·(W-1)`` state elements per request
besides its ``D`` inputs and outputs. Both are bandwidth-bound and launched as one kernel for all
requests (the prefill adds a second tiny launch for the state write-back).

Dispatch: the public functions run Triton on CUDA, or on CPU when ``TRITON_INTERPRET=1`` is set;
otherwise the PyTorch twins (``*_ref``, same signatures) run.
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
    interpreter_enabled,
    next_power_of_2,
    search_steps,
    tl,
    triton_available,
    triton_kernel,
)

__all__ = [
    "causal_conv1d_prefill",
    "causal_conv1d_prefill_ref",
    "causal_conv1d_update",
    "causal_conv1d_update_ref",
    "use_triton",
]

_ACTIVATIONS = (None, "silu")
# Tiles: prefill programs cover BLOCK_T tokens x BLOCK_D channels (16 x 64: no register spills
# on sm_90 at 4 warps; 32 x 128 spilled), the update one row's BLOCK_D.
_PREFILL_BLOCK_T = 16
_PREFILL_BLOCK_D = 64
_UPDATE_BLOCK_D = 256


def use_triton(device: torch.device) -> bool:
    """True when the GDN kernels should run as Triton on ``device``: CUDA/ROCm, or CPU with the
    interpreter switched on (tests); plain CPU runs the PyTorch twins."""
    if device.type == "cuda":
        return True
    return device.type == "cpu" and triton_available() and interpreter_enabled()


def _taps(windows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``sum_j windows[..., j] * weight[:, j]`` in float32, taps summed in order (as the kernels
    do, so one-go, chunked and token-by-token results agree bit for bit)."""
    w = weight.float()
    acc = torch.zeros(windows.shape[:-1], dtype=torch.float32, device=windows.device)
    for j in range(windows.shape[-1]):
        acc = acc + windows[..., j] * w[:, j]
    return acc


def _activate(y: torch.Tensor, activation: str | None, dtype: torch.dtype) -> torch.Tensor:
    """Round the float32 conv result to ``dtype``, apply the activation in float32, round again."""
    y = y.to(dtype)
    if activation == "silu":
        y = torch.nn.functional.silu(y.float()).to(dtype)
    return y


# --------------------------------------------------------------------------- argument checks


def _check_common(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    activation: str | None,
) -> tuple[int, int]:
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {_ACTIVATIONS}, got {activation!r}")
    check_dtype("x", x, FLOAT_DTYPES)
    check_dtype("weight", weight, FLOAT_DTYPES)
    check_dtype("conv_state", conv_state, FLOAT_DTYPES)
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, D], got {list(x.shape)}")
    dim = x.shape[1]
    if weight.dim() != 2 or weight.shape[0] != dim or weight.shape[1] < 2:
        raise ValueError(f"weight must be [D={dim}, W>=2], got {list(weight.shape)}")
    width = weight.shape[1]
    check_shape("conv_state", conv_state, (None, dim, width - 1))
    if bias is not None:
        check_dtype("bias", bias, FLOAT_DTYPES)
        check_shape("bias", bias, (dim,))
    check_dtype("state_indices", state_indices, (torch.int32, torch.int64))
    if state_indices.dim() != 1:
        raise ValueError(f"state_indices must be 1-D, got {list(state_indices.shape)}")
    check_contiguous_last_dim("x", x)
    tensors = {"x": x, "weight": weight, "conv_state": conv_state, "state_indices": state_indices}
    if bias is not None:
        tensors["bias"] = bias
    check_same_device(**tensors)
    return dim, width


def _check_varlen(cu_seqlens: torch.Tensor, has_initial_state: torch.Tensor, batch: int) -> None:
    check_dtype("cu_seqlens", cu_seqlens, (torch.int32, torch.int64))
    check_shape("cu_seqlens", cu_seqlens, (batch + 1,))
    check_dtype("has_initial_state", has_initial_state, (torch.bool,))
    check_shape("has_initial_state", has_initial_state, (batch,))


# --------------------------------------------------------------------------- PyTorch twins


def causal_conv1d_prefill_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """PyTorch twin of :func:`causal_conv1d_prefill` (one request at a time; host syncs)."""
    dim, width = _check_common(x, weight, bias, conv_state, state_indices, activation)
    batch = state_indices.shape[0]
    _check_varlen(cu_seqlens, has_initial_state, batch)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    bounds = cu_seqlens.tolist()
    slots = state_indices.tolist()
    has_init = has_initial_state.tolist()
    for i in range(batch):
        start, end = bounds[i], bounds[i + 1]
        slot = slots[i]
        if has_init[i]:
            history = conv_state[slot].float()
        else:
            history = torch.zeros(dim, width - 1, device=x.device)
        seq = torch.cat([history, x[start:end].float().t()], dim=1)  # [D, W-1+L]
        length = end - start
        if length:
            windows = seq.unfold(1, width, 1).transpose(0, 1)  # [L, D, W]
            acc = _taps(windows, weight)
            if bias is not None:
                acc = acc + bias.float()
            y[start:end] = _activate(acc, activation, x.dtype)
        conv_state[slot] = seq[:, seq.shape[1] - (width - 1) :].to(conv_state.dtype)
    return y


def causal_conv1d_update_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """PyTorch twin of :func:`causal_conv1d_update` (vectorised; no host syncs)."""
    _check_common(x, weight, bias, conv_state, state_indices, activation)
    check_shape("state_indices", state_indices, (x.shape[0],))
    idx = state_indices.long()
    seq = torch.cat([conv_state[idx].float(), x.float()[:, :, None]], dim=2)  # [B, D, W]
    acc = _taps(seq, weight)
    if bias is not None:
        acc = acc + bias.float()[None]
    conv_state.index_copy_(0, idx, seq[:, :, 1:].to(conv_state.dtype))
    return _activate(acc, activation, x.dtype)


# --------------------------------------------------------------------------- Triton kernels


@triton_kernel(do_not_specialize=("num_tokens", "num_seqs"),
               do_not_specialize_on_alignment=PER_REQUEST_VIEWS)
def _conv_prefill_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    state_ptr,
    idx_ptr,
    cu_ptr,
    init_ptr,
    y_ptr,
    num_tokens,
    num_seqs,
    dim,
    stride_x,
    stride_s_slot,
    stride_s_dim,
    W: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ch = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    tok_ok = tok < num_tokens
    ch_ok = ch < dim
    # Each token's request: the last i with cu_seqlens[i] <= tok (binary search, fixed steps;
    # empty requests share their start with the next one, which wins).
    lo = tl.zeros([BLOCK_T], dtype=tl.int32)
    hi = tl.zeros([BLOCK_T], dtype=tl.int32) + (num_seqs - 1)
    for _ in range(SEARCH_STEPS):
        mid = (lo + hi + 1) // 2
        ok = tl.load(cu_ptr + mid, mask=tok_ok, other=0) <= tok
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    seq = lo
    start = tl.load(cu_ptr + seq, mask=tok_ok, other=0)
    slot = tl.load(idx_ptr + seq, mask=tok_ok, other=0).to(tl.int64)
    has_init = tl.load(init_ptr + seq, mask=tok_ok, other=0) != 0
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(W):
        pos = tok - (W - 1) + j  # input position this tap reads
        in_chunk = pos >= start
        xv = tl.load(
            x_ptr + pos.to(tl.int64)[:, None] * stride_x + ch[None, :],
            mask=(tok_ok & in_chunk)[:, None] & ch_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        # Before the chunk: column (W-1) + (pos - start) of the request's state, when it has one.
        col = (W - 1) + pos - start
        from_state = tok_ok & (~in_chunk) & has_init
        sv = tl.load(
            state_ptr + (slot * stride_s_slot + col)[:, None] + ch[None, :].to(tl.int64) * stride_s_dim,
            mask=from_state[:, None] & ch_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        wj = tl.load(w_ptr + ch * W + j, mask=ch_ok, other=0.0).to(tl.float32)
        acc += (xv + sv) * wj[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + ch, mask=ch_ok, other=0.0).to(tl.float32)[None, :]
    out = cast(acc, y_ptr.dtype.element_ty)
    if SILU:
        o = out.to(tl.float32)
        out = cast(o / (1.0 + tl.exp(-o)), y_ptr.dtype.element_ty)
    mask = tok_ok[:, None] & ch_ok[None, :]
    tl.store(y_ptr + tok.to(tl.int64)[:, None] * dim + ch[None, :], out, mask=mask)


@triton_kernel(do_not_specialize_on_alignment=PER_REQUEST_VIEWS)
def _conv_state_writeback_kernel(
    x_ptr,
    state_ptr,
    idx_ptr,
    cu_ptr,
    init_ptr,
    dim,
    stride_x,
    stride_s_slot,
    stride_s_dim,
    W: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """New state of request ``i``: its last W-1 inputs, older state shifted in when short."""
    i = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ch_ok = ch < dim
    # Per-request scalars as [BLOCK_D] vectors: Triton's interpreter mis-types `vector & scalar`
    # boolean masks.
    zero = ch * 0
    start = zero + tl.load(cu_ptr + i)
    end = zero + tl.load(cu_ptr + i + 1)
    slot = tl.load(idx_ptr + i).to(tl.int64)
    has_init = (zero + tl.load(init_ptr + i)) != 0
    base = state_ptr + slot * stride_s_slot + ch.to(tl.int64) * stride_s_dim
    # In place, column by column: column c reads old column c + len >= c, never one already
    # written; every [BLOCK_D] vector has the same layout, so each channel stays in one thread.
    for c in tl.static_range(W - 1):
        pos = end - (W - 1) + c
        xv = tl.load(x_ptr + pos.to(tl.int64) * stride_x + ch, mask=ch_ok & (pos >= start),
                     other=0.0)
        old = (W - 1) + pos - start
        sv = tl.load(base + old, mask=ch_ok & (pos < start) & has_init, other=0.0)
        new = tl.where(pos >= start, xv.to(tl.float32), sv.to(tl.float32))
        tl.store(base + c, cast(new, state_ptr.dtype.element_ty), mask=ch_ok)


@triton_kernel
def _conv_update_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    state_ptr,
    idx_ptr,
    y_ptr,
    dim,
    stride_x,
    stride_s_slot,
    stride_s_dim,
    W: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ch_ok = ch < dim
    slot = tl.load(idx_ptr + row).to(tl.int64)
    base = state_ptr + slot * stride_s_slot + ch.to(tl.int64) * stride_s_dim
    xv = tl.load(x_ptr + row.to(tl.int64) * stride_x + ch, mask=ch_ok, other=0.0)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(W - 1):  # taps in order, as the prefill kernel sums them
        sv = tl.load(base + j, mask=ch_ok, other=0.0).to(tl.float32)
        acc += sv * tl.load(w_ptr + ch * W + j, mask=ch_ok, other=0.0).to(tl.float32)
    acc += xv.to(tl.float32) * tl.load(w_ptr + ch * W + (W - 1), mask=ch_ok, other=0.0).to(tl.float32)
    # Shift left by one in place (each channel's column j+1 is read before it is overwritten, by
    # the same thread) and append the new input.
    for j in tl.static_range(W - 2):
        tl.store(base + j, tl.load(base + j + 1, mask=ch_ok, other=0.0), mask=ch_ok)
    tl.store(base + (W - 2), cast(xv.to(tl.float32), state_ptr.dtype.element_ty), mask=ch_ok)
    if HAS_BIAS:
        acc += tl.load(b_ptr + ch, mask=ch_ok, other=0.0).to(tl.float32)
    out = cast(acc, y_ptr.dtype.element_ty)
    if SILU:
        o = out.to(tl.float32)
        out = cast(o / (1.0 + tl.exp(-o)), y_ptr.dtype.element_ty)
    tl.store(y_ptr + row.to(tl.int64) * dim + ch, out, mask=ch_ok)


def _check_state_layout(conv_state: torch.Tensor, weight: torch.Tensor) -> None:
    if conv_state.stride(2) != 1 and conv_state.shape[2] > 1:
        raise ValueError("conv_state must be contiguous in its last dimension")
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous")


def causal_conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Causal depthwise conv over the concatenated requests of a prefill step.

    ``x [T, D]`` (rows may be strided, e.g. a slice of a projection); ``weight [D, W]``;
    ``bias [D]`` or None; ``conv_state [S, D, W-1]`` slot pool, updated in place; request ``i``
    owns rows ``cu_seqlens[i]:cu_seqlens[i+1]`` and slot ``state_indices[i]``. Returns a new
    contiguous ``y [T, D]`` in ``x``'s dtype. No host syncs.
    """
    if not use_triton(x.device):
        return causal_conv1d_prefill_ref(x, weight, bias, conv_state, state_indices, cu_seqlens,
                                         has_initial_state, activation)
    dim, width = _check_common(x, weight, bias, conv_state, state_indices, activation)
    batch = state_indices.shape[0]
    _check_varlen(cu_seqlens, has_initial_state, batch)
    _check_state_layout(conv_state, weight)
    tokens = x.shape[0]
    y = torch.empty(tokens, dim, dtype=x.dtype, device=x.device)
    if batch == 0:
        return y
    block_d = min(_PREFILL_BLOCK_D, next_power_of_2(dim))
    block_t = _PREFILL_BLOCK_T
    if tokens:
        grid = (cdiv(tokens, block_t), cdiv(dim, block_d))
        _conv_prefill_kernel.on(x.device)[grid](
            x, weight, bias if bias is not None else weight, conv_state, state_indices, cu_seqlens,
            has_initial_state.view(torch.uint8), y, tokens, batch, dim, x.stride(0), conv_state.stride(0),
            conv_state.stride(1), W=width, HAS_BIAS=bias is not None, SILU=activation == "silu",
            SEARCH_STEPS=search_steps(batch), BLOCK_T=block_t, BLOCK_D=block_d, num_warps=4,
        )
    _conv_state_writeback_kernel.on(x.device)[(batch, cdiv(dim, block_d))](
        x, conv_state, state_indices, cu_seqlens, has_initial_state.view(torch.uint8), dim, x.stride(0),
        conv_state.stride(0), conv_state.stride(1), W=width, BLOCK_D=block_d, num_warps=4,
    )
    return y


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One decode token per request: ``x [B, D]``, state slot ``state_indices[b]`` shifted by one
    in place. Returns ``y [B, D]``. One launch, no host syncs, no value-dependent allocation
    (CUDA-graph capturable)."""
    if not use_triton(x.device):
        return causal_conv1d_update_ref(x, weight, bias, conv_state, state_indices, activation)
    dim, width = _check_common(x, weight, bias, conv_state, state_indices, activation)
    check_shape("state_indices", state_indices, (x.shape[0],))
    _check_state_layout(conv_state, weight)
    batch = x.shape[0]
    y = torch.empty(batch, dim, dtype=x.dtype, device=x.device)
    if batch == 0:
        return y
    block_d = min(_UPDATE_BLOCK_D, next_power_of_2(dim))
    _conv_update_kernel.on(x.device)[(batch, cdiv(dim, block_d))](
        x, weight, bias if bias is not None else weight, conv_state, state_indices, y, dim,
        x.stride(0), conv_state.stride(0), conv_state.stride(1), W=width,
        HAS_BIAS=bias is not None, SILU=activation == "silu", BLOCK_D=block_d, num_warps=4,
    )
    return y
