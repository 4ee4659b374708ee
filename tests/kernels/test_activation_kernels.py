"""SiLU-and-multiply: Triton kernel (CPU interpreter) vs a float64 formula and the reference."""

import os

# Triton reads this when triton.language is first imported (kernels import it lazily, at launch).
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from tandem.kernels.activation import silu_and_mul, silu_and_mul_reference  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def naive(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[1] // 2
    gate, up = x[:, :half].double(), x[:, half:].double()
    return gate / (1.0 + torch.exp(-gate)) * up


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens,inter", [(1, 64), (5, 1500), (3, 2048)])
def test_silu_and_mul(dtype: torch.dtype, tokens: int, inter: int) -> None:
    gen = torch.Generator().manual_seed(tokens * inter)
    x = (torch.randn(tokens, 2 * inter, generator=gen) * 4).to(dtype)  # saturating gates too
    out = torch.full((tokens, inter), float("nan"), dtype=dtype)
    silu_and_mul(x, out=out)
    assert not out.isnan().any()
    assert rel_err(out, naive(x)) <= TOL[dtype]
    assert rel_err(silu_and_mul_reference(x), naive(x)) <= TOL[dtype]


def test_strided_rows_and_empty() -> None:
    gen = torch.Generator().manual_seed(41)
    wide = torch.randn(4, 3000, generator=gen)
    x = wide[:, :2000]  # rows padded out to 3000 elements
    assert rel_err(silu_and_mul(x), naive(x)) <= 1e-5
    assert silu_and_mul(torch.empty(0, 8)).shape == (0, 4)
    with pytest.raises(ValueError):
        silu_and_mul(torch.randn(2, 7))
