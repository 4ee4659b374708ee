"""Which attention backend (and with it which op set of every layer) a model runs on.

`select_attention_backend` is the one place that decides: the Triton kernels
(`layers/triton_backend.py`) on CUDA, the PyTorch reference (`layers/attention.py`) on CPU, or
what `ModelConfig.attention_backend` asks for. It lives apart from both backends so that neither
imports the other.
"""

from __future__ import annotations

import sys

import structlog
import torch

from tandem.engine_service.layers.attention import ATTENTION_BACKENDS, AttentionBackend, TorchReferenceBackend

log = structlog.get_logger(__name__)


def select_attention_backend(device: torch.device | str, choice: str = "auto") -> AttentionBackend:
    """The single place that picks the attention implementation for a device.

    `auto`: Triton on CUDA (when Triton is installed), the PyTorch reference elsewhere.
    `torch` / `triton` force one; `triton` on CPU runs the kernels in Triton's interpreter
    (`TRITON_INTERPRET=1`, for tests), and is refused when Triton was already imported
    without it.
    """
    if choice not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {choice!r}")
    device = torch.device(device)
    # Imported here: the Triton backend pulls in the kernel modules, which the CPU path never needs.
    from tandem.kernels._utils import interpreter_enabled, triton_available

    if choice == "torch" or (choice == "auto" and device.type != "cuda"):
        return TorchReferenceBackend()
    if not triton_available():
        if choice == "triton":
            raise ValueError("attention backend 'triton' needs the triton package (pip install triton)")
        log.warning("triton is not installed; using the PyTorch reference attention", device=str(device))
        return TorchReferenceBackend()
    # On CPU the kernels only run interpreted; the kernel loader turns the interpreter on by
    # itself when Triton is not imported yet and no GPU exists, otherwise it must already be on.
    interpretable = interpreter_enabled() or ("triton" not in sys.modules and not torch.cuda.is_available())
    if device.type != "cuda" and not interpretable:
        raise ValueError(
            "attention backend 'triton' on CPU needs TRITON_INTERPRET=1 before triton is first imported"
        )
    from tandem.engine_service.layers.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()
