"""Sampling defaults that come from the model, for request fields the client leaves unset.

Users of other servers expect a model's `generation_config.json` to set the sampling a request
gets when it says nothing: a model tuned for temperature 0.6 / top-p 0.95 should not be sampled
at 1.0 with no top-p. `--generation-config` chooses the source:

- `auto` (default): the shipped defaults of an embedded model (its GGUF file has none), else the
  model directory's `generation_config.json`, else none;
- `none`: no defaults (temperature 1.0, no top-p / top-k / min-p, no penalty);
- a path to a `generation_config.json` file (or to a directory holding one).

Read fields: temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens (which
becomes the default `max_tokens`). `do_sample` is not read: as in vLLM, a model whose file says
`do_sample: false` but gives a temperature is served at that temperature; a client wanting
greedy decoding sends `temperature: 0`. A field set in the request always wins.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from tandem.sampling_ranges import SAMPLING_RANGES
from tandem.v1 import common_pb2

GENERATION_CONFIG_FILE = "generation_config.json"

# Measured with Tandem (scripts/measure_chat_defaults.py, 20 seeds, the README's question), on the
# embedded Q4_1 SmolLM2-135M-Instruct: "Paris" 20/20 greedy, 15/20 at the model card's
# temperature 0.2 / top-p 0.9 and 16/20 at 0.1 / 0.9. The first token's two likeliest choices
# ("The" and "L'") are close, so any temperature above 0 starts about one answer in five wrongly;
# greedy is the default that makes the README's example reliable.
EMBEDDED_DEFAULTS: dict[str, dict[str, float]] = {
    "smollm2-135m-instruct": {"temperature": 0.0},
}


class GenerationConfigError(ValueError):
    """A generation config that cannot be read or holds an invalid value."""


@dataclass(frozen=True)
class GenerationDefaults:
    """The sampling defaults of one served model; None = the neutral default of that field.

    Invariant: every value set is valid for its request field (checked at load), so filling a
    request's unset fields never makes a valid request invalid.
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None
    source: str = "none"

    def sampling_fields(self) -> dict[str, float | int]:
        """The set fields, by request field name (max_tokens excluded: see `max_tokens`)."""
        names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def fill(self, msg: common_pb2.SamplingParams) -> common_pb2.SamplingParams:
        """A copy of `msg` with its unset sampling fields set from these defaults."""
        fields = self.sampling_fields()
        missing = {n: v for n, v in fields.items() if not msg.HasField(n)}
        if not missing:
            return msg
        out = common_pb2.SamplingParams()
        out.CopyFrom(msg)
        for name, value in missing.items():
            setattr(out, name, value)
        return out

    def default_max_tokens(self, server_default: int) -> int:
        """The max_tokens of a request that sets none: the model's, else the server's
        `--default-max-tokens` (the request's context then caps it)."""
        return self.max_tokens or server_default

    def effective(self, server_default_max_tokens: int) -> dict:
        """What a request that sets no sampling field gets (for model info and logs)."""
        return {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                **self.sampling_fields(), "max_tokens": self.default_max_tokens(server_default_max_tokens),
                "source": self.source}

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def _check(name: str, value, source: str):
    """`value` as its request field's type, if a request could send it (the ranges of
    `tandem.sampling_ranges`, the same the wire validation uses)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and not math.isfinite(value)) or not SAMPLING_RANGES[name].contains(value):
        raise GenerationConfigError(f"{source}: invalid {name} {value!r}")
    if name in ("top_k", "max_tokens"):
        if value != int(value):
            raise GenerationConfigError(f"{source}: {name} must be an integer, got {value!r}")
        return int(value)
    return float(value)


def from_generation_config(data: dict, source: str) -> GenerationDefaults:
    """Defaults from the fields of a parsed `generation_config.json`."""
    values = {}
    for key, name in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("min_p", "min_p"),
                      ("repetition_penalty", "repetition_penalty"), ("max_new_tokens", "max_tokens")):
        if data.get(key) is not None:
            values[name] = _check(name, data[key], source)
    if values.get("top_k") == -1:
        values["top_k"] = 0
    return GenerationDefaults(**values, source=source)


def read_generation_config(path: str | Path) -> GenerationDefaults:
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / GENERATION_CONFIG_FILE
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise GenerationConfigError(f"{path}: cannot read it ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise GenerationConfigError(f"{path}: not valid JSON ({exc.msg})") from None
    if not isinstance(data, dict):
        raise GenerationConfigError(f"{path}: expected a JSON object")
    return from_generation_config(data, str(path))


def load_generation_defaults(setting: str, model: str, model_path: str | None) -> GenerationDefaults:
    """The defaults `--generation-config setting` gives model spec `model` stored at `model_path`."""
    if setting == "none":
        return GenerationDefaults()
    if setting != "auto":
        return read_generation_config(setting)
    if model in EMBEDDED_DEFAULTS:
        return from_generation_config(EMBEDDED_DEFAULTS[model], f"shipped defaults of {model}")
    if model_path is not None and (Path(model_path) / GENERATION_CONFIG_FILE).is_file():
        return read_generation_config(Path(model_path) / GENERATION_CONFIG_FILE)
    return GenerationDefaults()
