"""Per-request state inside the engine: token ids, sampling parameters, KV blocks, progress.

The engine never sees text. A `Sequence` is one engine request (one choice of a client request:
the frontend fans n>1 out into n sequences that share a prompt and so share prefix-cache blocks).
"""

from __future__ import annotations

import enum
import time

import torch

from tandem.core_protocol import FinishReason, KVTransferParams, SamplingParams, StopReason
from tandem.engine_service.grammar.matcher import GrammarMatcher
from tandem.engine_service.pending import PendingTokens, seeded_generator

__all__ = ["FinishReason", "SamplingParams", "Sequence", "SequenceStatus"]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    LOADING_KV = "loading_kv"  # holds its blocks, waits for a remote KV load (never scheduled meanwhile)
    COMPILING = "compiling"  # waits for its structured-output grammar (holds nothing meanwhile)
    RUNNING = "running"
    FINISHED = "finished"


class Sequence(PendingTokens):
    """One engine request: its tokens, its progress through the KV cache and its ending."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        arrival_time: float | None = None,
        kv_transfer_params: KVTransferParams | None = None,
        deadline: float | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("a sequence needs at least one prompt token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.status = SequenceStatus.WAITING
        # Tokens whose K/V are written (or being written by a launched step) in this sequence's
        # blocks; prefix-cache hits count.
        self.num_computed_tokens = 0
        # Tokens sampled on the device but not yet read back (`PendingTokens`): they count in
        # `num_tokens` but are not in `output_token_ids`.
        self.num_pending_tokens = 0
        self.pending_row = -1
        # Prompt tokens served from the prefix cache at the first admission (reported in usage).
        self.num_cached_prompt_tokens: int | None = None
        # One block table per paged cache group (the block manager adds the others on admission);
        # `block_table` is the primary group's. A sliding-window group's entries before the window
        # are `NULL_BLOCK` once freed.
        self.block_tables: list[list[int]] = [[]]
        # Hashes of this sequence's full blocks, in order (filled by the block manager; the same
        # for every group, as all groups share the block size).
        self.block_hashes: list[int] = []
        # The request's slot in the state groups' pools (recurrent/convolution state), held from
        # admission to finish, abort, error or preemption; None without state groups.
        self.state_slot: int | None = None
        self.num_preemptions = 0
        self.finish_reason: FinishReason | None = None
        # What ended it: a stop token, a stop token sequence, or the scheduler (typed).
        self.stop_reason: StopReason | None = None
        # Disaggregated prefill/decode (kv_connector): the request's transfer parameters (a
        # producer replaces them with the decode leg's at finish), whether its remote KV load is
        # done (a consumer then treats it like any request: a preemption recomputes locally), and
        # the lease a producer keeps its blocks under.
        self.kv_transfer_params = kv_transfer_params
        self.remote_kv_done = False
        self.kv_lease_id: str | None = None
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        # time.monotonic() past which the scheduler ends it with DEADLINE_EXCEEDED (None: never).
        self.deadline = deadline
        self.generator: torch.Generator | None = seeded_generator(params)
        # Structured output: the matcher of `params.structured_output`, set once it compiled
        # (the engine advances it with each read-back token; None when unconstrained).
        self.grammar: GrammarMatcher | None = None

    # -- cache views -------------------------------------------------------------------------
    @property
    def block_table(self) -> list[int]:
        """The primary paged cache group's block table (`block_tables[0]`)."""
        return self.block_tables[0]

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.block_tables[0] = table

    # -- token views -------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt, output and pending tokens: the length the model's next step extends."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_known_tokens(self) -> int:
        """Prompt and output tokens whose ids the host has (`num_tokens` less pending ones)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        """Output tokens sampled so far, read back or not."""
        return len(self.output_token_ids) + self.num_pending_tokens

    @property
    def token_ids(self) -> list[int]:
        """The known token ids (pending ones excluded)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def reached_length_limit(self, max_model_len: int) -> bool:
        """Whether the tokens sampled so far (pending included) already end it by length."""
        return self.num_generated_tokens >= self.params.max_tokens or self.num_tokens >= max_model_len

    def _append_confirmed(self, token_id: int) -> None:
        self.append_token(token_id)

    def append_token(self, token_id: int) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.output_token_ids.append(token_id)

    def finish(self, reason: FinishReason, stop_reason: StopReason | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return (
            f"Sequence({self.request_id}, status={self.status.value}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )
