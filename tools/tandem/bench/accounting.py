"""Bytes and FLOPs of one decode or prefill step, counted from the model's shape.

These are the roofline's denominators, written down before anything is timed. Every count is a
sum over the model's layers as `layer_counts` describes them (one `LayerCount` per decoder layer:
its token mixer — attention, or a Gated DeltaNet in the hybrid models of `models/qwen3_next.py` —
and its feed-forward, dense or sparse):

- A decode step reads every weight once except the input embedding table, of which it reads
  only the batch's rows (the LM head is read in full; with tied embeddings that is the same
  matrix, counted once). Norm scales and biases are counted; they are tiny. A Gated DeltaNet
  layer's weights are its projections, conv1d taps, `A_log`, `dt_bias` and norm scale (the
  counts `GatedDeltaNetShape` declares next to the module); a gated attention layer's `q_proj`
  is twice as wide (queries and the output gate).
- It reads the K and V of every context token of every sequence in every attention layer (the
  new token's K/V included: it is written, then read back by attention) — in a sliding-window
  layer only the last `window` tokens', the only ones its query sees (and the kernel reads).
  Gated DeltaNet layers have no K/V: each sequence's state slot (conv state in the model dtype,
  recurrent state in float32: the model's own cache layout, the pools' shapes and dtypes) is
  read and written back once per step, `2 x state bytes` per sequence.
- Mixture-of-experts layers (a config with `moe`, see `layers/moe.py`): the router (and a
  shared expert) is read in full; of the routed experts a decode step of B tokens reads only
  those some token picked. Routing is data-dependent, so the floor uses the expectation under
  uniform routing: `E * (1 - (1 - k/E)^B)` distinct experts (k per token at B = 1, all E as B
  grows). Real routers are skewed, so fewer experts are usually touched and the measured step
  can beat this floor by that much; the floor is an expectation, not a strict bound.
- A prefill step does `2 x matmul weights` FLOPs per token in the decoder layers (in MoE
  layers the router, the shared expert and the k experts the token is routed to; in Gated
  DeltaNet layers their projections), the LM head only for the sampled (last) token of each
  sequence, and causal attention in the attention layers: `QK^T` and `PV` over the `L(L+1)/2`
  visible (query, key) pairs of a length-L sequence, per head (in a sliding-window layer, each
  query sees at most `window` keys). Gated DeltaNet layers add their convolution and the
  chunked delta rule (`linear_attention_flops`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tandem.engine_service.layers.gated_deltanet import GatedDeltaNetShape
from tandem.engine_service.layers.moe import MoeSpec, expected_distinct_experts
from tandem.engine_service.models.llama import DecoderConfig
from tandem.engine_service.models.qwen3_next import HybridConfig, hybrid_cache_layout
from tandem.kernels.gated_delta_rule import DEFAULT_CHUNK_SIZE

# A cache dtype name of each element size: state layouts are declared with dtype names, and only
# the size matters for bytes.
_DTYPE_OF_SIZE = {4: "float32", 2: "bfloat16", 1: "float8_e4m3fn"}


def shape_from_hf_config(hf: Mapping[str, Any]) -> Any:
    """The engine's own config (`DecoderConfig`, or `HybridConfig` for the hybrid models) for a
    Hugging Face `config.json` dict: the counts read exactly the hyperparameters the model code
    was built from."""
    from tandem.engine_service.models.registry import get_model_class

    return get_model_class(hf).config_from_hf(hf)


# -- layers --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionLayer:
    """What an attention layer's K/V and attention FLOPs depend on."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int | None  # None: full attention


@dataclass(frozen=True)
class LayerCount:
    """One decoder layer as the accounting counts it.

    `mixer_matmul`: weights of the token mixer's matmuls (attention q/k/v/o, or a Gated DeltaNet's
    projections). `other`: every other weight of the layer outside the feed-forward's matmuls
    (norm scales, biases, conv taps, per-head scalars). `dense_mlp`: the dense feed-forward's
    matmul weights (0 in a sparse layer, whose weights `moe_spec` describes). Exactly one of
    `attention` and `gdn` is set.
    """

    mixer_matmul: int
    other: int
    dense_mlp: int
    sparse: bool
    attention: AttentionLayer | None = None
    gdn: GatedDeltaNetShape | None = None


