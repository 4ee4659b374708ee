"""Does the Hugging Face peer compute the engine's function? Two checks on one prompt.

1. **End to end**: the last position's logits of both models on the same prompt (cosine,
   max |diff|, argmax). Enough for dense models: bfloat16 rounding moves them little.
2. **Layer by layer, teacher-forced**: every HF decoder layer gets the engine's hidden state
   entering that layer (over the whole prompt) instead of its own, and its output is compared
   with the engine's output of the same layer; the HF final norm and LM head get the engine's
   last hidden state and are compared with the engine's logits. What is compared per layer are
   the outputs of its mixer (GDN or attention) and of its feed-forward (MLP or MoE), not the
   layer's output: the residual stream would make any two layers look alike, and a large mixer
   update would hide a wrong feed-forward. Errors cannot compound from layer to layer, so this
   verifies every layer's weights and math even where (1) cannot.

Where (1) cannot: a model that routes each token to its top-k of many experts. Random router
weights put many experts within bfloat16 rounding of the k-th score, so two correct
implementations (or transformers against itself in float32) pick different experts for some
tokens, and the difference compounds over the layers: transformers' own Qwen3-Next in bfloat16
against itself in float32, same weights, 4 layers, top-10 of 64 experts, has last-logit cosine
0.911 (0.998 with top-1 routing, 0.9998 with dense layers; bench/NOTES.md, 2026-12-01). So for
routed models the verdict rests on (2) and (1) is recorded only; for every other model both
must hold.

Engine layers follow one convention (`models/*.py`): `layer(hidden, residual, ...)` returns
`(hidden, residual)`, the hidden state in HF's sense being `hidden + residual` (just `hidden`
entering the first layer, whose `residual` is None).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

def threshold_for(dtype: torch.dtype) -> float:
    """The least cosine that verifies: bfloat16 accumulations differ between implementations,
    float32 ones barely."""
    return 0.9999 if dtype == torch.float32 else 0.99


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    # float64: float32 rounding puts the cosine of near-equal vectors above 1.
    return float(torch.nn.functional.cosine_similarity(a.double().flatten().cpu(), b.double().flatten().cpu(), dim=0))


@torch.no_grad()
def compare_logits(ours_logits: torch.Tensor, hf_logits: torch.Tensor, dtype: torch.dtype) -> dict[str, Any]:
    """Cosine similarity, max |diff| and argmax agreement of two last-position logit vectors."""
    a, b = ours_logits.float().flatten().cpu(), hf_logits.float().flatten().cpu()
    cos = _cosine(a, b)
    threshold = threshold_for(dtype)
    return {"cosine": cos, "max_abs_diff": float((a - b).abs().max()), "logit_std": float(b.std()),
            "same_argmax": bool(a.argmax() == b.argmax()), "threshold": threshold, "verified": cos >= threshold}


@torch.no_grad()
def hf_last_logits(hf: nn.Module, prompt: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt], dtype=torch.long, device=hf.device)
    return hf(input_ids=ids).logits[0, -1]


def is_routed(config: Mapping[str, Any]) -> bool:
    """Whether the (text) config routes tokens to a top-k (k > 1) of several experts."""
    text = config.get("text_config") or config
    return int(text.get("num_experts") or 0) > 1 and int(text.get("num_experts_per_tok") or 0) > 1


SUBLAYERS = ("linear_attn", "self_attn", "mlp")  # the mixer (one of the first two) and the feed-forward


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _sublayers(layer: nn.Module) -> dict[str, nn.Module]:
    return {name: getattr(layer, name) for name in SUBLAYERS if isinstance(getattr(layer, name, None), nn.Module)}


@torch.no_grad()
def capture_engine_layers(layers: Sequence[nn.Module], run: Callable[[], torch.Tensor]
                          ) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    """Run `run()` (one eager engine forward over a single prompt, returning its logits) with hooks
    on the engine's decoder `layers`; returns the logits and, per layer, float32 `[T, hidden]`
    tensors: `in` and `out` (the hidden state entering and leaving it) and the outputs of its
    mixer and feed-forward (by their module names, `SUBLAYERS`). Inputs are read before the layer
    runs (fused add-norms may update them in place)."""
    states: list[dict[str, torch.Tensor]] = [{} for _ in layers]
    calls = [0] * len(layers)

    def before(i: int) -> Callable[..., None]:
        def hook(_module: nn.Module, args: tuple[Any, ...]) -> None:
            hidden, residual = args[0], args[1]
            calls[i] += 1
            states[i]["in"] = hidden.float() if residual is None else hidden.float() + residual.float()
        return hook

    def after(i: int) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: tuple[Any, ...], out: tuple[torch.Tensor, torch.Tensor]) -> None:
            states[i]["out"] = out[0].float() + out[1].float()
        return hook

    def sub(i: int, name: str) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: tuple[Any, ...], out: Any) -> None:
            states[i][name] = _first(out).float()
        return hook

    handles = []
    for i, layer in enumerate(layers):
        handles += [layer.register_forward_pre_hook(before(i)), layer.register_forward_hook(after(i))]
        handles += [m.register_forward_hook(sub(i, name)) for name, m in _sublayers(layer).items()]
    try:
        logits = run()
    finally:
        for h in handles:
            h.remove()
    if calls != [1] * len(layers):
        raise RuntimeError(f"expected one call per engine layer, got {calls}")
    return logits, states


@torch.no_grad()
def teacher_forced_check(hf: nn.Module, prompt: list[int], engine_states: Sequence[Mapping[str, torch.Tensor]],
                         engine_logits: torch.Tensor, dtype: torch.dtype) -> dict[str, Any]:
    """Run `hf` on `prompt` with each decoder layer fed the engine's input to it, and its final
    norm fed the engine's last hidden state; compare each layer's mixer and feed-forward outputs
    (cosine over the prompt) and the logits. Comparing the sub-layers, not the layer's output,
    keeps a small feed-forward from hiding behind a large mixer update (or the residual)."""
    layers = hf.model.layers
    if len(layers) != len(engine_states):
        raise ValueError(f"HF model has {len(layers)} layers, the engine {len(engine_states)}")
    hf_dtype = next(hf.parameters()).dtype
    outputs: list[dict[str, torch.Tensor]] = [{} for _ in layers]

    def forced(x: torch.Tensor) -> torch.Tensor:
        return x.to(device=hf.device, dtype=hf_dtype).unsqueeze(0)

    def before(i: int) -> Callable[..., Any]:
        def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            x = forced(engine_states[i]["in"])
            if args:
                return (x, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": x}
        return hook

    def sub(i: int, name: str) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: tuple[Any, ...], out: Any) -> None:
            outputs[i][name] = _first(out)[0].float()
        return hook

    def norm_input(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (forced(engine_states[-1]["out"]), *args[1:])

    handles = [hf.model.norm.register_forward_pre_hook(norm_input)]
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(before(i), with_kwargs=True))
        handles += [m.register_forward_hook(sub(i, name)) for name, m in _sublayers(layer).items()]
    try:
        hf_logits = hf_last_logits(hf, prompt)
    finally:
        for h in handles:
            h.remove()
    threshold = threshold_for(dtype)
    per_layer = []
    for i, (ours, theirs) in enumerate(zip(engine_states, outputs, strict=True)):
        names = [n for n in SUBLAYERS if n in ours or n in theirs]
        if any(n not in ours or n not in theirs for n in names):
            raise ValueError(f"layer {i}: engine sub-layers {sorted(set(ours) - {'in', 'out'})}, HF {sorted(theirs)}")
        per_layer.append({n: round(_cosine(ours[n], theirs[n]), 6) for n in names})
    worst = min(c for layer in per_layer for c in layer.values())
    head = compare_logits(engine_logits, hf_logits, dtype)
    return {"sublayer_cosine": per_layer, "min_sublayer_cosine": worst, "head": head, "threshold": threshold,
            "verified": worst >= threshold and head["verified"]}


def verdict(end_to_end: Mapping[str, Any], layers: Mapping[str, Any], routed: bool) -> dict[str, Any]:
    """The combined verdict: the teacher-forced check always, end to end unless routed."""
    return {"verified": bool(layers["verified"] and (routed or end_to_end["verified"])),
            "end_to_end_required": not routed,
            "rule": ("routed top-k experts: every layer and the head, teacher-forced (end to end recorded only)"
                     if routed else "end to end and every layer teacher-forced")}
