"""Shared helpers for the Triton kernels: lazy Triton loading, launch wrapper, argument checks.

How Triton picks the interpreter, and why this module loads Triton lazily: Triton reads
``TRITON_INTERPRET`` through ``triton.knobs.runtime.interpret`` when ``@triton.jit`` decorates a
function, and its own standard library (``tl.sum``, ``tl.max``, ``tl.cdiv`` ...) is decorated
when ``triton.language`` is first imported. A process that imports Triton before setting the
variable therefore has GPU-only ``tl.sum`` & co., and no kernel can run on CPU any more, whatever
the kernel's own decorator said. So kernel modules never import Triton at import time: their
bodies refer to ``tl`` (annotations stay strings via ``from __future__ import annotations``) and
:class:`TritonKernel` imports Triton, binds the real ``triton.language`` into the kernel's
globals and decorates it at the first launch. By then a test module has long set the variable,
whatever order a test session imported modules in. On a host without a GPU, where compiled
Triton cannot run at all, the first launch turns the interpreter on itself if Triton is not yet
imported.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = [
    "FLOAT_DTYPES",
    "TritonHelper",
    "TritonKernel",
    "cast",
    "cdiv",
    "check_contiguous_last_dim",
    "check_dtype",
    "check_same_device",
    "check_shape",
    "dot",
    "dot_precision",
    "interpreter_enabled",
    "next_power_of_2",
    "num_compute_units",
    "tl",
    "triton_available",
    "triton_helper",
    "triton_kernel",
]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class _UnloadedTritonLanguage:
    """Placeholder for ``tl`` in kernel modules until the first launch binds the real module."""

    constexpr = "constexpr"

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError("triton.language is bound at the first kernel launch")


tl: Any = _UnloadedTritonLanguage()


def triton_available() -> bool:
    """True when Triton is installed (kernels then run on GPUs, and on CPU via the interpreter)."""
    return "triton" in sys.modules or importlib.util.find_spec("triton") is not None


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "on", "yes")


def interpreter_enabled() -> bool:
    """True when Triton runs (or, once loaded, will run) kernels in its CPU interpreter."""
    triton = sys.modules.get("triton")
    knobs = getattr(triton, "knobs", None) if triton is not None else None
    if knobs is not None:  # triton >= 3.4: the knob caches the variable and may be overridden
        return bool(knobs.runtime.interpret)
    return _env_flag("TRITON_INTERPRET")


@functools.lru_cache(maxsize=1)
def _load_triton() -> tuple[Any, Any]:
    if not triton_available():
        raise RuntimeError("triton is not installed; use the *_reference functions instead")
    if "triton" not in sys.modules and "TRITON_INTERPRET" not in os.environ:
        if not torch.cuda.is_available():  # compiled Triton needs a GPU: interpret instead
            os.environ["TRITON_INTERPRET"] = "1"
    import triton
    import triton.language as language

    return triton, language


def _bind(fn: Callable[..., Any], triton: Any, language: Any) -> None:
    """Give ``fn``'s module the real ``tl`` and jitted versions of its helpers."""
    module_globals = fn.__globals__
    module_globals["tl"] = language
    for name, value in list(module_globals.items()):
        if isinstance(value, TritonHelper):
            module_globals[name] = value.jitted(triton, language)


class TritonKernel:
    """One Triton kernel function, decorated with ``triton.jit`` at its first launch.

    Use ``kernel.on(device)[grid](*args, num_warps=..., num_stages=...)``. A kernel may call
    functions marked with :func:`triton_helper` (bound the same lazy way), not plain
    ``@triton.jit`` ones (those would be decorated eagerly, at import).
    """

    def __init__(self, fn: Callable[..., None], do_not_specialize: tuple[str, ...] = (),
                 do_not_specialize_on_alignment: tuple[str, ...] = ()) -> None:
        self.fn = fn
        self.do_not_specialize = do_not_specialize
        self.do_not_specialize_on_alignment = do_not_specialize_on_alignment
        self._jitted: Any = None
        functools.update_wrapper(self, fn)

    def on(self, device: torch.device) -> Any:
        triton, language = _load_triton()
        # Triton's own tl.sum & co. were decorated at its import; they must match our mode.
        stdlib_interpreted = type(language.cdiv).__name__ == "InterpretedFunction"
        if stdlib_interpreted != interpreter_enabled() or (
            device.type == "cpu" and not stdlib_interpreted
        ):
            raise RuntimeError(
                "Triton kernels on CPU tensors need TRITON_INTERPRET=1, and it must be set (or "
                "unset) before triton is first imported in the process"
            )
        if self._jitted is None:
            self._jitted = triton.jit(
                self.fn, do_not_specialize=list(self.do_not_specialize) or None,
                do_not_specialize_on_alignment=list(self.do_not_specialize_on_alignment) or None,
            )
            _bind(self.fn, triton, language)
        return self._jitted


