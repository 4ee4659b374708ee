"""Sliding-window models through the whole engine: greedy tokens identical to transformers.

Mistral (every layer windowed) and Qwen3 with per-layer `layer_types` (a full layer and two
windowed ones) on tiny random-weight checkpoints whose window (8) is shorter than every prompt;
64 greedy steps each, through the scheduler, block manager and runner on CPU: one sequence,
several at once, prefill in small chunks, and a pool so small that sequences are preempted and
recomputed. The windowed blocks are given back while the requests run.
"""

from __future__ import annotations

import os

# The Triton test below interprets the kernels on CPU; Triton reads this when first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tandem.engine_service.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from tandem.engine_service.worker.cuda_graphs import DecodeCudaGraphs  # noqa: E402
from tandem.engine_service.worker.piecewise_graphs import PiecewiseCudaGraphs  # noqa: E402
from tandem.engine_service.core.engine import LLMEngine  # noqa: E402
from tandem.engine_service.cache.block_manager import NULL_BLOCK  # noqa: E402
from tests.conftest import drive_greedy  # noqa: E402
from tests.hf_reference import hf_reference  # noqa: E402

STEPS = 64
BLOCK_SIZE = 4
WINDOW = 8
FAMILIES = ["tiny-mistral", "tiny-qwen3-sw"]
def prompt(n: int, seed: int, vocab: int = 320) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# Shared by the tests, so the (slow) transformers reference runs once per prompt and model.
PROMPTS = [prompt(n, seed=30 + i) for i, n in enumerate((21, 11, 30, 17, 26))]


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory, hf_checkpoint) -> tuple[str, torch.nn.Module, Path]:
    hf, path = hf_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, hf, path


def make_config(path: Path, num_blocks: int = 128, budget: int = 256, max_num_seqs: int = 8,
                overlap: str = "off", backend: str = "torch") -> EngineConfig:
    return EngineConfig(
        ModelConfig(model=str(path), attention_backend=backend, max_model_len=256),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks),
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, overlap_scheduling=overlap),
    )


def make_engine(path: Path, **kwargs) -> LLMEngine:
    return LLMEngine(make_config(path, **kwargs))


def run(engine: LLMEngine, prompts: list[list[int]], on_step=None, steps: int = STEPS) -> list[list[int]]:
    out = drive_greedy(engine, prompts, steps, on_step)
    assert engine.block_manager.num_used_blocks == 0 and all(
        p.num_free == p.num_blocks for p in engine.block_manager.pools
    ), "blocks leaked"
    return out


def windowed_groups(engine: LLMEngine) -> list[int]:
    return [g for g, p in enumerate(engine.block_manager.pools) if p.window is not None]


def test_single_sequence_matches_transformers(checkpoint) -> None:
    _, hf, path = checkpoint
    tokens = PROMPTS[0]
    assert min(map(len, PROMPTS)) > WINDOW
    (ours,) = run(make_engine(path), [tokens])
    assert ours == hf_reference(hf, tokens, STEPS).continuation


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_batched_chunked_prefill_matches_transformers(checkpoint, overlap: str) -> None:
    _, hf, path = checkpoint
    prompts = PROMPTS[:3]
    # A 5-token budget: every prompt is prefilled in chunks, decodes share steps with prefills.
    ours = run(make_engine(path, budget=5, overlap=overlap), prompts)
    assert ours == [hf_reference(hf, p, STEPS).continuation for p in prompts]


def test_preempted_sequences_match_transformers(checkpoint) -> None:
    name, hf, path = checkpoint
    prompts = PROMPTS[:4]
    # Mistral holds about window/block_size + 1 blocks per request, so 8 blocks cannot keep four
    # running; the Qwen3 model's full layer needs every block, so it needs a larger pool.
    engine = make_engine(path, num_blocks=8 if name == "tiny-mistral" else 30, budget=8)
    ours = run(engine, prompts)
    assert engine.scheduler.num_preemptions > 0
    assert ours == [hf_reference(hf, p, STEPS).continuation for p in prompts]


