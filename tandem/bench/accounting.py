"""Bytes and FLOPs of one decode or prefill step, counted from the model's shape.

These are the roofline's denominators, written down before anything is timed:

- A decode step reads every weight once except the input embedding table, of which it reads
  only the batch's rows (the LM head is read in full; with tied embeddings that is the same
  matrix, counted once). Norm scales and biases are counted; they are tiny.
- It reads the K and V of every context token of every sequence in every layer (the new
  token's K/V included: it is written, then read back by attention) — in a sliding-window layer
  only the last `window` tokens', the only ones its query sees (and the kernel reads).
- Mixture-of-experts layers (a config with `moe`, see `layers/moe.py`): the router (and a
  shared expert) is read in full; of the routed experts a decode step of B tokens reads only
  those some token picked. Routing is data-dependent, so the floor uses the expectation under
  uniform routing: `E * (1 - (1 - k/E)^B)` distinct experts (k per token at B = 1, all E as B
  grows). Real routers are skewed, so fewer experts are usually touched and the measured step
  can beat this floor by that much; the floor is an expectation, not a strict bound.
- A prefill step does `2 x matmul weights` FLOPs per token in the decoder layers (in MoE
  layers the router, the shared expert and the k experts the token is routed to), the LM head
  only for the sampled (last) token of each sequence, and causal attention: `QK^T` and `PV`
  over the `L(L+1)/2` visible (query, key) pairs of a length-L sequence, per head (in a
  sliding-window layer, each query sees at most `window` keys).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from tandem.engine_service.layers.moe import MoeSpec, expected_distinct_experts
from tandem.engine_service.models.llama import DecoderConfig


def shape_from_hf_config(hf: Mapping[str, Any]) -> DecoderConfig:
    """The engine's own `DecoderConfig` for a Hugging Face `config.json` dict: the counts read
    exactly the hyperparameters the model code was built from."""
    from tandem.engine_service.models.registry import get_model_class

    return get_model_class(hf).config_from_hf(hf)


# -- parameters ----------------------------------------------------------------------------------


def layer_matmul_params(s: DecoderConfig) -> int:
    """Weights of one dense decoder layer that take part in matmuls (q, k, v, o, gate, up, down)."""
    return attention_matmul_params(s) + 3 * s.hidden_size * s.intermediate_size


def attention_matmul_params(s: DecoderConfig) -> int:
    """q, k, v and o projections of one layer."""
    q = s.hidden_size * s.num_attention_heads * s.head_dim
    kv = 2 * s.hidden_size * s.num_key_value_heads * s.head_dim
    o = s.num_attention_heads * s.head_dim * s.hidden_size
    return q + kv + o


def moe_spec(s: DecoderConfig) -> MoeSpec | None:
    """The config's mixture-of-experts part, if it has one."""
    return getattr(s, "moe", None)


def _moe_parts(s: DecoderConfig, m: MoeSpec) -> tuple[int, int, int]:
    """(router + shared expert params, params of one routed expert, number of sparse layers)."""
    h = s.hidden_size
    always = m.num_experts * h  # the router
    if m.shared_expert_intermediate_size:
        always += 3 * h * m.shared_expert_intermediate_size + h  # shared expert and its sigmoid gate
    return always, 3 * h * m.moe_intermediate_size, sum(m.sparse_layers)


def mlp_matmul_params(s: DecoderConfig, experts_read: float | None = None) -> float:
    """Feed-forward matmul weights summed over all layers: dense layers in full; in sparse layers
    the router, the shared expert and `experts_read` routed experts (None: all of them)."""
    m = moe_spec(s)
    dense = 3 * s.hidden_size * s.intermediate_size
    if m is None:
        return s.num_hidden_layers * dense
    always, per_expert, sparse = _moe_parts(s, m)
    experts = m.num_experts if experts_read is None else experts_read
    return (s.num_hidden_layers - sparse) * dense + sparse * (always + experts * per_expert)


def _all_matmul_params(s: DecoderConfig, experts_read: float | None = None) -> float:
    return s.num_hidden_layers * attention_matmul_params(s) + mlp_matmul_params(s, experts_read)


def layer_other_params(s: DecoderConfig) -> int:
    """Norm scales and biases of one decoder layer."""
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


def embedding_params(s: DecoderConfig) -> int:
    return s.vocab_size * s.hidden_size


