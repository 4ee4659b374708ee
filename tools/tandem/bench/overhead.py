"""`tandem bench overhead`: host (CPU) time of one engine step with N running sequences.

A step's host work is scheduling, building the step plan, applying it to the worker's rows and
building the step's inputs from them, reading the sampled tokens back, stop checks and the
scheduler's bookkeeping. To see that work alone, the engine runs with `HostOnlyRunner`, which
takes the real host inputs (built by the worker from its rows) and returns ready logits instead
of running a model; the sampler runs
greedy over a small stand-in vocabulary so its (device-side on a GPU) arithmetic stays out of
the figure. The anchor is a GPU step time measured elsewhere (passed with `--gpu-step-ms`, e.g.
the roofline's decode step at the same batch): overhead below it can hide behind the GPU.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from tandem.engine_service.config import EngineConfig
from tandem.engine_service.core.engine import LLMEngine
from tandem.engine_service.worker.input_batch import HostInputs
from tandem.engine_service.sequence import SamplingParams

STAND_IN_VOCAB = 1024


class HostOnlyRunner:
    """A model runner without a model: takes the real host inputs, returns precomputed logits."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, vocab_size: int = STAND_IN_VOCAB):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids: tuple[int, ...] = ()
        self.model_path = None
        self.device = torch.device("cpu")
        g = torch.Generator().manual_seed(0)
        self._logits = torch.randn(4096, vocab_size, generator=g)

    def forward(self, host: HostInputs, previous_tokens: torch.Tensor | None = None) -> torch.Tensor:
        return self._logits[: len(host.logits_indices)]


def measure_step_overhead(config: EngineConfig, num_seqs: int, context: int, steps: int,
                          block_size: int = 16) -> dict[str, Any]:
    """Median and p90 host milliseconds per decode step with `num_seqs` running sequences of
    `context` tokens (the prefill steps that fill the batch are not counted)."""
    blocks_per_seq = (context + steps + block_size) // block_size + 1
    runner = HostOnlyRunner(num_blocks=num_seqs * blocks_per_seq + 8, block_size=block_size,
                            max_model_len=context + steps + 8)
    config.scheduler.max_num_seqs = max(config.scheduler.max_num_seqs, num_seqs)
    config.scheduler.max_num_batched_tokens = max(config.scheduler.max_num_batched_tokens, num_seqs * context)
    config.cache.enable_prefix_caching = True
    engine = LLMEngine(config, runner=runner)
    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    for i in range(num_seqs):
        # Distinct prompts: no prefix sharing, every sequence owns its blocks.
        prompt = [(i * 7919 + j) % STAND_IN_VOCAB for j in range(context - 1)]
        engine.add_request(f"overhead-{i}", prompt, params)
    while engine.scheduler.num_waiting:  # admit and prefill everyone first
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t0) * 1000.0)
    running = engine.scheduler.num_running
    times.sort()
    return {
        "num_seqs": num_seqs,
        "context": context,
        "steps_timed": len(times),
        "running_during_timing": running,
        "host_ms_median": statistics.median(times),
        "host_ms_p90": times[int(0.9 * (len(times) - 1))],
        "host_ms_min": times[0],
        "stand_in_vocab": STAND_IN_VOCAB,
    }


def run_overhead(record: Any, config: EngineConfig, batches: list[int], context: int, steps: int,
                 gpu_step_ms: float | None) -> None:
    points = []
    for n in batches:
        with record.stage(f"overhead_{n}"):
            point = measure_step_overhead(config, n, context, steps, config.cache.block_size)
            if gpu_step_ms:
                point["gpu_step_ms_anchor"] = gpu_step_ms
                point["host_over_gpu"] = point["host_ms_median"] / gpu_step_ms
            points.append(point)
    record.results["points"] = points
    record.results["what"] = ("host time of LLMEngine.step() with a model-free runner: scheduling, step plan, "
                              "worker rows and host input preparation, greedy readback over a stand-in vocabulary, stop checks, bookkeeping")


def short_table(results: dict[str, Any]) -> list[str]:
    lines = [" seqs  context  host ms p50  host ms p90  vs GPU step"]
    for p in results.get("points", []):
        ratio = f"{p['host_over_gpu']:.2f}x" if "host_over_gpu" in p else "-"
        lines.append(f"{p['num_seqs']:5d}  {p['context']:7d}  {p['host_ms_median']:11.2f}  {p['host_ms_p90']:11.2f}"
                     f"  {ratio:>11}")
    return lines
