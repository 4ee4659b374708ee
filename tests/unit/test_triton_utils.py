"""`tandem.kernels._utils`: what keeps a step of a new size from compiling a kernel variant.

- `search_steps` is one constexpr value for any request count up to 2047, and a fixed-step
  binary search run with that many steps finds the same request as with the fewest steps;
- the varlen prefill kernels and the fused MoE leave their per-step counts unspecialised, and
  the state kernels the alignment of the per-request views a mixed step passes them.
"""

from __future__ import annotations

import bisect
import random

import pytest

from tandem.kernels import causal_conv1d, fused_moe, gated_delta_rule, gated_norm
from tandem.kernels._utils import SEARCH_STEPS_MIN, search_steps


def test_search_steps_is_one_value_up_to_2047_requests() -> None:
    assert {search_steps(n) for n in range(0, 2048)} == {SEARCH_STEPS_MIN}
    assert search_steps(2048) == 12 and search_steps(5000) == 13  # still enough steps beyond


def _fixed_step_search(offsets: list[int], key: int, steps: int) -> int:
    """The kernels' search (`_chunk_rows`, the conv prefill): last i with offsets[i] <= key."""
    lo, hi = 0, len(offsets) - 2  # offsets has num_seqs + 1 entries; requests are 0..num_seqs-1
    for _ in range(steps):
        mid = (lo + hi + 1) // 2
        ok = offsets[mid] <= key
        lo, hi = (mid, hi) if ok else (lo, mid - 1)
    return lo


@pytest.mark.parametrize("num_seqs", [1, 2, 3, 16, 17, 100])
def test_extra_search_steps_keep_the_answer(num_seqs: int) -> None:
    rng = random.Random(num_seqs)
    lengths = [rng.choice([0, 1, 5, 64]) for _ in range(num_seqs - 1)] + [rng.randint(1, 64)]
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    for key in range(offsets[-1]):
        want = bisect.bisect_right(offsets[:-1], key) - 1  # empty requests share a start: the last wins
        assert _fixed_step_search(offsets, key, max(1, num_seqs.bit_length())) == want
        assert _fixed_step_search(offsets, key, search_steps(num_seqs)) == want


META = ("idx_ptr", "cu_ptr", "init_ptr")


@pytest.mark.parametrize("kernel, counts, views", [
    (gated_delta_rule._chunk_kkt_kernel, ("num_seqs",), ("cu_ptr",)),
    (gated_delta_rule._chunk_solve_kernel, ("num_seqs",), ()),
    (gated_delta_rule._chunk_wu_kernel, ("num_seqs",), ("cu_ptr",)),
    (gated_delta_rule._chunk_output_kernel, ("num_seqs",), ("cu_ptr",)),
    # Compiled mid-run at d21ce81 (bench/probes/compile_probe.py, H200): a mixed step's
    # state_indices[d:] / has_initial_state[d:] views, 16-byte aligned or not with d.
    (gated_delta_rule._chunk_state_kernel, (), META),
    (causal_conv1d._conv_prefill_kernel, ("num_tokens", "num_seqs"), META),
    (causal_conv1d._conv_state_writeback_kernel, (), META),
    (gated_norm._rms_norm_gated_kernel, ("n_rows",), ()),
    (fused_moe._moe_gate_up_kernel, ("num_pairs",), ()),
    (fused_moe._moe_down_kernel, ("num_pairs",), ()),
])
def test_per_step_counts_and_views_are_not_specialised(kernel, counts, views) -> None:
    import inspect

    assert kernel.do_not_specialize == counts and kernel.do_not_specialize_on_alignment == views
    params = inspect.signature(kernel.fn).parameters
    assert all(c in params for c in counts + views)  # names that exist: Triton would reject the rest
