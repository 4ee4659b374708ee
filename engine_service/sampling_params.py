"""Token-level sampling and stopping parameters: torch-free, so the step plan
(`step_plan.py`) can carry them across processes (msgspec encodes dataclasses).

`sequence.py` re-exports `SamplingParams`; the engine-core protocol may later own the class.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Token-level sampling and stopping parameters, already validated by the server layer.

    Conventions: temperature == 0 means greedy; top_k <= 0 means disabled; top_p == 1 and
    min_p == 0 mean disabled; penalties at their neutral values (1.0 / 0.0) mean disabled.
    `logprobs` is the number of top alternatives to return per generated token (None = no
    logprobs at all; 0 = only the sampled token's logprob).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop_token_sequences: list[list[int]] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_repetition_penalty(self) -> bool:
        return self.repetition_penalty != 1.0

    @property
    def uses_output_penalties(self) -> bool:
        """Presence or frequency penalty (OpenAI semantics, over output tokens)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def uses_penalties(self) -> bool:
        """Sampling counts every earlier token, so it needs them all on the host."""
        return self.uses_repetition_penalty or self.uses_output_penalties
