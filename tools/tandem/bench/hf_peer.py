"""The Hugging Face peer: transformers on the same weights and workload, in one of two modes.

`continuous_batching` (every model transformers' continuous batching can serve):

`generate_batch` (transformers >= 5) is a thin loop over a `ContinuousBatchingManager`; it
gives every request the same `max_new_tokens`. The workloads here give each request its own
output length, so the peer drives the same manager directly through the public
`continuous_batching_context_manager` + `add_request(..., max_new_tokens=n, eos_token_id=-1)`
API, which is exactly what `generate_batch` runs, with per-request lengths and EOS disabled
(the peer's `ignore_eos`). Both sides decode greedily.

`generate_static_batches` (models continuous batching cannot serve: its paged cache knows only
full and sliding attention layers, so hybrids with `linear_attention` layers, e.g. Qwen3-Next and
Qwen3.5, fail with "Invalid layer type"; `cb_unsupported_reason` asks transformers' own layer
grouping): `model.generate` over static batches of requests grouped by similar output then prompt
length, each left-padded (with its attention mask) and run to the batch's longest output length.
EOS is ignored by an id no token has (`eos_token_id=-1`, as above) rather than by
`min_new_tokens`, which would mask the real EOS logit and so change the greedy tokens. A request
counts only its own `output_len` tokens; the rest of its row (up to the batch's longest) is the
static batching's waste and is reported as `discarded_tokens`. The result says which mode ran
(`mode`) and why (`mode_reason`).

Weights are shared by copying the engine model's tensors into a Hugging Face model built from
the same config (parameter names match the checkpoints; fused `qkv_proj` / `gate_up_proj`
tensors, if the engine ever fuses them, are split in q, k, v / gate, up row order);
`peer_check.py` then checks on one prompt that both compute the same function.
"""

from __future__ import annotations

import gc
import inspect
import logging
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


CB_MODE, STATIC_MODE = "continuous_batching", "generate_static_batches"


def cb_unsupported_reason(hf: torch.nn.Module) -> str | None:
    """Why transformers' continuous batching cannot serve `hf` (None when it can): its own
    grouping of layers by attention type, which raises for a layer type its paged cache has no
    allocator for. The layer types are checked first: some releases (5.17) group a
    `linear_attention` layer without complaint and only fail when the cache is built."""
    types = set(getattr(hf.config, "layer_types", None) or ())
    unknown = sorted(types - {"full_attention", "sliding_attention"})
    if unknown:
        return f"layer types {unknown} have no continuous-batching cache"
    try:
        from transformers.generation.continuous_batching.cache import group_layers_by_attn_type
    except ImportError:
        return None
    try:
        group_layers_by_attn_type(hf.config)
    except ValueError as exc:
        return f"transformers continuous batching cannot serve this model: {exc}"
    return None


def run_hf_peer(
    hf: torch.nn.Module,
    requests: SequenceOf[BenchRequest],
    deadline: Deadline,
    warmup_requests: SequenceOf[BenchRequest] = (),
    cb_config: Mapping[str, Any] | None = None,
    static_batch_size: int = 64,
) -> dict[str, Any]:
    """Run `requests` through transformers continuous batching, or, for a model it cannot serve,
    through `run_static_batches` (`static_batch_size` requests per batch); vLLM-style totals and
    the `mode` that ran.

    The clock runs from the first `add_request` to the last finished result (the manager's
    start-up and CUDA-graph warm-up are excluded, as the engine's are). Past the deadline the
    run stops; only finished requests count and the result says it timed out.
    """
    reason = cb_unsupported_reason(hf)
    if reason is not None:
        log.info("hf peer: static generate batches", reason=reason)
        run = run_static_batches(hf, requests, deadline, warmup_requests, static_batch_size)
        return {"mode": STATIC_MODE, "mode_reason": reason, **run}
    return {"mode": CB_MODE, "mode_reason": "transformers continuous batching serves this model",
            **_run_continuous_batching(hf, requests, deadline, warmup_requests, cb_config)}


def _run_continuous_batching(hf: torch.nn.Module, requests: SequenceOf[BenchRequest], deadline: Deadline,
                             warmup_requests: SequenceOf[BenchRequest], cb_config: Mapping[str, Any] | None
                             ) -> dict[str, Any]:
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


# -- static batches (models continuous batching cannot serve) --------------------------------------


def static_batches(requests: SequenceOf[BenchRequest], batch_size: int) -> list[list[int]]:
    """Indices of `requests` in batches of at most `batch_size`, grouped by similar output length,
    then prompt length (decode steps past a request's own length are the costlier waste)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    order = sorted(range(len(requests)),
                   key=lambda i: (requests[i].output_len, len(requests[i].prompt_token_ids), i))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


class _DeadlineStop:
    """A stopping criterion that ends generation for every row once `deadline` expires."""

    def __init__(self, deadline: Deadline) -> None:
        self.deadline = deadline
        self.fired = False

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        self.fired = self.fired or self.deadline.expired()
        return torch.full((input_ids.shape[0],), self.fired, dtype=torch.bool, device=input_ids.device)


class _NegativeEosWarning(logging.Filter):
    """Drops transformers' warning about `eos_token_id=-1`, which is deliberate here (one per call)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "should consist of positive integers" not in record.getMessage()


