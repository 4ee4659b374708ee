"""Worker side of the step plan: one persistent row per request, updated only from plans.

A `RequestRow` holds what the worker needs to build a request's model inputs and sampling
parameters: its token ids (prompt and the output tokens this worker sampled and read back), its
sampling parameters and random generator, its block ids per cache group and its progress.
`WorkerRows.apply(plan)` updates the rows and returns the step's batch; `host_inputs(batch)`
builds the step's host arrays from the rows alone — the scheduler's objects are never read.

Pending tokens (overlapped scheduling): a token sampled on the device and not yet read back is
counted in `num_pending_tokens`; its input slot is filled on the device from `pending_row` of the
previous step's sampled-token tensor (`input_batch.ship_step_arrays`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tandem.core_protocol import SamplingParams
from tandem.engine_service.worker.input_batch import PENDING_PLACEHOLDER, HostInputs, assemble_host_inputs
from tandem.engine_service.cache.block_manager import NULL_BLOCK
from tandem.engine_service.pending import PendingTokens, seeded_generator
from tandem.engine_service.step_plan import NewRequest, StepPlan


@dataclass(eq=False)
class RequestRow(PendingTokens):
    """One request as the worker holds it (what the sampler and the input builder read).

    Invariants: `token_ids` = prompt + read-back output tokens; `num_tokens` (those plus the
    pending ones) >= `num_computed_tokens`; `block_ids[g]` is the table of cache group g (empty
    while preempted); `generator` (seeded requests only) lives as long as the row, across
    preemptions, so a seeded request draws the same stream as without them.
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    block_ids: list[list[int]]
    num_computed_tokens: int = 0
    state_slot: int | None = None
    num_pending_tokens: int = 0
    pending_row: int = -1
    generator: torch.Generator | None = field(default=None, repr=False)
    # The last prompt position whose prompt logprob a launched step computes (prompt_logprobs.py):
    # a prompt recomputed after a preemption reports none twice.
    prompt_logprobs_done: int = 0

    @classmethod
    def from_plan(cls, req: NewRequest) -> RequestRow:
        return cls(
            request_id=req.request_id,
            token_ids=list(req.token_ids),
            num_prompt_tokens=req.num_prompt_tokens,
            params=req.sampling_params,
            eos_token_ids=tuple(req.eos_token_ids),
            block_ids=[list(g) for g in req.block_ids],
            num_computed_tokens=req.num_computed_tokens,
            state_slot=req.state_slot,
            generator=seeded_generator(req.sampling_params),
        )

    # What the sampler reads (the same names as the scheduler's Sequence).
    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens + self.num_pending_tokens

    @property
    def num_known_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending_tokens

    def _append_confirmed(self, token_id: int) -> None:
        self.token_ids.append(token_id)


@dataclass
class StepBatch:
    """One step's batch, in plan order: entry i runs `num_scheduled_tokens[i]` tokens of
    `rows[i]` from its computed count and samples when `sample[i]` (columns, like the plan)."""

    rows: list[RequestRow] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    sample: list[bool] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def sampling_rows(self) -> list[RequestRow]:
        """The rows that sample, in sampled-token order."""
        return [row for row, s in zip(self.rows, self.sample) if s]

    @property
    def request_ids(self) -> list[str]:
        return [row.request_id for row in self.rows]

    def block_tables(self, group: int) -> list[list[int]]:
        """Every entry's block table in cache group `group` (what per-group metadata is built from)."""
        return [row.block_ids[group] for row in self.rows]