class TritonHelper:
    """A device function for kernels, jitted lazily; it may have a separate body for the CPU
    interpreter where the interpreter's arithmetic differs from GPUs'."""

    def __init__(self, fn: Callable[..., Any], interpreted: Callable[..., Any] | None = None) -> None:
        self.fn = fn
        self.interpreted = interpreted
        self._jitted: Any = None
        functools.update_wrapper(self, fn)

    def jitted(self, triton: Any, language: Any) -> Any:
        if self._jitted is None:
            fn = self.interpreted if self.interpreted and interpreter_enabled() else self.fn
            self._jitted = triton.jit(fn)  # before binding: _bind may revisit this helper
            _bind(fn, triton, language)
        return self._jitted


def triton_kernel(fn: Callable[..., None] | None = None, *, do_not_specialize: tuple[str, ...] = (),
                  do_not_specialize_on_alignment: tuple[str, ...] = ()) -> Any:
    """Decorator: wrap a kernel function in a :class:`TritonKernel`; ``@triton_kernel`` or
    ``@triton_kernel(do_not_specialize=("num_seqs",))``.

    Triton compiles one variant per value class of every integer argument (equal to 1,
    divisible by 16, other) and per alignment class of every pointer (16-byte aligned or not).
    Arguments that change with each engine step belong in the two lists, so a step of a new
    shape never compiles a variant in the middle of serving: token, request and pair counts in
    ``do_not_specialize``; per-request metadata a mixed step passes as views past its decode
    rows (state indices, start offsets, initial-state flags: aligned or not with the number of
    decodes) in ``do_not_specialize_on_alignment``. Strides, model dimensions and activation
    pointers keep their specialisation."""
    if fn is None:
        return lambda f: TritonKernel(f, do_not_specialize, do_not_specialize_on_alignment)
    return TritonKernel(fn, do_not_specialize, do_not_specialize_on_alignment)


# The per-request metadata pointers of the varlen state kernels (state indices, start offsets,
# initial-state flags): a mixed step passes them as views past its decode rows.
PER_REQUEST_VIEWS = ("idx_ptr", "cu_ptr", "init_ptr")

SEARCH_STEPS_MIN = 11  # binary searches over up to 2047 requests share one compiled variant


def search_steps(count: int) -> int:
    """Steps of a fixed-length binary search over ``count`` sorted entries, as a kernel
    constexpr: at least ``SEARCH_STEPS_MIN``, so the value (and the compiled kernel) does not
    change with each step's request count; the extra steps of a smaller search keep its answer
    (once ``lo == hi`` every step leaves it)."""
    return max(SEARCH_STEPS_MIN, count.bit_length())


def triton_helper(
    interpreted: Callable[..., Any] | None = None,
) -> Callable[[Callable[..., Any]], TritonHelper]:
    """Decorator: mark a device function; ``interpreted`` replaces it under the interpreter."""

    def wrap(fn: Callable[..., Any]) -> TritonHelper:
        return TritonHelper(fn, interpreted)

    return wrap


# --------------------------------------------------------------------------- device helpers
# The CPU interpreter differs from GPUs in two ways that matter here: it rounds float32 ->
# bfloat16 by truncation (GPUs round to nearest even), and its tl.dot multiplies bf16 operands
# as raw 16-bit integers. The interpreted bodies below restore GPU semantics, so CPU tests check
# the arithmetic the GPU will do.


def _cast_interpreted(x, dtype: tl.constexpr):
    if dtype == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton_helper(interpreted=_cast_interpreted)
def cast(x, dtype: tl.constexpr):
    """Round ``x`` to ``dtype`` (round to nearest even, as GPUs do)."""
    return x.to(dtype)


def _dot_interpreted(a, b, precision: tl.constexpr):
    return tl.dot(a.to(tl.float32), b.to(tl.float32))


@triton_helper(interpreted=_dot_interpreted)
def dot(a, b, precision: tl.constexpr):
    """``tl.dot`` with float32 accumulation; ``precision`` from :func:`dot_precision`."""
    return tl.dot(a, b, input_precision=precision)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@functools.lru_cache(maxsize=None)
def _device_compute_units(device_type: str, index: int | None) -> int:
    if device_type == "cuda":  # ROCm builds of torch also report "cuda" (count = CUs)
        return torch.cuda.get_device_properties(index or 0).multi_processor_count
    return os.cpu_count() or 1


def num_compute_units(device: torch.device) -> int:
    """Streaming multiprocessors (CUDA), compute units (ROCm) or CPU cores of ``device``."""
    index = device.index if device.index is not None else (
        torch.cuda.current_device() if device.type == "cuda" else None
    )
    return _device_compute_units(device.type, index)


def dot_precision(dtype: torch.dtype) -> str | None:
    """``tl.dot`` input precision: exact fp32 for fp32 inputs (TF32 would break fp32 accuracy);
    the target's default for 16-bit inputs, whose products are exact anyway."""
    return "ieee" if dtype == torch.float32 else None


# --------------------------------------------------------------------------- argument checks


def check_dtype(name: str, t: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if t.dtype not in allowed:
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of {tuple(allowed)}")


def check_shape(name: str, t: torch.Tensor, shape: Sequence[int | None]) -> None:
    """``shape`` entries of None match any size."""
    ok = t.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, t.shape))
    if not ok:
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} has shape {list(t.shape)}; expected {want}")


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        raise ValueError(f"tensors are on different devices: {devices}")
    return first


def check_contiguous_last_dim(name: str, t: torch.Tensor) -> None:
    if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride {t.stride()})")
