"""Where and with what a benchmark ran: device, library versions, git commit, time."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

# The checkout this package runs from (tandem/bench/env_info.py -> repository root).
REPO_ROOT = Path(__file__).resolve().parents[2]


def package_version(name: str) -> str | None:
    """The installed distribution's version, or None when it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def git_commit() -> tuple[str, str, bool | None]:
    """(commit, source, dirty): `$TANDEM_GIT_COMMIT` when set (an explicit statement wins: copies of
    the tree on a GPU machine may carry a stale `.git`), else `git rev-parse HEAD` of this
    checkout, else "unknown"."""
    env = os.environ.get("TANDEM_GIT_COMMIT", "").strip()
    if env:
        return env, "env:TANDEM_GIT_COMMIT", None
    head = _git("rev-parse", "HEAD")
    if head:
        status = _git("status", "--porcelain", "--untracked-files=no")
        return head, "git", (bool(status) if status is not None else None)
    return "unknown", "none", None


def device_info(device: Any = None) -> dict[str, Any]:
    """Name and count of the accelerator torch sees (or the CPU when there is none)."""
    import torch

    info: dict[str, Any] = {"cuda_available": torch.cuda.is_available(), "torch_threads": torch.get_num_threads()}
    use_cuda = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
    if use_cuda:
        dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        info.update(
            device=torch.cuda.get_device_name(index),
            device_type="cuda",
            device_count=torch.cuda.device_count(),
            device_memory_gib=round(props.total_memory / 2**30, 1),
            compute_capability=f"{props.major}.{props.minor}",
            cuda=torch.version.cuda,
        )
    else:
        info.update(device=f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
                    device_type="cpu", device_count=0)
    return info


def collect_env(device: Any = None) -> dict[str, Any]:
    """Everything a result row needs to say where it came from."""
    commit, source, dirty = git_commit()
    env: dict[str, Any] = device_info(device)
    env.update(
        torch=package_version("torch"),
        triton=package_version("triton"),
        transformers=package_version("transformers"),
        grpcio=package_version("grpcio"),
        tandem=package_version("tandem-serve"),
        python=platform.python_version(),
        python_implementation=sys.implementation.name,
        platform=platform.platform(),
        git_commit=commit,
        git_commit_source=source,
        git_dirty=dirty,
        timestamp=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    )
    return env
