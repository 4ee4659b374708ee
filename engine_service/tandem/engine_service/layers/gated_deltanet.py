"""Gated DeltaNet (the linear-attention layer of Qwen3-Next and Qwen3.5) over per-request state slots.

One layer, token-major over the step's flat batch (`T` rows, request i owning rows
`query_start_loc[i]:query_start_loc[i+1]`):

1. Projections. Qwen3-Next packs them as `in_proj_qkvz` (per key head: q, k, then its
   `HV / H` value heads' v and z) and `in_proj_ba` (per key head: its b then its a); Qwen3.5
   keeps them apart (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`). Both end as
   `qkv [T, 2 H K + HV V]` (q, k, v laid out head after head), `z [T, HV, V]`, `b, a [T, HV]`.
2. A causal depthwise convolution (width W, SiLU) over `qkv`, continuing from the last
   `W - 1` inputs of the request kept in its conv-state slot.
3. The gated delta rule over (L2-normalised q, k; v; decay `g = -exp(A_log) softplus(a + dt_bias)`;
   `beta = sigmoid(b)`), continuing the request's recurrent state `[HV, K, V]` (float32).
4. Gated RMSNorm per value head (`norm(o) * silu(z)`), then `out_proj`.

State lives in two pools per layer, indexed by `metadata.state_indices` (one slot per request):
conv state `[slots + 1, conv_dim, W - 1]` in the model dtype, recurrent state
`[slots + 1, HV, K, V]` in float32 (the extra slot is CUDA-graph scratch). A request whose
`has_initial_state` is False (first chunk after admission or resume) starts from zeros whatever
its slot holds.

Which kernels a row takes depends on the row alone, never on the rest of the step: a *state
decode* (one scheduled token, `has_initial_state`) runs the single-token kernels
(`causal_conv1d_update`, `fused_recurrent_gated_delta_rule_update`), every other row (prompt
chunks, fresh rows, including a fresh one-token prompt) the varlen prefill kernels
(`causal_conv1d_prefill`, `chunk_gated_delta_rule`). A decode token thus gets the same numerics
whether or not other requests prefill in its step (greedy near-ties otherwise flip between
overlapped and plain scheduling), and it never pays for the chunk kernel. Three cases:

- a pure state decode (`metadata.is_state_decode`; what the CUDA graphs capture): the
  single-token kernels over the whole step;
- a step without any state decode (`metadata.state_split` None): the varlen kernels over it all;
- a mixed step: `metadata.state_split` (built on the host with the step's other arrays, so no
  sync) lists the rows decodes first. The split is per layer, inside it: the layer gathers its
  input into that order (nothing when the decodes already lead, the usual case: running decodes
  are scheduled before new prompts), runs the decode kernels on the first D rows and the varlen
  ones on the rest, and scatters its output back to step order. Reordering the whole step
  instead would touch every consumer of row order (attention metadata, logits rows, sampled
  tokens, pending-token rows, KV transfer); one gather and one scatter of `[T, hidden]` per GDN
  layer is cheap next to the chunk kernel the decode rows skip.

Only the state kernels are made row-invariant here: the projections' matmuls still round by the
step's row count (BLAS picks its tiling by shape), as in every other layer.

The math is the public kernels' (`tandem.kernels.causal_conv1d`,
`gated_delta_rule`, `gated_norm`), never a copy here. Which op set runs goes with the attention
backend, as for every other layer (`fused`): the fused (Triton) backend calls the dispatching
functions (Triton on CUDA, or interpreted on CPU under `TRITON_INTERPRET=1`), the PyTorch backend
their PyTorch twins (`*_ref`, same signatures) — so the reference engine stays the reference
whatever the environment says.

Parameter names match the Hugging Face checkpoints (`linear_attn.*`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tandem.engine_service.layers.attention import AttentionMetadata
from tandem.engine_service.layers.linear import ColumnParallelLinear, RowParallelLinear
from tandem.kernels import causal_conv1d as conv_kernels
from tandem.kernels import gated_delta_rule as delta_kernels
from tandem.kernels import gated_norm as norm_kernels
from tandem.kernels import gdn_gates as gate_kernels


@dataclass(frozen=True)
class GatedDeltaNetShape:
    """The geometry of one Gated DeltaNet layer (the `linear_*` fields of the HF config)."""

    hidden_size: int
    num_k_heads: int  # H: query/key heads
    num_v_heads: int  # HV: value heads, a multiple of H
    head_k_dim: int  # K
    head_v_dim: int  # V
    conv_kernel: int  # W
    eps: float
    split_projections: bool  # Qwen3.5's in_proj_qkv/z/b/a instead of Qwen3-Next's in_proj_qkvz/ba

    def __post_init__(self) -> None:
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"linear_num_value_heads={self.num_v_heads} is not a multiple of "
                             f"linear_num_key_heads={self.num_k_heads}")
        if self.conv_kernel < 2:
            raise ValueError(f"linear_conv_kernel_dim must be >= 2, got {self.conv_kernel}")

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def matmul_params(self) -> int:
        """Weights of the layer's projections (what `GatedDeltaNet.__init__` builds): the input
        projections of q, k, v, z, b, a (packed or split, the same count) and `out_proj`."""
        h = self.hidden_size
        return h * (2 * self.key_dim + 2 * self.value_dim + 2 * self.num_v_heads) + self.value_dim * h

    def other_params(self) -> int:
        """The layer's other weights: conv1d taps, `dt_bias`, `A_log` and the gated norm's scale."""
        return self.conv_dim * self.conv_kernel + 2 * self.num_v_heads + self.head_v_dim

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per-request state: conv state `[conv_dim, W - 1]`, recurrent state `[HV, K, V]`."""
        return (self.conv_dim, self.conv_kernel - 1), (self.num_v_heads, self.head_k_dim, self.head_v_dim)


