"""The named benchmark workloads, as deterministic lists of (prompt token ids, output length).

Fixed names keep numbers comparable across runs and commits (see docs/benchmarks.md):

- `nanovllm`: 256 sequences, input and output lengths uniform in [100, 1024], seed 0.
- `random-1k` (alias `sharegpt-like-random`): 1000 sequences of 1024 input / 1024 output tokens.

Token ids are uniform in the model's vocabulary and generation ignores EOS, so every request
produces exactly its output length. A smaller run keeps the same distribution: `num_prompts`
takes a prefix of the same random stream (the first N requests of the full workload, or more
requests drawn from the same distribution when N exceeds the standard count), and `scale`
multiplies every length (at least 1 token).
"""

from __future__ import annotations

from collections.abc import Sequence

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class WorkloadSpec:
    """How a named workload is drawn: request count, inclusive length ranges and the seed."""

    num_prompts: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    seed: int = 0


WORKLOADS: dict[str, WorkloadSpec] = {
    "nanovllm": WorkloadSpec(num_prompts=256, input_len=(100, 1024), output_len=(100, 1024), seed=0),
    "random-1k": WorkloadSpec(num_prompts=1000, input_len=(1024, 1024), output_len=(1024, 1024), seed=0),
}
ALIASES = {"sharegpt-like-random": "random-1k"}


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload: its prompt and how many tokens it must generate."""

    prompt_token_ids: list[int]
    output_len: int


@dataclass
class Workload:
    """A materialised workload plus the parameters that produced it (for the JSON record)."""

    name: str
    requests: list[BenchRequest]
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def num_input_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    def head(self, n: int) -> Workload:
        """The first `n` requests, as their own workload (used for peer subsets)."""
        n = max(0, min(n, len(self.requests)))
        return Workload(self.name, self.requests[:n], {**self.params, "num_prompts": n})

    def describe(self) -> dict[str, Any]:
        """The workload as recorded in a result: parameters and totals, not the token ids."""
        inputs = [len(r.prompt_token_ids) for r in self.requests]
        outputs = [r.output_len for r in self.requests]
        return {
            "name": self.name,
            **self.params,
            "num_requests": len(self.requests),
            "input_tokens": sum(inputs),
            "output_tokens": sum(outputs),
            "input_len_min_max": [min(inputs, default=0), max(inputs, default=0)],
            "output_len_min_max": [min(outputs, default=0), max(outputs, default=0)],
        }


def workload_names() -> list[str]:
    return sorted(WORKLOADS) + sorted(ALIASES)


def get_spec(name: str) -> tuple[str, WorkloadSpec]:
    """The canonical name and spec; raises `KeyError` naming the known workloads."""
    canonical = ALIASES.get(name, name)
    try:
        return canonical, WORKLOADS[canonical]
    except KeyError:
        raise KeyError(f"unknown workload {name!r}; known: {', '.join(workload_names())}") from None


def _scaled(lengths: np.ndarray, scale: float) -> np.ndarray:
    if scale == 1.0:
        return lengths
    return np.maximum(1, np.rint(lengths * scale)).astype(np.int64)


def make_workload(
    name: str,
    vocab_size: int,
    num_prompts: int | None = None,
    scale: float = 1.0,
    max_model_len: int | None = None,
    seed: int | None = None,
) -> Workload:
    """Draw the named workload for a model with `vocab_size` tokens.

    Lengths are drawn for all requests first and tokens after, each request from its own
    child stream, so request i is the same whatever `num_prompts` is. With `max_model_len`,
    a request whose prompt + output would not fit has its output (then its prompt) shortened,
    and the count of clipped requests is recorded.
    """
    canonical, spec = get_spec(name)
    if vocab_size < 1:
        raise ValueError("vocab_size must be >= 1")
    if scale <= 0:
        raise ValueError("scale must be > 0")
    n = spec.num_prompts if num_prompts is None else int(num_prompts)
    if n < 1:
        raise ValueError("num_prompts must be >= 1")
    seed = spec.seed if seed is None else seed
    in_seq, out_seq, token_seq = np.random.SeedSequence(seed).spawn(3)

    def lengths(seq: np.random.SeedSequence, bounds: tuple[int, int]) -> np.ndarray:
        # Drawn in blocks of the standard size so that request i never depends on n.
        rng = np.random.default_rng(seq)
        blocks = -(-n // spec.num_prompts)
        return np.concatenate(
            [rng.integers(bounds[0], bounds[1], size=spec.num_prompts, endpoint=True) for _ in range(blocks)]
        )[:n]

    in_lens, out_lens = lengths(in_seq, spec.input_len), lengths(out_seq, spec.output_len)
    in_lens, out_lens = _scaled(in_lens, scale), _scaled(out_lens, scale)

    clipped = 0
    children = token_seq.spawn(n)
    requests: list[BenchRequest] = []
    for i in range(n):
        p, o = int(in_lens[i]), int(out_lens[i])
        if max_model_len is not None and p + o > max_model_len:
            clipped += 1
            o = max(1, min(o, max_model_len - p))
            p = max(1, min(p, max_model_len - o))
        tokens = np.random.default_rng(children[i]).integers(0, vocab_size, size=p)
        requests.append(BenchRequest(prompt_token_ids=tokens.tolist(), output_len=o))
    params: dict[str, Any] = {
        "seed": seed,
        "num_prompts": n,
        "standard_num_prompts": spec.num_prompts,
        "input_len_range": list(spec.input_len),
        "output_len_range": list(spec.output_len),
        "scale": scale,
        "vocab_size": vocab_size,
        "ignore_eos": True,
        "standard": n == spec.num_prompts and scale == 1.0 and clipped == 0,
    }
    if clipped:
        params["clipped_to_max_model_len"] = {"max_model_len": max_model_len, "requests": clipped}
    return Workload(canonical, requests, params)


def warmup_requests(vocab_size: int, count: int, prompt_len: int | Sequence[int] = 32,
                    output_len: int = 8, seed: int = 0) -> list[BenchRequest]:
    """Short requests from their own seed, so they share no prefix with any workload request
    (a shared prefix would turn the measured run's prefill into prefix-cache hits). With several
    `prompt_len`s the requests cycle through them, so the prefill shapes a workload will meet are
    compiled before anything is timed. Different `seed`s give different prompts (a second warm-up
    pass with the same prompts would hit the prefix cache and compile nothing)."""
    rng = np.random.default_rng(np.random.SeedSequence([0xBE, 0x7C, 0x4, seed]))
    lens = [prompt_len] if isinstance(prompt_len, int) else list(prompt_len)
    return [BenchRequest(rng.integers(0, vocab_size, size=lens[i % len(lens)]).tolist(), output_len)
            for i in range(count)]


def warmup_filling_steps(vocab_size: int, prompt_lens: Sequence[int], count: int, step_tokens: int,
                         output_len: int = 8, seed: int = 0, max_requests: int = 256) -> list[BenchRequest]:
    """`warmup_requests` cycling through `prompt_lens`, at least `count` of them and enough that
    their prompts fill two steps of `step_tokens` (the engine's `max_num_batched_tokens`): all
    submitted at once they give the step shapes a timed run of many requests starts with (full
    prefill steps of many requests, then prefill mixed with decodes, then decodes), so the
    kernel variants of those shapes compile here. At most `max_requests` (short prompts would
    otherwise take thousands to fill two steps), unless `count` asks for more."""
    from tandem.engine_service.core.warmup import lengths_filling_steps

    lens = list(prompt_lens)
    least = max(count, len(lens))
    chosen = lengths_filling_steps(lens, step_tokens, min_count=least, max_count=max(max_requests, least))
    return warmup_requests(vocab_size, len(chosen), lens, output_len=output_len, seed=seed)


def warmup_prompt_lens(requests: Sequence[BenchRequest], cap: int | None = None) -> list[int]:
    """Prompt lengths that span a workload: powers of two from 32 up to its longest prompt, each
    also a few tokens longer (off Triton's divisible-by-16 grid), none above `cap` (default: the
    longest prompt); `warmup.spanning_lengths`, longest first."""
    from tandem.engine_service.core.warmup import spanning_lengths

    longest = max((len(r.prompt_token_ids) for r in requests), default=32)
    return spanning_lengths(longest, cap=longest if cap is None else cap, shortest=32)
