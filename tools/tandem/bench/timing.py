"""GPU timing with CUDA events: warm-up, then the median of as many runs as the budget allows."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch


class GPURequiredError(RuntimeError):
    """A measurement that only means something on a CUDA device was asked for elsewhere."""


def require_cuda(device: torch.device | str | None, what: str) -> torch.device:
    """The CUDA device to measure on; raises `GPURequiredError` saying why when there is none."""
    dev = torch.device(device) if device is not None else None
    if not torch.cuda.is_available():
        raise GPURequiredError(
            f"{what} needs a CUDA GPU, but torch {torch.__version__} sees none "
            f"(torch.cuda.is_available() is False); run it on the GPU machine"
        )
    if dev is None or (dev.type == "cuda" and dev.index is None):
        return torch.device("cuda", torch.cuda.current_device())
    if dev.type != "cuda":
        raise GPURequiredError(f"{what} needs a CUDA device, got {dev}")
    return dev


@dataclass
class Timing:
    """Per-run milliseconds of one measured callable."""

    runs_ms: list[float]
    warmup: int

    @property
    def median_ms(self) -> float:
        return float(np.median(self.runs_ms))

    def as_dict(self) -> dict[str, float | int]:
        a = np.asarray(self.runs_ms)
        return {
            "median_ms": float(np.median(a)),
            "p10_ms": float(np.percentile(a, 10)),
            "p90_ms": float(np.percentile(a, 90)),
            "min_ms": float(a.min()),
            "reps": int(a.size),
            "warmup": self.warmup,
        }


def cuda_time(
    fn: Callable[[], object],
    device: torch.device,
    *,
    warmup: int = 3,
    reps: int = 20,
    min_reps: int = 3,
    budget_s: float | None = None,
) -> Timing:
    """Time `fn` on `device` with CUDA events around each call.

    After `warmup` calls (the first of which may compile or capture; fewer when they eat 30%
    of `budget_s`), the number of timed runs is `reps`, cut down to what the rest of
    `budget_s` allows at the warm-up pace but never below `min_reps`. Each run gets its own
    event pair; one synchronisation at the end.
    """
    require_cuda(device, "CUDA-event timing")
    with torch.cuda.device(device):
        t0 = time.perf_counter()
        done = 0
        while done < max(warmup, 1):
            fn()
            torch.cuda.synchronize(device)
            done += 1
            # A very slow callable (reference kernels, huge batches) gets fewer warm-up calls.
            if budget_s is not None and time.perf_counter() - t0 > 0.3 * budget_s:
                break
        spent = time.perf_counter() - t0
        per_call = spent / done
        if budget_s is not None and per_call > 0:
            reps = max(min_reps, min(reps, int((budget_s - spent) / per_call)))
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for s, e in zip(starts, ends):
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize(device)
    return Timing(runs_ms=[s.elapsed_time(e) for s, e in zip(starts, ends)], warmup=done)