def total_params(s: DecoderConfig) -> int:
    """Every parameter once (a tied LM head is the embedding, not a second matrix)."""
    layers = int(_all_matmul_params(s)) + s.num_hidden_layers * layer_other_params(s)
    head = 0 if s.tie_word_embeddings else s.vocab_size * s.hidden_size
    return embedding_params(s) + layers + s.hidden_size + head  # + final norm


# -- decode --------------------------------------------------------------------------------------


def decode_experts_read(s: DecoderConfig, batch: int) -> float | None:
    """Routed experts per sparse layer a decode step of `batch` tokens reads: the expectation
    under uniform routing, `E * (1 - (1 - k/E)^batch)`; None for a dense model."""
    m = moe_spec(s)
    return None if m is None else expected_distinct_experts(m.num_experts, m.top_k, batch)


def decode_weight_bytes(s: DecoderConfig, batch: int, dtype_bytes: int) -> int:
    """Weight bytes one decode step of `batch` sequences reads from memory (MoE: only the
    experts expected to be picked, see `decode_experts_read`)."""
    matmul = _all_matmul_params(s, decode_experts_read(s, batch))
    layers = round(matmul) + s.num_hidden_layers * layer_other_params(s)
    head = s.vocab_size * s.hidden_size  # the LM head is read in full (tied or not)
    embedding_rows = 0 if s.tie_word_embeddings else batch * s.hidden_size  # tied: inside the head
    return (layers + s.hidden_size + head + embedding_rows) * dtype_bytes


def kv_bytes_per_token(s: DecoderConfig, dtype_bytes: int) -> int:
    """K and V of one token across all layers."""
    return 2 * s.num_hidden_layers * s.num_key_value_heads * s.head_dim * dtype_bytes


def visible_keys(context: int, window: int | None) -> int:
    """Keys the newest query of a `context`-token sequence attends to in a layer with `window`."""
    return context if window is None else min(context, window)


def decode_kv_bytes(s: DecoderConfig, batch: int, context: int, dtype_bytes: int) -> int:
    """KV bytes one decode step reads: every sequence's `context` tokens (the new one included),
    or, in a sliding-window layer, only the window's."""
    per_layer_token = 2 * s.num_key_value_heads * s.head_dim * dtype_bytes
    return batch * per_layer_token * sum(visible_keys(context, w) for w in s.windows)


def decode_floor_s(weight_bytes: int, kv_bytes: int, bandwidth_bytes_per_s: float) -> float:
    """The memory-bound lower limit of the step: bytes read / measured bandwidth."""
    if bandwidth_bytes_per_s <= 0:
        raise ValueError("bandwidth must be > 0")
    return (weight_bytes + kv_bytes) / bandwidth_bytes_per_s


# -- prefill -------------------------------------------------------------------------------------


def causal_pairs(seq_len: int, window: int | None) -> int:
    """(query, key) pairs a length-L causal sequence attends over, each query seeing at most `window` keys."""
    if window is None or window >= seq_len:
        return seq_len * (seq_len + 1) // 2
    return window * (window + 1) // 2 + (seq_len - window) * window


def causal_attention_flops(s: DecoderConfig, seq_len: int) -> int:
    """`QK^T` + `PV` of one length-L sequence over its causal pairs, all layers (2 FLOPs per MAC)."""
    pairs = sum(causal_pairs(seq_len, w) for w in s.windows)
    return 2 * (2 * s.num_attention_heads * s.head_dim * pairs)


def prefill_flops(s: DecoderConfig, seq_lens: Iterable[int], num_sampled: int | None = None) -> dict[str, int]:
    """FLOPs of one prefill step over fresh sequences of `seq_lens` tokens.

    `num_sampled` sequences get LM-head logits (default: all of them, one row each).
    """
    lens = [int(n) for n in seq_lens]
    tokens = sum(lens)
    sampled = len(lens) if num_sampled is None else num_sampled
    m = moe_spec(s)
    per_token = _all_matmul_params(s, None if m is None else m.top_k)  # a token runs its k experts
    linear = 2 * int(per_token) * tokens
    head = 2 * s.vocab_size * s.hidden_size * sampled
    attention = sum(causal_attention_flops(s, n) for n in lens)
    return {"linear": linear, "lm_head": head, "attention": attention, "total": linear + head + attention,
            "tokens": tokens}
