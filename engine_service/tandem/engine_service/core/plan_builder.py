"""Scheduler side of the step plan: turns each `SchedulerOutput` into a `StepPlan`.

`StepPlanBuilder` remembers what the workers already know of every request (that they hold a
row, how many of its block ids they were sent, and how many leading entries per cache group they
know as given back), so a plan carries a request whole only once (`NewRequest`) and afterwards
only its changes (`CachedRequests`). The engine tells it about endings (`drop`); preemptions it
reads from the scheduler's output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.engine_service.cache.block_manager import NULL_BLOCK
from tandem.engine_service.core.scheduler import ScheduledSeq, SchedulerOutput
from tandem.engine_service.sequence import Sequence, SequenceStatus
from tandem.engine_service.step_plan import CachedRequests, NewRequest, StepPlan


@dataclass
class _Known:
    """What the workers hold of one request."""

    seq: Sequence
    num_blocks_sent: int  # table length the workers hold (every group's table has this length)
    num_null_sent: list[int]  # per cache group: leading NULL_BLOCK entries the workers know of
    preempted: bool = False  # its blocks were dropped; the next delta resumes it


@dataclass
class PlannedStep:
    """A plan and the scheduled entries in the plan's batch order (cached, then new)."""

    plan: StepPlan
    scheduled: list[ScheduledSeq] = field(default_factory=list)

    @property
    def sampling(self) -> list[Sequence]:
        """The sequences whose tokens the step samples, in sampled-row order."""
        return [item.seq for item in self.scheduled if item.sample]


class StepPlanBuilder:
    """Builds each step's plan from the scheduler's output, sending each request whole once.

    Invariants: a request is in `_known` exactly while the workers hold its row; an id dropped
    here is listed in the next plan's `finished_req_ids` (only if the workers knew it); the block
    ids sent for a request per cache group, concatenated over plans since its last (re)start, with
    the first `num_null_blocks` entries overwritten by `NULL_BLOCK`, equal its table
    `seq.block_tables[g]` in that group (sliding-window groups give entries back from the front).
    """

    def __init__(self, num_cache_groups: int = 1) -> None:
        if num_cache_groups < 1:
            raise ValueError("num_cache_groups must be >= 1")
        self.num_cache_groups = num_cache_groups
        self._known: dict[str, _Known] = {}
        self._finished: list[str] = []
        self._next_step_id = 0

    @property
    def num_known(self) -> int:
        return len(self._known)

    @property
    def has_pending_drops(self) -> bool:
        """Whether ended requests wait for a plan to tell the workers."""
        return bool(self._finished)

    def drop(self, request_id: str) -> None:
        """The request finished or was aborted: its row goes with the next plan."""
        if self._known.pop(request_id, None) is not None:
            self._finished.append(request_id)

    def _new_request(self, item: ScheduledSeq, known: _Known | None) -> NewRequest:
        seq = item.seq
        if known is not None:  # a reused id whose old row was never dropped
            self.drop(seq.request_id)
        groups = self._tables(seq)
        self._known[seq.request_id] = _Known(seq, len(groups[0]), [_null_prefix(g, 0) for g in groups])
        return NewRequest(
            request_id=seq.request_id,
            token_ids=seq.token_ids,
            num_prompt_tokens=seq.num_prompt_tokens,
            sampling_params=seq.params,
            eos_token_ids=list(seq.eos_token_ids),
            block_ids=groups,
            num_computed_tokens=seq.num_computed_tokens,
            num_scheduled_tokens=item.num_new_tokens,
            sample=item.sample,
            state_slot=seq.state_slot,
        )

    def _tables(self, seq: Sequence) -> list[list[int]]:
        """Copies of the sequence's tables, one per cache group (checked against the plan's count)."""
        tables = seq.block_tables
        if len(tables) != self.num_cache_groups:
            raise ValueError(f"{seq.request_id}: {len(tables)} cache groups, the plan has {self.num_cache_groups}")
        return [list(t) for t in tables]

    def build(self, out: SchedulerOutput) -> PlannedStep:
        """The plan for `out`. Scheduled sequences already finished (ended while the plan was
        pending, e.g. by a token read back meanwhile) are left out: nothing reads their result."""
        for seq in out.finished:
            self.drop(seq.request_id)
        preempted = []
        for seq in out.preempted:
            known = self._known.get(seq.request_id)
            if known is not None and known.seq is seq and not known.preempted:
                known.preempted = True
                known.num_blocks_sent = 0
                known.num_null_sent = [0] * self.num_cache_groups
                preempted.append(seq.request_id)
        cached = CachedRequests()
        ids, blocks, computed = cached.request_ids, cached.new_block_ids, cached.num_computed_tokens
        scheduled, sample, resumed = cached.num_scheduled_tokens, cached.sample, cached.resumed
        state_slots, nulls = cached.state_slots, cached.num_null_blocks
        new: list[NewRequest] = []
        cached_items: list[ScheduledSeq] = []
        new_items: list[ScheduledSeq] = []
        known_requests = self._known
        for item in out.scheduled:
            seq = item.seq
            if seq.status is SequenceStatus.FINISHED:
                continue
            known = known_requests.get(seq.request_id)
            if known is None or known.seq is not seq:
                new.append(self._new_request(item, known))
                new_items.append(item)
                continue
            tables = seq.block_tables
            sent = known.num_blocks_sent
            ids.append(seq.request_id)
            if known.preempted:
                whole = self._tables(seq)
                blocks.append(whole)
                known.preempted = False
                known.num_null_sent = [_null_prefix(t, 0) for t in whole]
                resumed.append(True)
                state_slots.append(seq.state_slot)
                nulls.append(None)  # the whole tables carry their NULL_BLOCK entries
            else:
                length = len(tables[0])
                blocks.append([t[sent:] for t in tables] if length > sent else None)
                resumed.append(False)
                state_slots.append(None)  # unchanged while the request runs
                # Entries given back by a sliding window since the last plan (a prefix that only grows).
                known_nulls = known.num_null_sent
                grown = None
                for g, table in enumerate(tables):
                    k = known_nulls[g]
                    if k < len(table) and table[k] == NULL_BLOCK:
                        known_nulls[g] = _null_prefix(table, k)
                        grown = True
                nulls.append(list(known_nulls) if grown else None)
            known.num_blocks_sent = len(tables[0])
            computed.append(seq.num_computed_tokens)
            scheduled.append(item.num_new_tokens)
            sample.append(item.sample)
            cached_items.append(item)
        plan = StepPlan(
            step_id=self._next_step_id,
            new_requests=new,
            cached_requests=cached,
            finished_req_ids=self._finished,
            preempted_req_ids=preempted,
            num_cache_groups=self.num_cache_groups,
            state_copies_before=out.state_copies_before,
            state_copies_after=out.state_copies_after,
        )
        self._finished = []
        self._next_step_id += 1
        return PlannedStep(plan, cached_items + new_items)


def _null_prefix(table: list[int], start: int) -> int:
    """Length of the leading run of `NULL_BLOCK` entries in `table`, known to be at least `start`."""
    k = start
    while k < len(table) and table[k] == NULL_BLOCK:
        k += 1
    return k