@torch.no_grad()
def generate_left_padded(hf: torch.nn.Module, prompts: SequenceOf[SequenceOf[int]], max_new_tokens: int,
                         deadline: Deadline | None = None, pad_token_id: int = 0) -> list[list[int]]:
    """Greedy `model.generate` of `prompts` as one left-padded batch, `max_new_tokens` per row and
    EOS never stopping a row; the new tokens of each row (fewer only if `deadline` stopped it)."""
    from transformers import GenerationConfig, StoppingCriteriaList

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1,
                           pad_token_id=pad_token_id)
    stopping = StoppingCriteriaList([_DeadlineStop(deadline)]) if deadline is not None else None
    quiet = _NegativeEosWarning()
    gen_log = logging.getLogger("transformers.generation.utils")
    gen_log.addFilter(quiet)
    try:
        out = hf.generate(input_ids=ids.to(hf.device), attention_mask=mask.to(hf.device), generation_config=gen,
                          stopping_criteria=stopping)
    finally:
        gen_log.removeFilter(quiet)
    return out[:, width:].tolist()


def linear_attention_kernels() -> dict[str, bool | None]:
    """Whether transformers finds the fast Gated DeltaNet kernels (without them its hybrid models
    fall back to PyTorch reference loops, and the peer is that much slower: the record says so)."""
    try:
        from transformers.utils import import_utils
    except ImportError:  # pragma: no cover - transformers is a dependency
        return {}
    found: dict[str, bool | None] = {}
    for name, probe in (("flash_linear_attention", "is_flash_linear_attention_available"),
                        ("causal_conv1d", "is_causal_conv1d_available")):
        fn = getattr(import_utils, probe, None)
        found[name] = bool(fn()) if fn is not None else None
    return found


def run_static_batches(hf: torch.nn.Module, requests: SequenceOf[BenchRequest], deadline: Deadline,
                       warmup_requests: SequenceOf[BenchRequest] = (), batch_size: int = 64,
                       collect_tokens: bool = False) -> dict[str, Any]:
    """Run `requests` as static `generate` batches (`static_batches`); vLLM-style totals.

    The clock runs from the first batch's start to the last batch's end (the warm-up batch, on
    `warmup_requests`, before it). A batch the deadline cuts short counts none of its requests;
    no batch starts once the deadline has passed. With `collect_tokens`, `tokens[i]` holds request
    i's own output tokens (tests compare them with the engine's).
    """
    info: dict[str, Any] = {
        "api": "model.generate(left-padded static batches, greedy, max_new_tokens = the batch's longest "
               "output_len, eos_token_id=-1)",
        "attn_implementation": getattr(hf.config, "_attn_implementation", None),
        "batch_size": batch_size,
        "linear_attention_kernels": linear_attention_kernels(),
    }
    if warmup_requests:
        t0 = time.perf_counter()
        warm = list(warmup_requests)[:batch_size]
        generate_left_padded(hf, [r.prompt_token_ids for r in warm], min(max(r.output_len for r in warm), 16))
        info["warmup_s"] = round(time.perf_counter() - t0, 3)
    batches = static_batches(requests, batch_size)
    start = time.perf_counter()
    finished: dict[int, float] = {}
    tokens: dict[int, list[int]] = {}
    generated = short = 0
    timed_out = False
    for batch in batches:
        if deadline.expired():
            timed_out = True
            break
        max_new = max(requests[i].output_len for i in batch)
        rows = generate_left_padded(hf, [requests[i].prompt_token_ids for i in batch], max_new, deadline)
        now = time.perf_counter()
        generated += sum(len(r) for r in rows)
        if any(len(r) < max_new for r in rows):  # the deadline stopped it
            timed_out = True
            break
        for i, row in zip(batch, rows, strict=True):
            short += len(row) < requests[i].output_len
            finished[i] = now
            if collect_tokens:
                tokens[i] = row[: requests[i].output_len]
    end = max(finished.values(), default=time.perf_counter()) if not timed_out else time.perf_counter()
    out_tokens = sum(requests[i].output_len for i in finished)
    in_tokens = sum(len(requests[i].prompt_token_ids) for i in finished)
    el = max(end - start, 1e-9)
    return {
        **info,
        "num_batches": len(batches),
        "num_requests": len(requests),
        "completed": len(finished),
        "timed_out": timed_out,
        "elapsed_s": end - start,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "discarded_tokens": generated - out_tokens if not timed_out else None,
        "requests_per_s": len(finished) / el,
        "output_tokens_per_s": out_tokens / el,
        "total_tokens_per_s": (in_tokens + out_tokens) / el,
        "e2e_ms": summarize([t - start for t in finished.values()], 1e3),
        "requests_not_at_target_length": short,
        "errors": [],
        **({"tokens": [tokens.get(i) for i in range(len(requests))]} if collect_tokens else {}),
    }


def release_device_memory() -> None:
    """Collect garbage and give cached device memory back (after the caller dropped its refs)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
