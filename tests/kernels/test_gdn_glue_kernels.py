"""The hybrid models' glue in Triton, under the CPU interpreter, against the torch twins: the
zero-centred (fused-add) RMSNorm (`norm.py`, `zero_centered=True`) and the GDN gates
(`gdn_gates.py`); and `ZeroCenteredRMSNorm(fused=True)` against its PyTorch op set."""

import os

# Triton reads this when triton.language is first imported (kernels import it lazily, at launch).
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tandem.engine_service.layers.norm import ZeroCenteredRMSNorm  # noqa: E402
from tandem.kernels import gdn_gates, norm  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_centered_rmsnorm_matches_twin(dtype: torch.dtype) -> None:
    gen = _gen(1)
    # A strided [T, heads, D] view, as the gated attention's q heads sliced from q_proj.
    x = torch.randn(5, 3, 2, 40, generator=gen).to(dtype)[:, :, 0]
    weight = (torch.randn(40, generator=gen) * 0.3).to(dtype)
    out = norm.rmsnorm(x, weight, 1e-6, zero_centered=True)
    ref = norm.rmsnorm_reference(x, weight, 1e-6, zero_centered=True)
    assert out.shape == x.shape and out.is_contiguous()
    torch.testing.assert_close(out, ref, rtol=1e-6 if dtype == torch.float32 else 0, atol=1e-6 if dtype == torch.float32 else 0)
    # Not the plain RMSNorm: the scale is 1 + weight.
    assert not torch.allclose(out.float(), norm.rmsnorm_reference(x, weight, 1e-6).float(), atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_centered_fused_add_matches_twin(dtype: torch.dtype) -> None:
    gen = _gen(2)
    x, res = torch.randn(7, 96, generator=gen).to(dtype), torch.randn(7, 96, generator=gen).to(dtype)
    weight = (torch.randn(96, generator=gen) * 0.3).to(dtype)
    out, new_res = norm.fused_add_rmsnorm(x, res, weight, 1e-6, zero_centered=True)
    ref, ref_res = norm.fused_add_rmsnorm_reference(x, res, weight, 1e-6, zero_centered=True)
    assert torch.equal(new_res, ref_res)
    tol = 1e-6 if dtype == torch.float32 else 0
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_centered_layer_fused_matches_torch_op_set(dtype: torch.dtype) -> None:
    gen = _gen(3)
    plain, fused = ZeroCenteredRMSNorm(64, 1e-6), ZeroCenteredRMSNorm(64, 1e-6, fused=True)
    with torch.no_grad():
        plain.weight.copy_(torch.randn(64, generator=gen) * 0.2)
        fused.weight.copy_(plain.weight)
    plain, fused = plain.to(dtype), fused.to(dtype)
    x, res = torch.randn(4, 64, generator=gen).to(dtype), torch.randn(4, 64, generator=gen).to(dtype)
    tol = 1e-6 if dtype == torch.float32 else 0
    torch.testing.assert_close(fused(x), plain(x), rtol=tol, atol=tol)
    (a, ra), (b, rb) = fused(x, res), plain(x, res)
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    assert torch.equal(ra, rb)


def _hf_gates(b, a, a_log, dt_bias):
    """transformers' Qwen3NextGatedDeltaNet arithmetic, written out here."""
    return b.sigmoid(), -a_log.float().exp() * F.softplus(a.float() + dt_bias)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gdn_gates_packed_views_match_twin(dtype: torch.dtype) -> None:
    """Qwen3-Next's packed in_proj_ba output [T, H, 2R] read in place (b then a per key head)."""
    gen = _gen(4)
    t, h, r = 6, 4, 3
    ba = (torch.randn(t, h, 2 * r, generator=gen) * 12).to(dtype)  # wide: softplus's both branches
    b, a = ba[:, :, :r], ba[:, :, r:]
    a_log = torch.randn(h * r, generator=gen).to(dtype)
    dt_bias = torch.randn(h * r, generator=gen).to(dtype)
    beta, g = gdn_gates.gdn_gates(b, a, a_log, dt_bias)
    ref_beta, ref_g = gdn_gates.gdn_gates_ref(b, a, a_log, dt_bias)
    hf_beta, hf_g = _hf_gates(b.reshape(t, -1), a.reshape(t, -1), a_log, dt_bias)
    assert beta.dtype == dtype and g.dtype == torch.float32 and beta.shape == g.shape == (t, h * r)
    assert torch.equal(ref_beta, hf_beta) and torch.equal(ref_g, hf_g)
    pre = a.reshape(t, -1).float() + dt_bias.float()
    assert (pre > 20).any() and (pre < -5).any()
    torch.testing.assert_close(beta, ref_beta, rtol=1e-6 if dtype == torch.float32 else 0, atol=1e-6)
    torch.testing.assert_close(g, ref_g, rtol=2e-6, atol=1e-30)


def test_gdn_gates_split_projections_match_twin() -> None:
    """Qwen3.5's separate in_proj_b / in_proj_a outputs, [T, HV] each."""
    gen = _gen(5)
    b, a = torch.randn(3, 8, generator=gen), torch.randn(3, 8, generator=gen) * 4
    a_log, dt_bias = torch.randn(8, generator=gen), torch.randn(8, generator=gen)
    beta, g = gdn_gates.gdn_gates(b, a, a_log, dt_bias)
    ref_beta, ref_g = gdn_gates.gdn_gates_ref(b, a, a_log, dt_bias)
    torch.testing.assert_close(beta, ref_beta, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(g, ref_g, rtol=2e-6, atol=1e-30)
    with pytest.raises(ValueError, match="differ in shape"):
        gdn_gates.gdn_gates(b, a[:, :4], a_log, dt_bias)
