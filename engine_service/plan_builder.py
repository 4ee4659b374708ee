"""Scheduler side of the step plan: turns each `SchedulerOutput` into a `StepPlan`.

`StepPlanBuilder` remembers what the workers already know of every request (that they hold a
row, and how many of its block ids per cache group they were sent), so a plan carries a request
whole only once (`NewRequest`) and afterwards only its changes (`CachedRequests`). The engine tells
it about endings (`drop`); preemptions it reads from the scheduler's output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.engine_service.scheduler import ScheduledSeq, SchedulerOutput
from tandem.engine_service.sequence import Sequence, SequenceStatus
from tandem.engine_service.step_plan import CachedRequests, NewRequest, StepPlan


@dataclass
class _Known:
    """What the workers hold of one request."""

    seq: Sequence
    num_blocks_sent: list[int]  # per cache group
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
    ids sent for a request, concatenated over plans since its last (re)start, equal its block
    table. Today every request has one cache group, its `block_table`.
    """

    def __init__(self, num_cache_groups: int = 1) -> None:
        if num_cache_groups != 1:
            raise ValueError("the scheduler hands out block ids for one cache group today")
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
        groups = [list(seq.block_table)]  # one cache group today
        self._known[seq.request_id] = _Known(seq, [len(g) for g in groups])
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
        )

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
                known.num_blocks_sent = [0] * self.num_cache_groups
                preempted.append(seq.request_id)
        cached = CachedRequests()
        ids, blocks, computed = cached.request_ids, cached.new_block_ids, cached.num_computed_tokens
        scheduled, sample, resumed = cached.num_scheduled_tokens, cached.sample, cached.resumed
        state_slots = cached.state_slots
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
            # One cache group today: its table is the sequence's block table.
            table = seq.block_table
            sent = known.num_blocks_sent
            ids.append(seq.request_id)
            if known.preempted:
                blocks.append([list(table)])
                known.preempted = False
                resumed.append(True)
            else:
                blocks.append([table[sent[0]:]] if len(table) > sent[0] else None)
                resumed.append(False)
            sent[0] = len(table)
            state_slots.append(None)  # no model declares per-request state yet
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
        )
        self._finished = []
        self._next_step_id += 1
        return PlannedStep(plan, cached_items + new_items)