def attention_matmul_params(s: DecoderConfig) -> int:
    """q, k, v and o projections of one layer of a plain decoder."""
    q = s.hidden_size * s.num_attention_heads * s.head_dim
    kv = 2 * s.hidden_size * s.num_key_value_heads * s.head_dim
    o = s.num_attention_heads * s.head_dim * s.hidden_size
    return q + kv + o


def layer_other_params(s: DecoderConfig) -> int:
    """Norm scales and biases of one plain decoder layer."""
    n = 2 * s.hidden_size  # input and post-attention RMSNorm
    if s.qk_norm:
        n += 2 * s.head_dim
    if s.qkv_bias:
        n += (s.num_attention_heads + 2 * s.num_key_value_heads) * s.head_dim
    if s.o_bias:
        n += s.hidden_size
    if s.mlp_bias:
        n += 2 * s.intermediate_size + s.hidden_size
    return n


def moe_spec(s: Any) -> MoeSpec | None:
    """The config's mixture-of-experts part, if it has one."""
    return getattr(s, "moe", None)


def _hybrid_layers(s: HybridConfig) -> tuple[LayerCount, ...]:
    """Layers of `models/qwen3_next.py`: a GDN or a gated attention (q_proj twice as wide for the
    output gate; zero-centred q/k norms) mixer, then a dense MLP or the sparse MoE block."""
    h, d = s.hidden_size, s.head_dim
    heads, kv_heads = s.num_attention_heads, s.num_key_value_heads
    m = moe_spec(s)
    out = []
    for i, kind in enumerate(s.layer_types):
        sparse = bool(m is not None and m.sparse_layers[i])
        dense = 0 if sparse else 3 * h * s.intermediate_size
        norms = 2 * h  # input and post-attention norms
        if kind == "linear_attention":
            out.append(LayerCount(s.gdn.matmul_params(), norms + s.gdn.other_params(), dense, sparse, gdn=s.gdn))
            continue
        matmul = h * 2 * heads * d + 2 * h * kv_heads * d + heads * d * h
        other = norms + 2 * d  # q_norm, k_norm
        if s.attention_bias:
            other += 2 * heads * d + 2 * kv_heads * d + h
        out.append(LayerCount(matmul, other, dense, sparse, attention=AttentionLayer(heads, kv_heads, d, None)))
    return tuple(out)


def layer_counts(s: Any) -> tuple[LayerCount, ...]:
    """Every decoder layer of the model `s` (a `DecoderConfig`, an MoE one, or a `HybridConfig`)."""
    if isinstance(s, HybridConfig):
        return _hybrid_layers(s)
    m = moe_spec(s)
    return tuple(
        LayerCount(
            attention_matmul_params(s), layer_other_params(s),
            0 if m is not None and m.sparse_layers[i] else 3 * s.hidden_size * s.intermediate_size,
            bool(m is not None and m.sparse_layers[i]),
            attention=AttentionLayer(s.num_attention_heads, s.num_key_value_heads, s.head_dim, window),
        )
        for i, window in enumerate(s.windows)
    )


def attention_windows(s: Any) -> tuple[int | None, ...]:
    """The window of every attention layer (None = full attention); GDN layers are not listed."""
    return tuple(layer.attention.window for layer in layer_counts(s) if layer.attention is not None)


# -- parameters ----------------------------------------------------------------------------------


def _moe_parts(s: Any, m: MoeSpec) -> tuple[int, int]:
    """(router + shared expert params, params of one routed expert) of one sparse layer."""
    h = s.hidden_size
    always = m.num_experts * h  # the router
    if m.shared_expert_intermediate_size:
        always += 3 * h * m.shared_expert_intermediate_size + h  # shared expert and its sigmoid gate
    return always, 3 * h * m.moe_intermediate_size


def _all_matmul_params(s: Any, experts_read: float | None = None) -> float:
    """Matmul weights of every decoder layer: mixers, dense feed-forwards, and in sparse layers
    the router, the shared expert and `experts_read` routed experts (None: all of them)."""
    layers = layer_counts(s)
    fixed = sum(layer.mixer_matmul + layer.dense_mlp for layer in layers)
    m = moe_spec(s)
    sparse = sum(layer.sparse for layer in layers)
    if m is None or not sparse:
        return fixed
    always, per_expert = _moe_parts(s, m)
    experts = m.num_experts if experts_read is None else experts_read
    return fixed + sparse * (always + experts * per_expert)


