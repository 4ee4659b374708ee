"""Sparse mixture-of-experts feed-forward block (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE).

Math, as transformers' `Qwen3MoeSparseMoeBlock` / `Qwen3NextSparseMoeBlock` /
`Qwen3_5MoeSparseMoeBlock` compute it:

    logits = gate(x)                                    # [T, E], model dtype
    w, ids = top_k(softmax_f32(logits)); w /= sum(w) if norm_topk_prob
    w      = w rounded to the model dtype               # transformers casts the weights back
    out    = sum_j w_j * expert_{ids_j}(x)              # SwiGLU experts
    out   += sigmoid(shared_expert_gate(x)) * shared_expert(x)   # Qwen3-Next / Qwen3.5-MoE only

Qwen3.5-MoE always renormalises (its router has no `norm_topk_prob` switch): pass
`norm_topk_prob=True` for it.

Parameters carry the names transformers 5 uses in memory, which is also the on-disk layout of
checkpoints that store experts fused: `gate.weight [E, Hd]`, `experts.gate_up_proj [E, 2I, Hd]`
(gate rows first), `experts.down_proj [E, Hd, I]`, `shared_expert.{gate,up,down}_proj.weight`,
`shared_expert_gate.weight [1, Hd]`. Released checkpoints (and transformers' own
`save_pretrained`) store one tensor per expert, `experts.{e}.{gate,up,down}_proj.weight`; the
loader stacks those into the fused parameters through `per_expert_checkpoint_name` and
`ExpertWeights.load_expert`.

Two op sets, chosen at construction (`fused`, the attention backend's `fused_layers`): the
PyTorch one (the reference and CPU path) runs `fused_moe_reference`; the fused one runs the
Triton `fused_moe` (routed by `moe_routing.route_experts`: one launch for the top-k and, in
decode-sized batches, the expert-sorted pair layout) and computes the router logits, the shared
expert's gate/up and its sigmoid gate logit as ONE GEMM over a merged weight (all three read the
same `x`), then the shared expert's SiLU·mul kernel and down projection.

FP8 experts (`ExpertWeights.to_fp8`): the stacked weights are e4m3 with block scales
`gate_up_proj_scale_inv [E, ceil(2I/bn), ceil(Hd/bk)]`, `down_proj_scale_inv [E, ceil(Hd/bn),
ceil(I/bk)]` (one-row blocks when I is not a whole number of blocks: `fp8.part_block`); both op
sets pass them to the MoE kernels (`MoeFp8Scales`), which dequantize in the kernel.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from tandem.engine_service.layers.fp8 import SCALE_SUFFIX, fp8_parameter, load_rows, load_scale_rows, new_scale, \
    part_block
from tandem.engine_service.layers.linear import ColumnParallelLinear
from tandem.engine_service.layers.merged_linear import MergedColumnLinear
from tandem.engine_service.layers.mlp import GatedMLP
from tandem.kernels import activation as activation_kernels
from tandem.kernels.fp8_gemm import FP8_DTYPE
from tandem.kernels.fused_moe import MoeFp8Scales, fused_moe, fused_moe_reference, select_experts
from tandem.kernels.moe_routing import route_experts

__all__ = ["ExpertWeights", "MoeSpec", "SparseMoeBlock", "expected_distinct_experts", "per_expert_checkpoint_name"]


@dataclass(frozen=True)
class MoeSpec:
    """A model's MoE hyperparameters, normalised from its HF config; `sparse_layers[i]` says
    whether layer i uses the sparse block (else a dense MLP of the config's intermediate size)."""

    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]
    shared_expert_intermediate_size: int = 0

    @staticmethod
    def sparse_layers_from_hf(num_layers: int, num_experts: int, decoder_sparse_step: int,
                              mlp_only_layers: list[int] | tuple[int, ...]) -> tuple[bool, ...]:
        """Which layers are sparse, as transformers decides it: not in `mlp_only_layers`, and
        `(i + 1) % decoder_sparse_step == 0`, and the model has experts at all."""
        only = set(mlp_only_layers)
        step = max(int(decoder_sparse_step), 1)
        return tuple(i not in only and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers))


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Experts a batch of `tokens` tokens touches on average under uniform routing:
    `E * (1 - (1 - k/E)^B)` (each expert is missed by one token with probability 1 - k/E)."""
    if tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


_PER_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def per_expert_checkpoint_name(name: str) -> tuple[str, int, str] | None:
    """`...mlp.experts.7.up_proj.weight` -> (`...mlp.experts.gate_up_proj`, 7, "up_proj");
    None for any other name. The first element names the stacked parameter it loads into."""
    m = _PER_EXPERT.match(name)
    if m is None:
        return None
    stacked = "gate_up_proj" if m["proj"] in ("gate_proj", "up_proj") else "down_proj"
    return f"{m['prefix']}.{stacked}", int(m["expert"]), m["proj"]


class ExpertWeights(nn.Module):
    """The routed experts' weights, stacked: `gate_up_proj [E, 2I, Hd]`, `down_proj [E, Hd, I]`.

    Invariant: rows `[:I]` of `gate_up_proj[e]` are expert e's gate projection, `[I:]` its up.
    `load_expert` fills one expert's slice from a per-expert checkpoint tensor.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size),
                                      requires_grad=False)
        for stacked in ("gate_up_proj", "down_proj"):
            self.register_parameter(stacked + SCALE_SUFFIX, None)  # set by to_fp8
        self.weight_block: tuple[int, int] | None = None

    def to_fp8(self, block: tuple[int, int]) -> None:
        """Hold both stacked weights as FP8 with block scales (before loading)."""
        inter = self.intermediate_size
        self.weight_block = block = part_block(block, [inter, self.down_proj.shape[1]])
        for stacked in ("gate_up_proj", "down_proj"):
            old = getattr(self, stacked)
            scale = new_scale(tuple(old.shape), block, old.device)
            setattr(self, stacked, fp8_parameter(torch.empty(old.shape, dtype=FP8_DTYPE, device=old.device),
                                                 block, scale))
            setattr(self, stacked + SCALE_SUFFIX, scale)

    def scales(self) -> MoeFp8Scales | None:
        """The block scales the MoE kernels take, None for weights in the model dtype."""
        if self.weight_block is None:
            return None
        return MoeFp8Scales(self.gate_up_proj_scale_inv, self.down_proj_scale_inv, self.weight_block)

    def _target(self, proj: str, expert: int) -> tuple[str, int, int]:
        """`(stacked parameter, first row, rows)` of expert `expert`'s `proj` slice."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range (the model has {self.num_experts})")
        inter = self.intermediate_size
        if proj == "down_proj":
            return "down_proj", 0, self.down_proj.shape[1]
        return "gate_up_proj", 0 if proj == "gate_proj" else inter, inter

    def parts_per_expert(self, stacked: str) -> int:
        """How many per-expert checkpoint tensors fill one expert of the stacked parameter."""
        return 2 if stacked == "gate_up_proj" else 1

    @torch.no_grad()
    def load_expert(self, proj: str, expert: int, loaded: torch.Tensor) -> None:
        """Copy expert `expert`'s `proj` ("gate_proj", "up_proj", "down_proj") into its slice
        (FP8 weights: as stored, or quantized here from a float tensor)."""
        stacked, row0, rows = self._target(proj, expert)
        if self.weight_block is not None:
            load_rows(getattr(self, stacked)[expert], getattr(self, stacked + SCALE_SUFFIX)[expert],
                      self.weight_block, row0, loaded)
            return
        target = getattr(self, stacked)[expert, row0: row0 + rows]
        if target.shape != loaded.shape:
            raise ValueError(f"shape mismatch: expert slice {tuple(target.shape)} vs checkpoint {tuple(loaded.shape)}")
        target.copy_(loaded)

    @torch.no_grad()
    def load_expert_scale(self, proj: str, expert: int, loaded: torch.Tensor, block: tuple[int, int]) -> None:
        """Copy the checkpoint's block scales (`block` blocks) of expert `expert`'s `proj`."""
        if self.weight_block is None:
            raise ValueError("the experts' weights are not FP8")
        stacked, row0, rows = self._target(proj, expert)
        cols = getattr(self, stacked).shape[-1]
        load_scale_rows(getattr(self, stacked + SCALE_SUFFIX)[expert], self.weight_block, row0, rows, cols,
                        loaded, block)


class SparseMoeBlock(nn.Module):
    """Routes each token to its `top_k` experts and sums their weighted outputs, plus an optional
    sigmoid-gated shared expert. Input and output `[T, hidden_size]` in the model dtype."""

    def __init__(
        self,
        hidden_size: int,
        moe_intermediate_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        shared_expert_intermediate_size: int = 0,
        fused: bool = False,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.fused = fused
        self.gate = ColumnParallelLinear(hidden_size, num_experts, bias=False)  # the router
        self.experts = ExpertWeights(num_experts, hidden_size, moe_intermediate_size)
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: ColumnParallelLinear | None = None
        if shared_expert_intermediate_size > 0:
            # Unfused inside: in the fused op set this block merges its gate/up with the router.
            self.shared_expert = GatedMLP(hidden_size, shared_expert_intermediate_size, fused=False)
            self.shared_expert_gate = ColumnParallelLinear(hidden_size, 1, bias=False)
        if fused:
            # Rows: router (E), then shared gate logit (1), shared gate (Is), shared up (Is).
            linears = [self.gate]
            if self.shared_expert is not None and self.shared_expert_gate is not None:
                linears += [self.shared_expert_gate, self.shared_expert.gate_proj, self.shared_expert.up_proj]
            self.input_proj = MergedColumnLinear(linears)

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(topk_weights float32, topk_ids int32)`; the weights rounded to the model dtype first,
        as transformers rounds them before scaling the experts' outputs."""
        weights, ids = select_experts(router_logits, self.top_k, self.norm_topk_prob)
        return weights.to(router_logits.dtype).float(), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return self._forward_fused(x)
        weights, ids = self.route(self.gate(x))
        out = fused_moe_reference(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids,
                                  self.experts.scales())
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def _forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        projected = self.input_proj(x)
        e = self.num_experts
        # One launch: softmax, top-k, renormalisation, the weights' rounding, and (decode-sized
        # batches) the expert-sorted pair layout the expert GEMMs read.
        weights, ids, layout = route_experts(projected[:, :e], self.top_k, self.norm_topk_prob, projected.dtype)
        out = fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids, self.experts.scales(),
                        layout)
        if self.shared_expert is None:
            return out
        shared_gate = torch.sigmoid(projected[:, e : e + 1])
        # A strided view with a contiguous last dim: silu_and_mul reads it in place.
        act = activation_kernels.silu_and_mul(projected[:, e + 1 :])
        return out + shared_gate * self.shared_expert.down_proj(act)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, top_k={self.top_k}, norm_topk_prob={self.norm_topk_prob}" + (
            ", fused" if self.fused else "")
