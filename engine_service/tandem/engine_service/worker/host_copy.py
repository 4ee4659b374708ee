"""Moving small tensors between host and device without a host sync.

`HostCopy`: device results on their way to the host. On CUDA the tensors are copied
asynchronously into pinned memory and an event marks the copy's place in the stream: waiting
for it waits for that work only, not for later steps queued behind it (overlapped scheduling).
On CPU the tensors are the result as they are.

`pinned_to_device` / `values_to_device`: the other way, through pinned memory (a plain `.to()`
from pageable memory waits for the device's queue to drain, which would stall an overlapped
step).
"""

from __future__ import annotations

import torch


class HostCopy:
    """`parts` (device tensors) copied to the host; `wait()` returns them there, in order."""

    def __init__(self, parts: list[torch.Tensor]) -> None:
        self._event: torch.cuda.Event | None = None
        if parts and parts[0].device.type == "cuda":
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in parts]
            for host, t in zip(self._host, parts):
                host.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(parts[0].device))
        else:
            self._host = list(parts)

    def ready(self) -> bool:
        """Whether `wait()` would return at once."""
        return self._event is None or self._event.query()

    def wait(self) -> list[torch.Tensor]:
        if self._event is not None:
            self._event.synchronize()
        return self._host


def pinned_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The CPU tensor `t` on `device`, queued without a host sync."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def values_to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return pinned_to_device(torch.tensor(values, dtype=dtype), device)
