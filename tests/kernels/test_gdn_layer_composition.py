"""The GDN kernels composed as a Qwen3-Next Gated DeltaNet layer reproduce Hugging Face's own
layer (``Qwen3NextGatedDeltaNet``, random weights): a chunked prefill in two pieces through the
state slots, then token-by-token decode, against HF's output over the whole sequence at once.
This pins the conventions the model code relies on (conv over [q; k; v], kernel orientation,
g / beta, value-head grouping, gated norm) — for the Triton kernels (CPU interpreter) and for
their PyTorch twins."""

import os

# Triton reads this when triton.language is first imported (kernels import it lazily, at launch).
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig  # noqa: E402
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet  # noqa: E402

from tandem.kernels import causal_conv1d as conv  # noqa: E402
from tandem.kernels import gated_delta_rule as gdr  # noqa: E402
from tandem.kernels import gated_norm  # noqa: E402

IMPLS = {
    "triton": (conv.causal_conv1d_prefill, conv.causal_conv1d_update, gdr.chunk_gated_delta_rule,
               gdr.fused_recurrent_gated_delta_rule_update, gated_norm.rms_norm_gated),
    "ref": (conv.causal_conv1d_prefill_ref, conv.causal_conv1d_update_ref,
            gdr.chunk_gated_delta_rule_ref, gdr.fused_recurrent_gated_delta_rule_update_ref,
            gated_norm.rms_norm_gated_ref),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread is faster than several fighting over a shared box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_layer() -> Qwen3NextGatedDeltaNet:
    config = Qwen3NextConfig(
        hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=32, linear_conv_kernel_dim=4, num_hidden_layers=1,
        layer_types=["linear_attention"], num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts=2, num_experts_per_tok=1, vocab_size=100,
    )
    torch.manual_seed(0)
    layer = Qwen3NextGatedDeltaNet(config, 0).eval()
    with torch.no_grad():  # HF initialises the norm weight to ones: make it matter
        layer.norm.weight.uniform_(0.5, 1.5)
    return layer


class Slots:
    """The layer's two state pools (3 slots + scratch), as the runner would allocate them."""

    def __init__(self, layer: Qwen3NextGatedDeltaNet) -> None:
        self.conv = torch.full((4, layer.conv_dim, layer.conv_kernel_size - 1), float("nan"))
        self.rec = torch.full((4, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim),
                              float("nan"))


def layer_step(layer, impl: str, slots: Slots, hidden: torch.Tensor, slot: int, first: bool,
               decode: bool) -> torch.Tensor:
    """One request's tokens ``hidden [T, hidden]`` through the layer with our kernels."""
    conv_prefill, conv_update, chunk, recurrent, norm = IMPLS[impl]
    tokens = hidden.shape[0]
    qkvz = layer.in_proj_qkvz(hidden[None])
    ba = layer.in_proj_ba(hidden[None])
    q, k, v, z, b, a = (t[0] for t in layer.fix_query_key_value_ordering(qkvz, ba))
    mixed = torch.cat([q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1)], -1)
    weight = layer.conv1d.weight.squeeze(1)
    idx = torch.tensor([slot], dtype=torch.int32)
    cu = torch.tensor([0, tokens], dtype=torch.int32)
    has = torch.tensor([not first])
    if decode:
        mixed = conv_update(mixed, weight, layer.conv1d.bias, slots.conv, idx)
    else:
        mixed = conv_prefill(mixed, weight, layer.conv1d.bias, slots.conv, idx, cu, has)
    q, k, v = torch.split(mixed, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    q = q.reshape(tokens, layer.num_k_heads, layer.head_k_dim)  # strided views, no copies
    k = k.reshape(tokens, layer.num_k_heads, layer.head_k_dim)
    v = v.reshape(tokens, layer.num_v_heads, layer.head_v_dim)
    beta = b.sigmoid()
    g = -layer.A_log.float().exp() * torch.nn.functional.softplus(a.float() + layer.dt_bias)
    scale = layer.head_k_dim**-0.5
    if decode:
        out = recurrent(q, k, v, g, beta, scale, slots.rec, idx)
    else:
        out = chunk(q, k, v, g, beta, scale, slots.rec, idx, cu, has, chunk_size=16)
    out = norm(out, z, layer.norm.weight, layer.norm.variance_epsilon)
    return layer.out_proj(out.reshape(tokens, -1))


@pytest.mark.parametrize("impl", IMPLS)
def test_kernels_compose_to_hf_layer(impl: str) -> None:
    layer = tiny_layer()
    gen = torch.Generator().manual_seed(1)
    tokens = 29
    hidden = torch.randn(tokens, 64, generator=gen)
    with torch.no_grad():
        expected = layer(hidden[None])[0]
        slots = Slots(layer)
        slot = 2
        pieces = [
            layer_step(layer, impl, slots, hidden[:11], slot, first=True, decode=False),
            layer_step(layer, impl, slots, hidden[11:25], slot, first=False, decode=False),
        ]
        pieces += [layer_step(layer, impl, slots, hidden[t : t + 1], slot, first=False, decode=True)
                   for t in range(25, tokens)]
    got = torch.cat(pieces)
    err = ((got - expected).abs().max() / expected.abs().max()).item()
    assert err <= 1e-5, err
    # Only the request's slot was touched.
    for s in (0, 1, 3):
        assert slots.conv[s].isnan().all() and slots.rec[s].isnan().all()