def _all_other_params(s: Any) -> int:
    return sum(layer.other for layer in layer_counts(s))


def embedding_params(s: Any) -> int:
    return s.vocab_size * s.hidden_size


def total_params(s: Any) -> int:
    """Every parameter once (a tied LM head is the embedding, not a second matrix)."""
    layers = int(_all_matmul_params(s)) + _all_other_params(s)
    head = 0 if s.tie_word_embeddings else s.vocab_size * s.hidden_size
    return embedding_params(s) + layers + s.hidden_size + head  # + final norm


# -- decode --------------------------------------------------------------------------------------


def decode_experts_read(s: Any, batch: int) -> float | None:
    """Routed experts per sparse layer a decode step of `batch` tokens reads: the expectation
    under uniform routing, `E * (1 - (1 - k/E)^batch)`; None for a dense model."""
    m = moe_spec(s)
    return None if m is None else expected_distinct_experts(m.num_experts, m.top_k, batch)


def fp8_bytes_per_weight(block: tuple[int, int], row: int) -> float:
    """Bytes one FP8 weight element takes with its share of the float32 block scales
    (`block` as `tandem.kernels.fp8_gemm` has it; a block wider than `row` spans the row)."""
    return 1.0 + 4.0 / (block[0] * min(block[1], row))


def _router_params(s: Any) -> int:
    """Router weights of every sparse layer (kept in the model dtype when the rest is FP8)."""
    m = moe_spec(s)
    if m is None:
        return 0
    per_layer = m.num_experts * s.hidden_size + (s.hidden_size if m.shared_expert_intermediate_size else 0)
    return per_layer * sum(layer.sparse for layer in layer_counts(s))


def decode_weight_bytes(s: Any, batch: int, dtype_bytes: int, matmul_bytes: float | None = None) -> int:
    """Weight bytes one decode step of `batch` sequences reads from memory (MoE: only the
    experts expected to be picked, see `decode_experts_read`). `matmul_bytes`: bytes per element
    of the projections and experts when they are stored narrower than the model dtype (FP8:
    `fp8_bytes_per_weight`); the routers, norms, embedding and LM head stay at `dtype_bytes`."""
    matmul = _all_matmul_params(s, decode_experts_read(s, batch))
    head = s.vocab_size * s.hidden_size  # the LM head is read in full (tied or not)
    embedding_rows = 0 if s.tie_word_embeddings else batch * s.hidden_size  # tied: inside the head
    if matmul_bytes is None:
        layers = round(matmul) + _all_other_params(s)
        return (layers + s.hidden_size + head + embedding_rows) * dtype_bytes
    routers = _router_params(s)
    narrow = (matmul - routers) * matmul_bytes
    return round(narrow + (routers + _all_other_params(s) + s.hidden_size + head + embedding_rows) * dtype_bytes)


def _kv_bytes_per_layer_token(a: AttentionLayer, dtype_bytes: int) -> int:
    return 2 * a.num_kv_heads * a.head_dim * dtype_bytes


def kv_bytes_per_token(s: Any, dtype_bytes: int) -> int:
    """K and V of one token across all attention layers."""
    return sum(_kv_bytes_per_layer_token(layer.attention, dtype_bytes) for layer in layer_counts(s)
               if layer.attention is not None)


def visible_keys(context: int, window: int | None) -> int:
    """Keys the newest query of a `context`-token sequence attends to in a layer with `window`."""
    return context if window is None else min(context, window)


def decode_kv_bytes(s: Any, batch: int, context: int, dtype_bytes: int) -> int:
    """KV bytes one decode step reads: every sequence's `context` tokens (the new one included),
    or, in a sliding-window layer, only the window's; attention layers only."""
    return batch * sum(_kv_bytes_per_layer_token(layer.attention, dtype_bytes)
                       * visible_keys(context, layer.attention.window)
                       for layer in layer_counts(s) if layer.attention is not None)


def state_bytes_per_request(s: Any, dtype_bytes: int) -> int:
    """One request's state slot across every state layer (0 for a model without state): the
    model's own cache layout (`hybrid_cache_layout`: conv state in the model dtype of
    `dtype_bytes`, recurrent state in float32), so it equals the state pools' per-slot bytes."""
    if not isinstance(s, HybridConfig):
        return 0
    layout = hybrid_cache_layout(s, _DTYPE_OF_SIZE[dtype_bytes])
    return sum(g.bytes_per_slot() for g in layout.state_groups)


