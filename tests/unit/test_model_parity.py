"""Our paged model against Hugging Face transformers on the same random weights.

Each family (Llama, Qwen2 with q/k/v bias, Qwen3 with q/k norm, plus Llama-3 and YaRN RoPE
scaling) is saved by transformers, loaded by our loader, and run through the paged KV cache in
several ways (whole prompt, chunks, token by token, batched, shared prefix blocks); every
position's logits must match the full-sequence HF forward.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tandem.engine_service.layers.attention import AttentionMetadata, paged_attention_reference, write_kv
from tandem.engine_service.worker.loader import build_model, resolve_model
from tandem.engine_service.sequence import SamplingParams, Sequence
from tests.conftest import model_rows

ATOL = 1e-4
BLOCK_SIZE = 4
NUM_BLOCKS = 64

class PagedHarness:
    """Our model plus a KV cache and a shuffled block allocator, driven step by step."""

    def __init__(self, path: Path) -> None:
        self.model = build_model(resolve_model(str(path)), "cpu", torch.float32)
        cfg = self.model.config
        shape = (2, NUM_BLOCKS, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [torch.zeros(shape) for _ in range(cfg.num_hidden_layers)]
        # Layers of every cache group share these tensors and one block table (nothing is freed
        # here), so each sequence's extra group tables are copies of its first.
        self.num_groups = len(self.model.cache_layout("float32").paged_groups)
        # Non-contiguous physical blocks, so a wrong slot or block-table lookup cannot pass.
        self.free_blocks = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(0)).tolist()

    def new_seq(self, tokens: list[int], rid: str = "r") -> Sequence:
        return Sequence(rid, tokens, SamplingParams())

    def ensure_blocks(self, seq: Sequence, num_tokens: int) -> None:
        while len(seq.block_table) * BLOCK_SIZE < num_tokens:
            seq.block_table.append(self.free_blocks.pop())

    @torch.inference_mode()
    def step(self, work: list[tuple[Sequence, int]]) -> list[torch.Tensor]:
        """Run `n` new tokens of each sequence; returns each one's logits for all its new rows."""
        for seq, n in work:
            self.ensure_blocks(seq, seq.num_computed_tokens + n)
            seq.block_tables[1:] = [seq.block_table] * (self.num_groups - 1)
        return model_rows(self.model, self.kv_caches, work, BLOCK_SIZE)


def hf_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def prompt(n: int, seed: int, vocab: int = 320) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# The sliding-window ones (window 8) run with every prompt longer than their window.
FAMILIES = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-qwen3-sw"]


