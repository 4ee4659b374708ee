"""The Hugging Face peer: transformers' continuous batching on the same weights and workload.

`generate_batch` (transformers >= 5) is a thin loop over a `ContinuousBatchingManager`; it
gives every request the same `max_new_tokens`. The workloads here give each request its own
output length, so the peer drives the same manager directly through the public
`continuous_batching_context_manager` + `add_request(..., max_new_tokens=n, eos_token_id=-1)`
API, which is exactly what `generate_batch` runs, with per-request lengths and EOS disabled
(the peer's `ignore_eos`). Both sides decode greedily.

Weights are shared by copying the engine model's tensors into a Hugging Face model built from
the same config (parameter names match the checkpoints; fused `qkv_proj` / `gate_up_proj`
tensors, if the engine ever fuses them, are split in q, k, v / gate, up row order). A logits
comparison on one prompt then checks that both compute the same function.
"""

from __future__ import annotations

import gc
import inspect
import time
from collections.abc import Mapping, Sequence as SequenceOf
from typing import Any

import structlog
import torch

from tandem.bench.results import Deadline
from tandem.bench.stats import summarize
from tandem.bench.workloads import BenchRequest

log = structlog.get_logger(__name__)

_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def build_hf_model(config: Mapping[str, Any], device: torch.device | str, dtype: torch.dtype,
                   attn_implementation: str = "sdpa") -> torch.nn.Module:
    """A Hugging Face causal LM from a `config.json` dict, randomly initialised on `device`.

    `sdpa` is what the continuous-batching manager accepts on every transformers 5.x: older
    releases switch it to `paged|sdpa` themselves, newer ones run it paged as is (and both
    pick flash attention instead when it is installed; the record says what ran).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in config.items() if k != "model_type"}
    hf_config = AutoConfig.for_model(config["model_type"], **fields)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation=attn_implementation)
    return model.eval()


def _fused_source(ours: Mapping[str, torch.Tensor], hf_params: Mapping[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The rows of a fused engine tensor that correspond to HF parameter `name`, if any."""
    parts = name.split(".")
    if len(parts) < 2 or parts[-2] not in _FUSED:
        return None
    fused_name, index = _FUSED[parts[-2]]
    fused = ours.get(".".join(parts[:-2] + [fused_name, parts[-1]]))
    if fused is None:
        return None
    sizes = [hf_params[".".join(parts[:-2] + [p, parts[-1]])].shape[0] for p in _FUSED_PARTS[fused_name]]
    if sum(sizes) != fused.shape[0]:
        return None
    start = sum(sizes[:index])
    return fused[start : start + sizes[index]]


@torch.no_grad()
def copy_weights_to_hf(ours: torch.nn.Module, hf: torch.nn.Module) -> dict[str, Any]:
    """Copy every HF parameter from the engine model (same names, or fused rows); raises
    `ValueError` naming what is missing or misshapen, so a peer never runs on other weights."""
    src = dict(ours.named_parameters(remove_duplicate=False))
    hf_params = dict(hf.named_parameters())  # tied parameters once
    missing, misshapen, fused = [], [], 0
    for name, param in hf_params.items():
        tensor = src.get(name)
        if tensor is None:
            tensor = _fused_source(src, hf_params, name)
            fused += tensor is not None
        if tensor is None:
            missing.append(name)
            continue
        if tuple(tensor.shape) != tuple(param.shape):
            misshapen.append(f"{name}: engine {tuple(tensor.shape)} vs hf {tuple(param.shape)}")
            continue
        param.copy_(tensor.to(device=param.device, dtype=param.dtype))
    if missing or misshapen:
        raise ValueError(f"cannot share weights with the HF model: missing={missing[:8]} misshapen={misshapen[:8]}")
    return {"copied": len(hf_params), "from_fused_tensors": fused}


@torch.no_grad()
def compare_logits(ours_logits: torch.Tensor, hf_logits: torch.Tensor, dtype: torch.dtype) -> dict[str, Any]:
    """Cosine similarity, max |diff| and argmax agreement of two last-position logit vectors."""
    a, b = ours_logits.float().flatten().cpu(), hf_logits.float().flatten().cpu()
    cos = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
    # bf16 accumulations differ between implementations; float32 ones barely.
    threshold = 0.9999 if dtype == torch.float32 else 0.99
    return {"cosine": cos, "max_abs_diff": float((a - b).abs().max()), "logit_std": float(b.std()),
            "same_argmax": bool(a.argmax() == b.argmax()), "threshold": threshold, "verified": cos >= threshold}


@torch.no_grad()
def hf_last_logits(hf: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt], dtype=torch.long, device=hf.device)
    return hf(input_ids=ids).logits[0, -1]


def _import_cb() -> tuple[Any, Any]:
    """(ContinuousBatchingConfig, WorkloadHints) where this transformers has them, else None."""
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    except ImportError:
        ContinuousBatchingConfig = None  # noqa: N806
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints
    except ImportError:
        WorkloadHints = None  # noqa: N806
    return ContinuousBatchingConfig, WorkloadHints


