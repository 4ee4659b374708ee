"""ModelRunner: loading through EngineConfig, attributes the engine relies on, and its forward
of hand-built batches (the `execute` fixture: batched prefill chunks and decodes, sampling rows
only) against Hugging Face logits."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers

from tandem.engine_service.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tandem.engine_service.dummy_configs import get_dummy_config
from tandem.engine_service.worker.model_runner import ModelRunner, resolve_device, resolve_dtype
from tandem.engine_service.sequence import SamplingParams, Sequence

BLOCK_SIZE = 4


@dataclass
class Scheduled:
    """Stand-in for the scheduler's ScheduledSeq (the runner duck-types it)."""

    seq: Sequence
    num_new_tokens: int
    sample: bool


def engine_config(model: str, num_blocks: int | None = 48, **model_kwargs) -> EngineConfig:
    return EngineConfig(
        ModelConfig(model=model, **model_kwargs),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks, cpu_kv_cache_bytes=1 << 22),
        SchedulerConfig(),
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    cfg = get_dummy_config("tiny-llama") | {"eos_token_id": [2, 5]}
    torch.manual_seed(3)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0.0, 1.0 if "embed" in name else 0.1)
    path = tmp_path_factory.mktemp("ckpt")
    hf.save_pretrained(path)
    return hf, path


def hf_last_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0, -1].float()


class Allocator:
    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks))[::-1]

    def cover(self, seq: Sequence, num_tokens: int) -> None:
        while len(seq.block_table) * BLOCK_SIZE < num_tokens:
            seq.block_table.append(self.free.pop())


def test_runner_attributes(checkpoint) -> None:
    _, path = checkpoint
    runner = ModelRunner(engine_config(str(path)))
    assert runner.device == torch.device("cpu") and runner.dtype == torch.float32
    assert runner.model_path == str(path.resolve())
    assert runner.vocab_size == 320
    assert runner.max_model_len == 512  # max_position_embeddings
    assert runner.eos_token_ids == (2, 5)  # from generation_config.json
    assert (runner.num_blocks, runner.block_size) == (48, BLOCK_SIZE)
    assert len(runner.kv_caches) == 2
    # One block past the pool: the scratch block padded CUDA-graph rows write into.
    assert runner.kv_caches[0].shape == (2, 48 + 1, BLOCK_SIZE, 2, 16)
    assert runner.scratch_block == 48
    assert runner.architecture == "LlamaForCausalLM"
    assert ModelRunner(engine_config(str(path), max_model_len=100)).max_model_len == 100
    with pytest.raises(ValueError, match="max_position_embeddings"):
        ModelRunner(engine_config(str(path), max_model_len=4096))


def test_runner_sizes_cache_from_cpu_budget() -> None:
    runner = ModelRunner(engine_config("dummy:tiny-qwen3", num_blocks=None))
    per_block = 2 * 2 * BLOCK_SIZE * 2 * 32 * 4  # layers x block x kv heads x head_dim x fp32
    assert runner.num_blocks == (1 << 22) // per_block
    assert runner.model_path is None and runner.eos_token_ids == (2,)


def test_execute_returns_sampling_rows_in_batch_order(checkpoint, execute) -> None:
    hf, path = checkpoint
    runner = ModelRunner(engine_config(str(path)))
    alloc = Allocator(runner.num_blocks)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 320, (n,), generator=gen).tolist() for n in (13, 7, 9)]
    seqs = [Sequence(f"s{i}", p, SamplingParams()) for i, p in enumerate(prompts)]

    # Step 1: s0 runs a first chunk (no sampling), s1 and s2 their whole prompts.
    work = [Scheduled(seqs[0], 6, False), Scheduled(seqs[1], 7, True), Scheduled(seqs[2], 9, True)]
    for w in work:
        alloc.cover(w.seq, w.seq.num_computed_tokens + w.num_new_tokens)
    logits = execute(runner, work)
    assert logits.dtype == torch.float32 and logits.shape == (2, 320)
    torch.testing.assert_close(logits[0], hf_last_logits(hf, prompts[1]), atol=1e-4, rtol=0)
    torch.testing.assert_close(logits[1], hf_last_logits(hf, prompts[2]), atol=1e-4, rtol=0)

    # The runner does not advance sequences; do what the scheduler and engine would.
    for w, token in zip(work, [None, *logits.argmax(-1).tolist()]):
        w.seq.num_computed_tokens += w.num_new_tokens
        if token is not None:
            w.seq.append_token(token)

    # Step 2: decodes of s2 and s1 (reordered) plus the rest of s0's prompt.
    work = [Scheduled(seqs[2], 1, True), Scheduled(seqs[0], 7, True), Scheduled(seqs[1], 1, True)]
    for w in work:
        alloc.cover(w.seq, w.seq.num_computed_tokens + w.num_new_tokens)
    logits = execute(runner, work)
    assert logits.shape == (3, 320)
    for row, w in zip(logits, work):
        torch.testing.assert_close(row, hf_last_logits(hf, w.seq.token_ids), atol=1e-4, rtol=0)


def test_execute_with_no_sampling_rows(checkpoint, execute) -> None:
    _, path = checkpoint
    runner = ModelRunner(engine_config(str(path)))
    seq = Sequence("a", list(range(10)), SamplingParams())
    Allocator(runner.num_blocks).cover(seq, 5)
    assert execute(runner, [Scheduled(seq, 5, False)]).shape == (0, 320)


def test_execute_rejects_uncovered_tokens(checkpoint, execute) -> None:
    _, path = checkpoint
    runner = ModelRunner(engine_config(str(path)))
    seq = Sequence("a", list(range(10)), SamplingParams())
    seq.block_table = [0]  # 4 slots for 10 tokens
    with pytest.raises(ValueError, match="blocks"):
        execute(runner, [Scheduled(seq, 10, True)])
    with pytest.raises(ValueError, match="cannot run"):
        execute(runner, [Scheduled(seq, 11, True)])


def test_bfloat16_runner_tracks_float32(checkpoint, execute) -> None:
    hf, path = checkpoint
    runner = ModelRunner(engine_config(str(path), dtype="bfloat16"))
    assert runner.kv_caches[0].dtype == torch.bfloat16
    tokens = torch.randint(0, 320, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    seq = Sequence("a", tokens, SamplingParams())
    Allocator(runner.num_blocks).cover(seq, len(tokens))
    logits = execute(runner, [Scheduled(seq, len(tokens), True)])[0]
    ref = hf_last_logits(hf, tokens)
    assert torch.isfinite(logits).all()
    # bf16 weights and activations: agreement to a few percent of the logit scale.
    assert (logits - ref).abs().max() < 0.05 * ref.abs().max()


def test_dummy_runner_is_seeded(execute) -> None:
    def last_logits(seed: int) -> torch.Tensor:
        runner = ModelRunner(engine_config("dummy:tiny-qwen2", seed=seed))
        seq = Sequence("a", [3, 1, 4, 1, 5, 9], SamplingParams())
        Allocator(runner.num_blocks).cover(seq, 6)
        return execute(runner, [Scheduled(seq, 6, True)])[0]

    a, b, c = last_logits(0), last_logits(0), last_logits(1)
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert not torch.equal(a, c)
    assert a.std() > 1e-3  # not degenerate


def test_device_and_dtype_resolution() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16