def test_windowed_blocks_are_freed_while_requests_run(checkpoint) -> None:
    name, hf, path = checkpoint
    engine = make_engine(path, budget=8)
    windowed = windowed_groups(engine)
    assert windowed, "the model declares a sliding-window cache group"
    live: list[dict[int, int]] = []
    widths: list[int] = []

    def record(e: LLMEngine) -> None:
        for seq in e.scheduler.running:
            if seq.num_computed_tokens >= 26:  # well past the window
                live.append({g: sum(b != NULL_BLOCK for b in seq.block_tables[g]) for g in range(len(seq.block_tables))})
                widths.append(len(seq.block_tables[0]))

    prompts = [PROMPTS[2], PROMPTS[4]]
    ours = run(engine, prompts, on_step=record)
    assert ours == [hf_reference(hf, p, STEPS).continuation for p in prompts]
    assert live and max(widths) >= (26 + STEPS - 1) // BLOCK_SIZE
    window_blocks = -(-(WINDOW - 1) // BLOCK_SIZE) + 2  # the window, the block it starts in, the next one
    for g in windowed:
        assert max(snapshot[g] for snapshot in live) <= window_blocks
    full = [g for g in range(len(live[0])) if g not in windowed]
    if full:  # the Qwen3 model's full layer keeps every block
        assert max(snapshot[full[0]] for snapshot in live) == max(widths)
    if name == "tiny-mistral":
        assert full == []


def test_prefix_hits_on_freed_window_blocks_stay_correct(checkpoint) -> None:
    """A second request sharing a long prefix with a finished one: its hit may start past blocks
    the first request gave back mid-run (Mistral needs only the window before the hit), and its
    tokens still match transformers."""
    _, hf, path = checkpoint
    engine = make_engine(path, budget=8)
    shared = PROMPTS[2]
    (first,) = run(engine, [shared])
    hits_before = engine.block_manager.prefix_hits
    second_prompt = shared + first[:10] + prompt(3, seed=81)
    (second,) = run(engine, [second_prompt])
    assert engine.block_manager.prefix_hits - hits_before >= 32
    assert first == hf_reference(hf, shared, STEPS).continuation
    assert second == hf_reference(hf, second_prompt, STEPS).continuation


def test_triton_kernels_and_graph_buffers_match_transformers(checkpoint) -> None:
    """The Triton backend (kernels interpreted on CPU) with the window as a kernel argument,
    decode through the CUDA-graph runner's fixed, padded buffers and prefill chunks through the
    piecewise runner's (both run eagerly here; one block table and slot mapping per paged group):
    the same greedy tokens as transformers."""
    name, hf, path = checkpoint
    steps = 12  # the interpreter is slow; the prompts are still twice the window
    prompts = [PROMPTS[3], PROMPTS[1]]
    config = make_config(path, budget=8, backend="triton")
    engine = LLMEngine(config)
    assert engine.runner.attention_backend == "triton"
    graph_calls = []
    runner = engine.runner
    groups = runner.memory_plan.paged_groups
    assert len(groups) == (1 if name == "tiny-mistral" else 2)
    graphs = DecodeCudaGraphs(
        runner.model, runner.kv_caches, sizes=[1, 2, 4], block_size=BLOCK_SIZE,
        max_blocks_per_seq=runner.max_model_len // BLOCK_SIZE, scratch_block=runner.scratch_block,
        num_kv_heads=2, device=torch.device("cpu"), capture_graphs=False,
        sliding_window=WINDOW if name == "tiny-mistral" else None,
        extra_scratch_blocks=[g.num_blocks for g in groups[1:]],
    )
    graphs.capture()
    runner.cuda_graphs = graphs
    original = graphs.run
    graphs.run = lambda host, *a: graph_calls.append(host.num_seqs) or original(host, *a)
    pieces = PiecewiseCudaGraphs(
        runner.model, runner.layer_caches, max_tokens=8, block_size=BLOCK_SIZE,
        max_blocks_per_seq=runner.max_model_len // BLOCK_SIZE, scratch_block=runner.scratch_block,
        device=torch.device("cpu"), capture_graphs=False, extra_scratch_blocks=[g.num_blocks for g in groups[1:]],
        whole_batches=(1,),  # one-sequence steps replay whole graphs, two-sequence ones the pieces
    )
    pieces.capture()
    runner.piecewise_graphs = pieces
    piece_calls = []
    original_pieces = pieces.run
    pieces.run = lambda host, *a: piece_calls.append(host.num_seqs) or original_pieces(host, *a)
    ours = run(engine, prompts, steps=steps)
    assert ours == [hf_reference(hf, p, STEPS).continuation[:steps] for p in prompts]
    assert graph_calls, "decode steps went through the graph buffers"
    assert len(piece_calls) >= 4, "prefill chunks went through the piecewise buffers"
    assert pieces._whole, "one-sequence buckets were prepared"
