"""The ``gdn`` section of ``tandem/gpu_checks/kernel_check.py`` builds its cases and passes its own
correctness checks on CPU (Triton interpreter) at shrunken shapes, so a GPU run is not the first
time its code runs. (Timing needs CUDA and is not exercised here.)"""

import os

# Triton reads this when triton.language is first imported (kernels import it lazily, at launch).
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from tandem.gpu_checks import kernel_check as gpu_check  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread is faster than several fighting over a shared box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_gdn_cases_check_out_on_cpu(monkeypatch) -> None:
    monkeypatch.setitem(gpu_check.GDN, "heads", 2)
    monkeypatch.setitem(gpu_check.GDN, "vheads", 4)
    monkeypatch.setitem(gpu_check.GDN, "kdim", 16)
    monkeypatch.setitem(gpu_check.GDN, "vdim", 32)
    monkeypatch.setattr(gpu_check, "GDN_CONV_DIM", 2 * 2 * 16 + 4 * 32)
    monkeypatch.setattr(gpu_check, "GDN_PREFILL_LENGTHS", ([70], [20, 1, 33, 16]))
    monkeypatch.setattr(gpu_check, "GDN_DECODE_BATCHES", (1, 6))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    gen = torch.Generator().manual_seed(0)
    seen = set()
    for case in gpu_check._gdn_cases(True, torch.device("cpu"), gen):
        result = gpu_check._check(case)
        assert result["ok"], (case.kernel, case.name, result)
        assert case.bytes_moved > 0
        for extra in case.extra_timings.values():
            extra()  # the contrast timings run too
        seen.add(case.kernel)
    assert seen == set(gpu_check._gdn_cases.kernels)