class WorkerRows:
    """The worker's persistent rows, keyed by request id; changed only by `apply` and by the
    worker's own sampled tokens (`RequestRow.mark_pending` / `confirm_token`).

    `apply` drops finished rows first, then drops the blocks of preempted ones, then updates
    cached rows (appended block ids, then entries a sliding window gave back set to `NULL_BLOCK`,
    so a row never keeps the id of a block the scheduler may already have handed to another
    request) and adds new ones; it rejects a plan that names a row it does not hold (or adds
    one it already holds), so a scheduler/worker mismatch fails loudly instead of running with
    stale inputs.
    """

    def __init__(self, num_cache_groups: int = 1) -> None:
        self.num_cache_groups = num_cache_groups
        self._rows: dict[str, RequestRow] = {}
        # How many held rows ask for prompt logprobs (0: a step skips looking for their spans).
        self.num_prompt_logprob_rows = 0

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._rows

    def get(self, request_id: str) -> RequestRow | None:
        return self._rows.get(request_id)

    def holds(self, row: RequestRow) -> bool:
        """Whether `row` is still the live row of its request (not dropped, id not reused)."""
        return self._rows.get(row.request_id) is row

    def apply(self, plan: StepPlan) -> StepBatch:
        """Update the rows from `plan`; the step's batch in plan order (cached, then new)."""
        if plan.num_cache_groups != self.num_cache_groups:
            raise ValueError(f"plan has {plan.num_cache_groups} cache groups, the worker {self.num_cache_groups}")
        rows = self._rows
        for rid in plan.finished_req_ids:
            row = rows.pop(rid, None)
            if row is not None and row.params.prompt_logprobs is not None:
                self.num_prompt_logprob_rows -= 1
        for rid in plan.preempted_req_ids:
            row = self._require(rid)
            row.block_ids = [[] for _ in range(self.num_cache_groups)]
            row.num_computed_tokens = 0
            row.state_slot = None
        cached = plan.cached_requests
        columns = (cached.new_block_ids, cached.num_computed_tokens, cached.num_scheduled_tokens, cached.sample,
                   cached.resumed, cached.state_slots, cached.num_null_blocks)
        if any(len(column) != len(cached.request_ids) for column in columns):
            raise ValueError("the plan's cached-request columns differ in length")
        batch_rows: list[RequestRow] = []
        groups = self.num_cache_groups
        for rid, added, computed, resumed, slot, nulls in zip(
            cached.request_ids, cached.new_block_ids, cached.num_computed_tokens, cached.resumed, cached.state_slots,
            cached.num_null_blocks,
        ):
            row = rows.get(rid)
            if row is None:
                raise ValueError(f"{rid}: the plan names a request the worker does not hold")
            if added is not None:
                if len(added) != groups:
                    raise ValueError(f"{rid}: block ids for {len(added)} cache groups")
                if resumed:
                    row.block_ids = [list(g) for g in added]
                else:
                    for table, more in zip(row.block_ids, added):
                        table.extend(more)
            elif resumed:
                row.block_ids = [[] for _ in range(groups)]
            if resumed:
                row.state_slot = slot
            if nulls is not None:
                _mark_given_back(row, nulls)
            row.num_computed_tokens = computed
            batch_rows.append(row)
        num_scheduled = list(cached.num_scheduled_tokens)
        sample = list(cached.sample)
        for req in plan.new_requests:
            if req.request_id in rows:
                raise ValueError(f"{req.request_id}: new in the plan but the worker already holds it")
            if len(req.block_ids) != groups:
                raise ValueError(f"{req.request_id}: block ids for {len(req.block_ids)} cache groups")
            row = rows[req.request_id] = RequestRow.from_plan(req)
            if row.params.prompt_logprobs is not None:
                self.num_prompt_logprob_rows += 1
            batch_rows.append(row)
            num_scheduled.append(req.num_scheduled_tokens)
            sample.append(req.sample)
        return StepBatch(batch_rows, num_scheduled, sample)

    def _require(self, request_id: str) -> RequestRow:
        row = self._rows.get(request_id)
        if row is None:
            raise ValueError(f"{request_id}: the plan names a request the worker does not hold")
        return row


def _mark_given_back(row: RequestRow, nulls: list[int]) -> None:
    """Set the first `nulls[g]` entries of the row's table in group g to `NULL_BLOCK` (walking
    back from the end of that prefix to the entries already marked)."""
    if len(nulls) != len(row.block_ids):
        raise ValueError(f"{row.request_id}: given-back counts for {len(nulls)} cache groups")
    for table, n in zip(row.block_ids, nulls):
        if n > len(table):
            raise ValueError(f"{row.request_id}: {n} given-back entries in a table of {len(table)}")
        for i in range(n - 1, -1, -1):
            if table[i] == NULL_BLOCK:
                break
            table[i] = NULL_BLOCK


def host_inputs_from_rows(batch: StepBatch, block_size: int) -> HostInputs:
    """The step's host arrays from the rows: for each entry the tokens
    `[num_computed, num_computed + num_scheduled)` of its row, its block table in every cache
    group (each must cover them; tables and slot mappings via `assemble_host_inputs`, the same
    code the Sequence-shaped path uses), its state slot (models with state groups; the entry
    continues the slot's state unless it starts at position 0) and, for a pending last token,
    its source row. Only a row's last scheduled token may be pending."""
    if not batch.rows:
        raise ValueError("empty batch")
    token_chunks: list[list[int]] = []
    seq_lens: list[int] = []
    pending_dst: list[int] = []
    pending_src: list[int] = []
    num_tokens = 0
    for row, n in zip(batch.rows, batch.num_scheduled_tokens):
        tokens = row.token_ids
        known = len(tokens)
        start = row.num_computed_tokens
        end = start + n
        if n < 1 or end > known + row.num_pending_tokens:
            raise ValueError(f"{row.request_id}: cannot run {n} new tokens from {start} (row has {row.num_tokens})")
        for table in row.block_ids:  # every group's table has the same length
            if len(table) * block_size < end:
                raise ValueError(
                    f"{row.request_id}: {len(table)} blocks cannot hold {end} tokens (block size {block_size})"
                )
        if end > known:
            if end - known > 1 or row.num_pending_tokens != 1:
                raise ValueError(f"{row.request_id}: only the last new token may be pending")
            pending_dst.append(num_tokens + n - 1)
            pending_src.append(row.pending_row)
            token_chunks.append(tokens[start:known] + [PENDING_PLACEHOLDER])
        else:
            token_chunks.append(tokens[start:end])
        seq_lens.append(end)
        num_tokens += n
    group_tables = [batch.block_tables(g) for g in range(len(batch.rows[0].block_ids))]
    return assemble_host_inputs(token_chunks, batch.num_scheduled_tokens, seq_lens, group_tables, batch.sample,
                                block_size, np.asarray(pending_dst, dtype=np.int64),
                                np.asarray(pending_src, dtype=np.int64), [row.state_slot for row in batch.rows])