def _describe(obj: Any) -> dict[str, Any]:
    try:
        return {k: (v if isinstance(v, (int, float, str, bool, type(None))) else repr(v)[:120])
                for k, v in vars(obj).items() if not k.startswith("_")}
    except TypeError:
        return {"repr": repr(obj)[:500]}


def run_hf_peer(
    hf: torch.nn.Module,
    requests: SequenceOf[BenchRequest],
    deadline: Deadline,
    warmup_requests: SequenceOf[BenchRequest] = (),
    cb_config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Run `requests` through transformers continuous batching; vLLM-style totals.

    The clock runs from the first `add_request` to the last finished result (the manager's
    start-up and CUDA-graph warm-up are excluded, as the engine's are). Past the deadline the
    run stops; only finished requests count and the result says it timed out.
    """
    from transformers import GenerationConfig

    ContinuousBatchingConfig, WorkloadHints = _import_cb()  # noqa: N806
    max_new = max(r.output_len for r in requests)
    gen = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    kwargs: dict[str, Any] = {"generation_config": gen, "block": True, "timeout": 10,
                              "warmup": hf.device.type == "cuda"}
    if WorkloadHints is not None:
        kwargs["workload_hints"] = WorkloadHints(
            max_prompt_length=max(len(r.prompt_token_ids) for r in requests),
            max_generated_length=max_new, num_requests=len(requests))
    if cb_config and ContinuousBatchingConfig is not None:
        fields = dict(cb_config)
        # transformers renamed block_size to page_size after 5.17 (the old name deprecated).
        accepted = inspect.signature(ContinuousBatchingConfig).parameters
        if "block_size" in fields and "page_size" in accepted:
            fields["page_size"] = fields.pop("block_size")
        elif "page_size" in fields and "page_size" not in accepted and "block_size" in accepted:
            fields["block_size"] = fields.pop("page_size")
        kwargs["continuous_batching_config"] = ContinuousBatchingConfig(**fields)

    info: dict[str, Any] = {"api": "ContinuousBatchingManager via model.continuous_batching_context_manager "
                                   "+ add_request(max_new_tokens per request, eos_token_id=-1)"}
    t_enter = time.perf_counter()
    with hf.continuous_batching_context_manager(**kwargs) as manager:
        info["manager_start_s"] = round(time.perf_counter() - t_enter, 3)
        info["attn_implementation"] = getattr(hf.config, "_attn_implementation", None)
        info["cb_config"] = _describe(getattr(manager, "continuous_batching_config", None))
        if warmup_requests:
            t0 = time.perf_counter()
            _drive(manager, warmup_requests, "warmup", deadline)
            info["warmup_s"] = round(time.perf_counter() - t0, 3)
        run = _drive(manager, requests, "peer", deadline)
    info["manager_total_s"] = round(time.perf_counter() - t_enter, 3)
    return {**info, **run}


def _drive(manager: Any, requests: SequenceOf[BenchRequest], prefix: str, deadline: Deadline) -> dict[str, Any]:
    start = time.perf_counter()
    targets: dict[str, BenchRequest] = {}
    for i, req in enumerate(requests):
        rid = f"{prefix}-{i}"
        got = manager.add_request(list(req.prompt_token_ids), request_id=rid, max_new_tokens=req.output_len,
                                  eos_token_id=-1)
        if got is None:
            raise RuntimeError(f"the continuous batching manager refused request {rid}")
        targets[rid] = req
    finished: dict[str, tuple[float, Any]] = {}
    timed_out = False
    while len(finished) < len(targets):
        if deadline.expired():
            timed_out = True
            break
        result = manager.get_result(timeout=0.5)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("the transformers generation thread stopped before finishing")
            continue
        if result.request_id in targets and result.is_finished():
            finished[result.request_id] = (time.perf_counter(), result)
    end = max((t for t, _ in finished.values()), default=time.perf_counter())
    if timed_out:
        end = time.perf_counter()
        for rid in targets.keys() - finished.keys():
            manager.cancel_request(rid)
    out_tokens = sum(len(r.generated_tokens) for _, r in finished.values())
    in_tokens = sum(len(targets[rid].prompt_token_ids) for rid in finished)
    errors = [r.error for _, r in finished.values() if getattr(r, "error", None)]
    short = sum(1 for rid, (_, r) in finished.items() if len(r.generated_tokens) != targets[rid].output_len)
    el = max(end - start, 1e-9)
    return {
        "num_requests": len(targets),
        "completed": len(finished),
        "timed_out": timed_out,
        "elapsed_s": end - start,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "requests_per_s": len(finished) / el,
        "output_tokens_per_s": out_tokens / el,
        "total_tokens_per_s": (in_tokens + out_tokens) / el,
        "e2e_ms": summarize([t - start for t, _ in finished.values()], 1e3),
        "requests_not_at_target_length": short,
        "errors": errors[:5],
    }


def release_device_memory() -> None:
    """Collect garbage and give cached device memory back (after the caller dropped its refs)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