@pytest.mark.parametrize("name", FAMILIES)
def test_whole_prompt_matches_hf(tmp_path: Path, name: str, hf_checkpoint) -> None:
    hf, path = hf_checkpoint(tmp_path, name)
    harness = PagedHarness(path)
    tokens = prompt(23, seed=1)
    (ours,) = harness.step([(harness.new_seq(tokens), len(tokens))])
    ref = hf_logits(hf, tokens)
    assert ref.abs().max() > 0.5  # logits are not degenerate, so the tolerance means something
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", FAMILIES)
def test_chunked_prefill_and_decode_match_hf(tmp_path: Path, name: str, hf_checkpoint) -> None:
    hf, path = hf_checkpoint(tmp_path, name)
    tokens = prompt(21, seed=2)
    ref = hf_logits(hf, tokens)

    chunked = PagedHarness(path)
    seq = chunked.new_seq(tokens)
    parts = [chunked.step([(seq, n)])[0] for n in (5, 9, 7)]  # chunk edges fall mid-block
    torch.testing.assert_close(torch.cat(parts), ref, atol=ATOL, rtol=0)

    decoded = PagedHarness(path)
    seq = decoded.new_seq(tokens)
    rows = [decoded.step([(seq, 1)])[0] for _ in tokens]
    torch.testing.assert_close(torch.cat(rows), ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", FAMILIES)
def test_batched_sequences_match_hf(tmp_path: Path, name: str, hf_checkpoint) -> None:
    hf, path = hf_checkpoint(tmp_path, name)
    harness = PagedHarness(path)
    a_tokens, b_tokens, c_tokens = prompt(17, seed=3), prompt(6, seed=4), prompt(11, seed=5)
    a, b, c = harness.new_seq(a_tokens, "a"), harness.new_seq(b_tokens, "b"), harness.new_seq(c_tokens, "c")
    # Step 1: a and b prefill together (different lengths). Step 2: a decodes one token while
    # b finishes its prompt and c starts: decode and prefill rows mixed in one batch.
    a1, b1 = harness.step([(a, 16), (b, 3)])
    a2, b2, c1 = harness.step([(a, 1), (b, 3), (c, 11)])
    torch.testing.assert_close(torch.cat([a1, a2]), hf_logits(hf, a_tokens), atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat([b1, b2]), hf_logits(hf, b_tokens), atol=ATOL, rtol=0)
    torch.testing.assert_close(c1, hf_logits(hf, c_tokens), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", FAMILIES)
def test_shared_prefix_blocks_match_hf(tmp_path: Path, name: str, hf_checkpoint) -> None:
    hf, path = hf_checkpoint(tmp_path, name)
    harness = PagedHarness(path)
    shared = prompt(3 * BLOCK_SIZE, seed=6)
    first_tokens, second_tokens = shared + prompt(5, seed=7), shared + prompt(7, seed=8)
    first = harness.new_seq(first_tokens, "first")
    harness.step([(first, len(first_tokens))])
    # A prefix-cache hit: the second sequence starts on the first one's three full blocks.
    second = harness.new_seq(second_tokens, "second")
    second.block_table = list(first.block_table[:3])
    second.num_computed_tokens = len(shared)
    (rest,) = harness.step([(second, len(second_tokens) - len(shared))])
    torch.testing.assert_close(rest, hf_logits(hf, second_tokens)[len(shared) :], atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        (
            "tiny-llama",
            {
                "rope_theta": 500000.0,
                # A short original context puts real frequencies into every llama3 band.
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            },
        ),
        ("tiny-qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}}),
        ("tiny-llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    ],
    ids=["llama3", "yarn", "linear"],
)
def test_rope_scaling_matches_hf(tmp_path: Path, name: str, overrides: dict, hf_checkpoint) -> None:
    hf, path = hf_checkpoint(tmp_path, name, **overrides)
    harness = PagedHarness(path)
    # Long enough that low-frequency dims rotate noticeably, in chunks so decode rows are covered.
    tokens = prompt(48, seed=9)
    seq = harness.new_seq(tokens)
    ours = torch.cat([harness.step([(seq, n)])[0] for n in (40, 1, 1, 6)])
    torch.testing.assert_close(ours, hf_logits(hf, tokens), atol=ATOL, rtol=0)


def test_scaled_rope_differs_from_unscaled(tmp_path: Path, hf_checkpoint) -> None:
    """Guards the test above: the scaling must actually change the logits it compares."""
    scaled_hf, _ = hf_checkpoint(
        tmp_path,
        "tiny-llama",
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )
    plain_hf, _ = hf_checkpoint(tmp_path / "plain", "tiny-llama")
    tokens = prompt(48, seed=9)
    assert (hf_logits(scaled_hf, tokens) - hf_logits(plain_hf, tokens)).abs().max() > 1e-2


def naive_attention(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], q_lens: list[int], scale: float):
    """Explicit-loop causal GQA attention over each sequence's full K/V (no cache, no SDPA)."""
    out = torch.empty_like(q)
    row = 0
    for k, v, q_len in zip(ks, vs, q_lens):
        seq_len, num_kv_heads = k.shape[0], k.shape[1]
        group = q.shape[1] // num_kv_heads
        for j in range(q_len):
            pos = seq_len - q_len + j
            for h in range(q.shape[1]):
                kh, vh = k[: pos + 1, h // group], v[: pos + 1, h // group]
                w = torch.softmax((kh @ q[row + j, h]) * scale, dim=0)
                out[row + j, h] = w @ vh
        row += q_len
    return out


def test_paged_attention_reference_matches_naive() -> None:
    torch.manual_seed(0)
    heads, kv_heads, d, bs = 6, 2, 8, 4
    q_lens, seq_lens = [5, 1, 3], [5, 9, 14]  # a prefill, a decode, a chunk after a prefix
    cache = torch.zeros(2, 16, bs, kv_heads, d)
    perm = torch.randperm(16).tolist()
    tables = [[perm.pop() for _ in range(math.ceil(s / bs))] for s in seq_lens]
    ks = [torch.randn(s, kv_heads, d) for s in seq_lens]
    vs = [torch.randn(s, kv_heads, d) for s in seq_lens]
    # Earlier context already cached; this step's K/V are written by write_kv below.
    slots_new, k_new, v_new, positions = [], [], [], []
    for table, k, v, q_len, s in zip(tables, ks, vs, q_lens, seq_lens):
        for p in range(s):
            slot = table[p // bs] * bs + p % bs
            if p < s - q_len:
                cache[0].view(-1, kv_heads, d)[slot], cache[1].view(-1, kv_heads, d)[slot] = k[p], v[p]
            else:
                slots_new.append(slot), k_new.append(k[p]), v_new.append(v[p]), positions.append(p)
    max_blocks = max(len(t) for t in tables)
    md = AttentionMetadata(
        positions=torch.tensor(positions),
        slot_mapping=torch.tensor(slots_new),
        query_start_loc=torch.tensor([0, 5, 6, 9], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32),
        logits_indices=torch.tensor([4, 5, 8]),
        seq_lens_cpu=seq_lens,
        query_lens_cpu=q_lens,
    )
    write_kv(torch.stack(k_new), torch.stack(v_new), cache, md.slot_mapping)
    q = torch.randn(sum(q_lens), heads, d)
    out = paged_attention_reference(q, cache, md, scale=0.3)
    torch.testing.assert_close(out, naive_attention(q, ks, vs, q_lens, 0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("name", "no_window"), [
    ("tiny-mistral", {"sliding_window": None}),
    ("tiny-qwen3-sw", {"use_sliding_window": False}),
])
def test_window_changes_the_logits(tmp_path: Path, name: str, no_window: dict, hf_checkpoint) -> None:
    """Guards the parity tests of the windowed families: transformers applies the window to
    prompts this long, and our model declares it (a full-attention run would not match)."""
    windowed_hf, path = hf_checkpoint(tmp_path, name)
    plain_hf, _ = hf_checkpoint(tmp_path / "plain", name, **no_window)
    tokens = prompt(23, seed=1)
    assert (hf_logits(windowed_hf, tokens) - hf_logits(plain_hf, tokens)).abs().max() > 1e-2
    model = build_model(resolve_model(str(path)), "cpu", torch.float32)
    assert any(layer.self_attn.attn.sliding_window == 8 for layer in model.model.layers)