class DepthwiseConvWeight(nn.Module):
    """Holds a depthwise conv1d weight `[channels, 1, width]` under the checkpoints' `conv1d.weight`
    name (no bias: Qwen3-Next and Qwen3.5 have none). The convolution itself is a kernel call."""

    def __init__(self, channels: int, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, width))


class GatedRMSNormWeight(nn.Module):
    """Holds the per-value-head gated RMSNorm scale `[V]` under the checkpoints' `norm.weight`."""

    # A plain (not zero-centred) scale: one is the identity (see `loader.init_dummy_weights`).
    dummy_weight_value = 1.0

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet token mixer: `forward(x [T, hidden], state, metadata) -> [T, hidden]`.

    `state` is the layer's `(conv_state, recurrent_state)` pools; the rows of the requests in
    the step (`metadata.state_indices`) are read and written in place. Invariant: after a step,
    each request's slot holds the state after its last computed token.
    """

    def __init__(self, shape: GatedDeltaNetShape, fused: bool = False) -> None:
        super().__init__()
        self.shape = s = shape
        self.fused = fused
        if fused:  # the dispatching kernels
            self._conv_prefill = conv_kernels.causal_conv1d_prefill
            self._conv_update = conv_kernels.causal_conv1d_update
            self._delta_chunk = delta_kernels.chunk_gated_delta_rule
            self._delta_update = delta_kernels.fused_recurrent_gated_delta_rule_update
            self._norm_gated = norm_kernels.rms_norm_gated
            self._gates = gate_kernels.gdn_gates
        else:  # their PyTorch twins
            self._conv_prefill = conv_kernels.causal_conv1d_prefill_ref
            self._conv_update = conv_kernels.causal_conv1d_update_ref
            self._delta_chunk = delta_kernels.chunk_gated_delta_rule_ref
            self._delta_update = delta_kernels.fused_recurrent_gated_delta_rule_update_ref
            self._norm_gated = norm_kernels.rms_norm_gated_ref
            self._gates = gate_kernels.gdn_gates_ref
        h = s.hidden_size
        if s.split_projections:
            self.in_proj_qkv = ColumnParallelLinear(h, s.conv_dim, bias=False)
            self.in_proj_z = ColumnParallelLinear(h, s.value_dim, bias=False)
            self.in_proj_b = ColumnParallelLinear(h, s.num_v_heads, bias=False)
            self.in_proj_a = ColumnParallelLinear(h, s.num_v_heads, bias=False)
        else:
            self.in_proj_qkvz = ColumnParallelLinear(h, 2 * s.key_dim + 2 * s.value_dim, bias=False)
            self.in_proj_ba = ColumnParallelLinear(h, 2 * s.num_v_heads, bias=False)
        self.conv1d = DepthwiseConvWeight(s.conv_dim, s.conv_kernel)
        self.dt_bias = nn.Parameter(torch.empty(s.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(s.num_v_heads))
        self.norm = GatedRMSNormWeight(s.head_v_dim, s.eps)
        self.out_proj = RowParallelLinear(s.value_dim, h, bias=False)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`qkv [T, conv_dim]` (q, k, v blocks), `z [T, HV, V]`, `b, a [T, HV]` (Qwen3-Next: views
        `[T, H, HV / H]` of the packed projection, value head `h·HV/H + r` at `[:, h, r]`)."""
        s, t = self.shape, x.shape[0]
        if s.split_projections:
            z = self.in_proj_z(x).view(t, s.num_v_heads, s.head_v_dim)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        # Qwen3-Next groups the packed projections per key head; regroup into q | k | v blocks.
        ratio = s.num_v_heads // s.num_k_heads
        qkvz = self.in_proj_qkvz(x).view(t, s.num_k_heads, 2 * s.head_k_dim + 2 * ratio * s.head_v_dim)
        q, k, v, z = torch.split(qkvz, [s.head_k_dim, s.head_k_dim, ratio * s.head_v_dim, ratio * s.head_v_dim], dim=2)
        ba = self.in_proj_ba(x).view(t, s.num_k_heads, 2 * ratio)
        b, a = torch.split(ba, [ratio, ratio], dim=2)
        qkv = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=-1)
        return qkv, z.reshape(t, s.num_v_heads, s.head_v_dim), b, a

    def forward(
        self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], metadata: AttentionMetadata
    ) -> torch.Tensor:
        s, t = self.shape, x.shape[0]
        conv_state, recurrent_state = state
        indices, fresh = metadata.state_indices, metadata.has_initial_state
        if indices is None or fresh is None:
            raise ValueError("a Gated DeltaNet layer needs state_indices and has_initial_state in the step metadata")
        decode = metadata.is_state_decode
        split = None if decode else metadata.state_split
        if not decode and split is None and metadata.num_state_decodes:
            raise ValueError("a mixed step with state-decode rows needs metadata.state_split (see StateSplit)")
        # Token rows: the split order (decodes first) on a mixed step, the step's own otherwise.
        if split is not None and split.rows is not None:
            x = x.index_select(0, split.rows)
        qkv, z, b, a = self._project(x)
        weight = self.conv1d.weight.view(s.conv_dim, s.conv_kernel)
        if decode:
            qkv = self._conv_update(qkv, weight, None, conv_state, indices, activation="silu")
        elif split is None:
            qkv = self._conv_prefill(qkv, weight, None, conv_state, indices, metadata.query_start_loc, fresh,
                                     activation="silu")
        else:
            d = split.num_decodes
            qkv = torch.cat((
                self._conv_update(qkv[:d], weight, None, conv_state, split.state_indices[:d], activation="silu"),
                self._conv_prefill(qkv[d:], weight, None, conv_state, split.state_indices[d:],
                                   split.query_start_loc, split.has_initial_state, activation="silu"),
            ))
        q, k, v = torch.split(qkv, [s.key_dim, s.key_dim, s.value_dim], dim=-1)
        q = q.reshape(t, s.num_k_heads, s.head_k_dim)
        k = k.reshape(t, s.num_k_heads, s.head_k_dim)
        v = v.reshape(t, s.num_v_heads, s.head_v_dim)
        # beta = sigmoid(b); g = -exp(A_log) softplus(a + dt_bias) in float32 (gdn_gates.py).
        beta, g = self._gates(b, a, self.A_log, self.dt_bias)
        scale = s.head_k_dim**-0.5
        if decode:
            o = self._delta_update(q, k, v, g, beta, scale, recurrent_state, indices, use_qk_l2norm=True)
        elif split is None:
            o = self._delta_chunk(q, k, v, g, beta, scale, recurrent_state, indices, metadata.query_start_loc,
                                  fresh, use_qk_l2norm=True)
        else:
            o = torch.cat((
                self._delta_update(q[:d], k[:d], v[:d], g[:d], beta[:d], scale, recurrent_state,
                                   split.state_indices[:d], use_qk_l2norm=True),
                self._delta_chunk(q[d:], k[d:], v[d:], g[d:], beta[d:], scale, recurrent_state,
                                  split.state_indices[d:], split.query_start_loc, split.has_initial_state,
                                  use_qk_l2norm=True),
            ))
        o = self._norm_gated(o.reshape(-1, s.head_v_dim), z.reshape(-1, s.head_v_dim), self.norm.weight, self.norm.eps)
        out = self.out_proj(o.reshape(t, s.value_dim))
        if split is not None and split.rows is not None:  # back to step order
            out = torch.empty_like(out).index_copy_(0, split.rows, out)
        return out