def decode_state_bytes(s: Any, batch: int, dtype_bytes: int) -> int:
    """State bytes one decode step moves: each sequence's slot read once and written back once."""
    return 2 * batch * state_bytes_per_request(s, dtype_bytes)


def decode_floor_s(weight_bytes: int, kv_bytes: int, bandwidth_bytes_per_s: float, state_bytes: int = 0) -> float:
    """The memory-bound lower limit of the step: bytes read (and state written) / measured bandwidth."""
    if bandwidth_bytes_per_s <= 0:
        raise ValueError("bandwidth must be > 0")
    return (weight_bytes + kv_bytes + state_bytes) / bandwidth_bytes_per_s


# -- prefill -------------------------------------------------------------------------------------


def causal_pairs(seq_len: int, window: int | None) -> int:
    """(query, key) pairs a length-L causal sequence attends over, each query seeing at most `window` keys."""
    if window is None or window >= seq_len:
        return seq_len * (seq_len + 1) // 2
    return window * (window + 1) // 2 + (seq_len - window) * window


def causal_attention_flops(s: Any, seq_len: int) -> int:
    """`QK^T` + `PV` of one length-L sequence over its causal pairs, all attention layers (2 FLOPs per MAC)."""
    return sum(2 * (2 * layer.attention.num_heads * layer.attention.head_dim
                    * causal_pairs(seq_len, layer.attention.window))
               for layer in layer_counts(s) if layer.attention is not None)


def gdn_sequence_flops(g: GatedDeltaNetShape, seq_len: int, chunk: int = DEFAULT_CHUNK_SIZE) -> int:
    """One length-L sequence through one Gated DeltaNet layer, beyond its projections (2 FLOPs per MAC):

    - the depthwise convolution, `conv_dim x W` MACs per token;
    - the chunked delta rule (`tandem/kernels/gated_delta_rule.py`), per value head: inside each chunk
      of c tokens (C = 64; the last one shorter), the dense `c x c` products `K Kᵀ`, `W = M⁻¹(..K)`,
      `Q Kᵀ` (each `c² K` MACs) and `U = M⁻¹(..V)`, `(Q Kᵀ) V'` (each `c² V`); per token, three
      products with the `K x V` state (`W S`, `Q S`, the update `Kᵀ V'`). The triangular solve
      (~c³/6 per chunk, under 1% at C = 64), gates, norms and activations are not counted.
    """
    k, v = g.head_k_dim, g.head_v_dim
    full, rest = divmod(seq_len, chunk)
    squares = full * chunk * chunk + rest * rest
    per_head = squares * (3 * k + 2 * v) + seq_len * 3 * k * v
    return 2 * (seq_len * g.conv_dim * g.conv_kernel + g.num_v_heads * per_head)


def linear_attention_flops(s: Any, seq_len: int) -> int:
    """`gdn_sequence_flops` summed over the Gated DeltaNet layers (0 for a model without them)."""
    return sum(gdn_sequence_flops(layer.gdn, seq_len) for layer in layer_counts(s) if layer.gdn is not None)


def prefill_flops(s: Any, seq_lens: Iterable[int], num_sampled: int | None = None) -> dict[str, int]:
    """FLOPs of one prefill step over fresh sequences of `seq_lens` tokens.

    `linear`: the decoder layers' matmul weights (2 per weight and token); `lm_head`: the logits
    of `num_sampled` sequences (default: all of them, one row each); `attention`: causal attention
    of the attention layers; `linear_attention`: the Gated DeltaNet layers' convolution and delta
    rule (`gdn_sequence_flops`).
    """
    lens = [int(n) for n in seq_lens]
    tokens = sum(lens)
    sampled = len(lens) if num_sampled is None else num_sampled
    m = moe_spec(s)
    per_token = _all_matmul_params(s, None if m is None else m.top_k)  # a token runs its k experts
    linear = 2 * int(per_token) * tokens
    head = 2 * s.vocab_size * s.hidden_size * sampled
    attention = sum(causal_attention_flops(s, n) for n in lens)
    gdn = sum(linear_attention_flops(s, n) for n in lens)
    return {"linear": linear, "lm_head": head, "attention": attention, "linear_attention": gdn,
            "total": linear + head + attention + gdn, "tokens": tokens}
