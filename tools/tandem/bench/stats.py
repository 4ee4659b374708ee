"""Summary statistics for latency lists (milliseconds in, dict out)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def summarize(values: Sequence[float], scale: float = 1.0) -> dict[str, float | int | None]:
    """mean, p50, p90, p99, min, max and count of `values` x `scale` (None fields when empty)."""
    if len(values) == 0:
        return {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "min": None, "max": None}
    a = np.asarray(values, dtype=np.float64) * scale
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {
        "count": int(a.size),
        "mean": float(a.mean()),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "min": float(a.min()),
        "max": float(a.max()),
    }
