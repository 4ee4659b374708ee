"""Continuous batching: which sequences run in the next step, and how many tokens each.

Unified chunked prefill (as in vLLM v1): there are no prefill and decode phases. Each step has
a token budget; every scheduled sequence gets `min(tokens it still has to compute, budget
left)`. A sequence in the middle of its prompt and a sequence decoding its next token differ
only in that count. Running sequences go first (in arrival order), then waiting ones (FIFO,
or by request priority under `scheduling_policy` "priority", FIFO among equals).

Fairness under long prompts: one sequence's prompt chunk is capped per step
(`SchedulerConfig.max_prefill_tokens_per_seq`), so a long prompt is spread over several steps
and a request that arrives meanwhile is admitted in the next step instead of after the whole
prompt; a step stays small enough that the newcomer's first token is one short step away. A
prompt chunk also leaves one token of the budget for every running decode after it, so decodes
are never starved by prefill.

State checkpoints (hybrid models with prefix caching): after the fair-prefill cap and the
decode reserve have sized a prompt chunk, the block manager may shorten it to end on the last
checkpoint position it reaches (`BlockManager.checkpoint_chunk`), so the recurrent state there
can be saved; a chunk is only ever shortened, never grown.

One step, as driven by the engine:

    out = scheduler.schedule()
    worker.launch(plan_builder.build(out).plan)   # the worker runs it from its own rows
    scheduler.begin_step(out)                # the step's tokens count as computed
    for each sampled seq: seq.mark_pending(row)    # sampled on the device
    ... later: seq.confirm_token(t); check_stop(seq)   # read back; may call seq.finish()
    scheduler.end_step(out)                  # cache full blocks, drop finished

With overlapped scheduling the next step is scheduled and launched between `begin_step` and
`end_step`: a decode sequence's pending token counts as its one uncomputed token, and its input
is read on the device. A sequence whose pending token already reaches its length limit is not
scheduled again (it ends at `end_step`); one that ends by a stop token costs one extra token of
compute, whose result is dropped. `update(out)` is `begin_step` + `end_step`, for callers that
append tokens synchronously.
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog

from tandem.core_protocol import SchedulerReason, SchedulerStop
from tandem.engine_service.config import SchedulerConfig
from tandem.engine_service.cache.block_manager import BlockManager
from tandem.engine_service.sequence import FinishReason, Sequence, SequenceStatus

if TYPE_CHECKING:
    from tandem.engine_service.kv_connector.metadata import KVLoadReport
    from tandem.engine_service.kv_connector.scheduler_side import KVConnectorScheduler

log = structlog.get_logger(__name__)

# stop_reasons of sequences the scheduler itself ends with FinishReason.ERROR.
KV_CACHE_TOO_SMALL = SchedulerStop(SchedulerReason.KV_CACHE_TOO_SMALL)
EXCEEDS_MAX_MODEL_LEN = SchedulerStop(SchedulerReason.EXCEEDS_MAX_MODEL_LEN)
DEADLINE_EXCEEDED = SchedulerStop(SchedulerReason.DEADLINE_EXCEEDED)


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: `num_new_tokens` tokens starting at its computed count."""

    seq: Sequence
    num_new_tokens: int
    # True when this chunk reaches the end of the sequence's tokens: its last logit yields the
    # next token. False for all but the last chunk of a chunked prompt.
    sample: bool


@dataclass
class SchedulerOutput:
    """The plan of one step."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[Sequence] = field(default_factory=list)  # sent back to waiting this step
    finished: list[Sequence] = field(default_factory=list)  # ended by the scheduler (ERROR)
    # State slot -> slot copies (src, dst): checkpoint restores of admitted prefix hits, run
    # before the forward, and checkpoint saves of chunks ending on a checkpoint, run after it.
    state_copies_before: list[tuple[int, int]] = field(default_factory=list)
    state_copies_after: list[tuple[int, int]] = field(default_factory=list)


class Scheduler:
    """Decides each step's batch under a token budget, a sequence cap and the KV block pool.

    When blocks run out for a running sequence, the most recently arrived running sequence not
    yet scheduled this step is preempted by recompute: its blocks are freed and it returns to
    the front of the waiting queue (its written full blocks stay in the prefix cache, so a
    recompute often gets most of them back). No new sequence is admitted in a step that had to
    preempt: memory is tight, and admitting would only cause more preemptions.

    Prefix hits at admission: `BlockManager.match_prefix` gives the cached token count first,
    the chunk size is computed from what remains, and `BlockManager.allocate` then takes the
    same hits and blocks for exactly that chunk.

    Remote KV (a `kv_connector` on a consumer engine): a waiting request whose KV comes from a
    producer is admitted by the connector instead (its blocks allocated, its load queued) and
    moves to `loading` (status LOADING_KV): it holds its blocks and a sequence slot but is never
    scheduled until `loads_done` reports its load — then its computed count jumps by the loaded
    tokens and it runs like any request; a failed load ends it with ERROR (kv_transfer_refused
    when its parameters were refused, kv_producer_unavailable when the producer was not there).

    Leases (a producer's finished prefills whose blocks and state slots wait for a decode leg's
    pull) count as held: a request that cannot fit while leases hold blocks or slots waits for
    them to end (pulled, released or expired, `lease_seconds` at most); it ends with
    kv_cache_too_small only when nothing at all holds blocks or slots and it still does not fit.

    Deadlines (`Sequence.deadline`, the call's gRPC deadline): at the start of every `schedule`
    a sequence whose deadline has passed, waiting, loading or running, ends with ERROR
    (deadline_exceeded) and frees its blocks and slot, so an expired request is never admitted
    and a running one stops consuming steps.

    Structured output: a request whose constraint is still compiling (`add_compiling`, a future
    from the engine's `GrammarCompiler`) waits in `compiling`, outside the queue, so it holds up
    nobody; each `schedule` first moves the finished compilations into `waiting` (matcher
    attached) or ends them with ERROR (invalid_structured_output).

    `running` and `waiting` are exposed for inspection; callers must not mutate them.
    """

    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int,
        device_type: str = "cuda", kv_connector: KVConnectorScheduler | None = None,
    ) -> None:
        # `config` validated itself when built; this check needs the model's context length.
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
            # A whole prompt (or a preempted sequence's prompt and output) must fit in one step.
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({config.max_num_batched_tokens}) "
                f"must be >= max_model_len ({max_model_len})"
            )
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        # Per-sequence prompt tokens of one step (0: none); only chunked prefill can split prompts.
        self.prefill_cap = config.prefill_cap(device_type) if config.enable_chunked_prefill else 0
        # Chunks end on state checkpoint positions (only chunked prefill may split a prompt).
        self.cut_at_checkpoints = block_manager.checkpoints is not None and config.enable_chunked_prefill
        # Both stay sorted by arrival: admission is FIFO and preempted sequences (always the
        # latest running ones) go back to the front of `waiting`.
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._requests: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self.kv_connector = kv_connector
        # Requests holding blocks while their KV is loaded from a producer (admission order).
        self.loading: dict[str, Sequence] = {}
        self._failed_loads: list[tuple[Sequence, SchedulerStop]] = []
        self._clock = time.monotonic
        # How many live sequences carry a deadline (0: `schedule` skips looking for expired ones).
        self._num_deadlines = 0
        # Requests whose structured-output matcher is being compiled (arrival order).
        self.compiling: dict[str, tuple[Sequence, Future]] = {}

    # -- requests ----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.request_id in self._requests:
            raise ValueError(f"duplicate request id {seq.request_id!r}")
        seq.status = SequenceStatus.WAITING
        self._enqueue(seq)
        self._requests[seq.request_id] = seq
        self._num_deadlines += seq.deadline is not None

    def _enqueue(self, seq: Sequence) -> None:
        """FCFS: at the end. Priority policy: before the first waiting sequence of a larger
        (later) priority, so equal priorities keep arrival order (a preempted sequence, put back
        at the front by `_preempt`, is overtaken only by a higher priority too). Running
        sequences are never preempted for priority: it orders admission only."""
        if self.config.scheduling_policy != "priority":
            self.waiting.append(seq)
            return
        rank = seq.params.priority
        for i, other in enumerate(self.waiting):
            if other.params.priority > rank:
                self.waiting.insert(i, seq)
                return
        self.waiting.append(seq)

    def add_refused(self, seq: Sequence, stop: SchedulerStop) -> None:
        """Takes a request that must end before it runs (it never waits): the next `schedule`
        ends it with ERROR `stop`, as it ends a failed load."""
        if seq.request_id in self._requests:
            raise ValueError(f"duplicate request id {seq.request_id!r}")
        self._requests[seq.request_id] = seq
        self._failed_loads.append((seq, stop))

    def add_compiling(self, seq: Sequence, matcher: Future) -> None:
        """Takes a constrained request whose matcher `matcher` is still compiling: it joins the
        queue once the future is done (see the class docstring)."""
        if seq.request_id in self._requests:
            raise ValueError(f"duplicate request id {seq.request_id!r}")
        seq.status = SequenceStatus.COMPILING
        self._requests[seq.request_id] = seq
        self.compiling[seq.request_id] = (seq, matcher)
        self._num_deadlines += seq.deadline is not None

    def wait_for_compiling(self, timeout: float) -> None:
        """Block up to `timeout` seconds for a compilation to finish (an engine with nothing
        else to do waits here instead of spinning)."""
        if self.compiling:
            wait_futures([f for _, f in self.compiling.values()], timeout=timeout, return_when=FIRST_COMPLETED)

    def _take_compiled(self, out: SchedulerOutput) -> None:
        """Moves every request whose matcher is ready into the queue; a failed compilation ends
        its request with ERROR (invalid_structured_output, llguidance's message)."""
        for rid, (seq, future) in list(self.compiling.items()):
            if not future.done():
                continue
            del self.compiling[rid]
            try:
                seq.grammar = future.result()
            except Exception as exc:  # InvalidStructuredOutput, or anything llguidance raised
                self._finish_error(out, seq, SchedulerStop(SchedulerReason.INVALID_STRUCTURED_OUTPUT, str(exc)))
                continue
            seq.status = SequenceStatus.WAITING
            self._enqueue(seq)

    def get(self, request_id: str) -> Sequence | None:
        return self._requests.get(request_id)

    def abort(self, request_id: str) -> Sequence | None:
        """End a waiting or running sequence, freeing its blocks. None if unknown or done."""
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return None
        if any(s is seq for s, _ in self._failed_loads):  # ending anyway: ends as aborted
            self._failed_loads = [(s, stop) for s, stop in self._failed_loads if s is not seq]
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status == SequenceStatus.COMPILING:
            self.compiling.pop(request_id)[1].cancel()
        elif seq.status == SequenceStatus.LOADING_KV:
            del self.loading[request_id]
            assert self.kv_connector is not None
            self.kv_connector.cancel_load(request_id)  # before the blocks may go to anyone else
        else:  # running, or finished by the engine in a step not yet passed to update()
            self.running.remove(seq)
        self.block_manager.free(seq)
        seq.finish(FinishReason.ABORT)
        return seq

    # -- introspection -----------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Queued requests, those whose constraint still compiles included."""
        return len(self.waiting) + len(self.compiling)

    @property
    def waiting_tokens(self) -> int:
        """Tokens the waiting sequences still have to compute (for bounding the queue)."""
        waiting = sum(seq.num_uncomputed_tokens for seq in self.waiting)
        return waiting + sum(seq.num_uncomputed_tokens for seq, _ in self.compiling.values()) if self.compiling else waiting

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading or self._failed_loads or self.compiling)

    def loads_done(self, report: KVLoadReport) -> None:
        """The worker's KV load report: loaded requests join `running` with their computed count
        advanced; failed ones end with ERROR in the next `schedule`."""
        if self.kv_connector is None or not report:
            return
        finished, failed = self.kv_connector.loads_done(report)
        for spec in finished:
            seq = self.loading.pop(spec.request_id)
            self.kv_connector.load_finished(seq, spec.num_tokens)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        for rid, stop in failed.items():
            self._failed_loads.append((self.loading.pop(rid), stop))

    # -- the step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        for seq, stop in self._failed_loads:
            self._finish_error(out, seq, stop)
        self._failed_loads.clear()
        if self.compiling:
            self._take_compiled(out)
        if self._num_deadlines:
            self._end_expired(out)
        budget = self.config.max_num_batched_tokens
        budget, num_ending = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget, num_ending)
        out.num_batched_tokens = sum(s.num_new_tokens for s in out.scheduled)
        if self.block_manager.checkpoints is not None:
            out.state_copies_before, out.state_copies_after = self.block_manager.pop_state_copies()
        return out

    def _end_expired(self, out: SchedulerOutput) -> None:
        """Ends every sequence whose deadline has passed, wherever it is (see the class docstring)."""
        now = self._clock()
        self._num_deadlines = 0
        expired = []
        for seq in self._requests.values():
            if seq.deadline is None:
                continue
            if seq.deadline <= now:
                expired.append(seq)
            else:
                self._num_deadlines += 1
        for seq in expired:
            if seq.is_finished:
                continue  # ended by a token not yet passed to end_step: it ends there
            if seq.status == SequenceStatus.WAITING:
                self.waiting.remove(seq)
            elif seq.status == SequenceStatus.COMPILING:
                self.compiling.pop(seq.request_id)[1].cancel()
            elif seq.status == SequenceStatus.LOADING_KV:
                del self.loading[seq.request_id]
                assert self.kv_connector is not None
                self.kv_connector.cancel_load(seq.request_id)  # before its blocks go to anyone else
            else:
                self.running.remove(seq)
            self._finish_error(out, seq, DEADLINE_EXCEEDED)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> tuple[int, int]:
        """Schedules running sequences; returns the budget left and how many running sequences
        end with their pending token (counted over all of them whenever budget is left)."""
        i = num_ending = 0
        # Decodes not yet passed keep one token each of the budget from earlier prefill chunks.
        reserved = self._count_decodes()
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            is_decode = seq.num_uncomputed_tokens == 1
            reserved -= is_decode
            num_new = self._chunk_size(seq.num_uncomputed_tokens, budget, reserved)
            if num_new > 1 and self.cut_at_checkpoints:
                num_new = self.block_manager.checkpoint_chunk(seq, seq.num_computed_tokens, num_new)
            ending = seq.num_pending_tokens > 0 and seq.reached_length_limit(self.max_model_len)
            if num_new == 0 or ending:
                # An ending sequence needs no further step; it leaves `running` when its pending
                # token is confirmed (overlapped scheduling).
                num_ending += ending
                i += 1
                continue
            while not self.block_manager.allocate(seq, num_new):
                if len(self.running) == 1 and not self._leases_hold_resources():
                    # Alone in the pool and still short of blocks: it can never fit. (With
                    # leases holding blocks or slots it preempts itself below and waits for them.)
                    self.running.pop()
                    self._finish_error(out, seq, KV_CACHE_TOO_SMALL)
                    break
                # Everything after index i is unscheduled and arrived later than `seq`.
                # A preempted decode keeps its reserved token: the reserve may leave a few tokens
                # unused in a step that preempts (which admits nothing anyway).
                victim = self.running.pop()
                self._preempt(out, victim)
                if victim is seq:
                    break
            else:
                self._add_scheduled(out, seq, num_new)
                budget -= num_new
                i += 1
        return budget, num_ending

    def _count_decodes(self) -> int:
        """Running sequences with exactly one token to compute (decodes)."""
        return sum(1 for seq in self.running if seq.num_uncomputed_tokens == 1)

    def _chunk_size(self, num_todo: int, budget: int, reserved: int) -> int:
        """Tokens a sequence with `num_todo` tokens to compute gets this step.

        A decode (one token) gets it whenever budget is left. A prompt chunk is at most
        `prefill_cap` tokens (with chunked prefill; 0: no cap) and leaves `reserved`
        tokens for the running decodes scheduled after it, so prefill never starves a decode.
        """
        if num_todo <= 1:
            return min(num_todo, budget)
        num_new = min(num_todo, budget - reserved)
        if self.prefill_cap:
            num_new = min(num_new, self.prefill_cap)
        return max(num_new, 0)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, num_ending: int) -> None:
        bm = self.block_manager
        # Sequences about to end by length give up their slot now, as they would have without
        # overlap (`running` may exceed max_num_seqs until their tokens are confirmed).
        free_slots = self.config.max_num_seqs - len(self.running) - len(self.loading) + num_ending
        while self.waiting and budget > 0 and free_slots > 0:
            seq = self.waiting[0]
            if seq.num_tokens > self.max_model_len:
                self.waiting.popleft()
                self._finish_error(out, seq, EXCEEDS_MAX_MODEL_LEN)
                continue
            if self.kv_connector is not None and self.kv_connector.needs_load(seq):
                if not self._admit_load(out, seq):
                    break  # FIFO: nobody overtakes the head of the queue
                free_slots -= 1
                continue
            # match_prefix and allocate agree: nothing touches the cache in between.
            num_hit = bm.match_prefix(seq)
            num_todo = seq.num_tokens - num_hit
            if not self.config.enable_chunked_prefill and num_todo > budget:
                break
            num_new = self._chunk_size(num_todo, budget, 0)
            if num_new > 1 and self.cut_at_checkpoints:
                num_new = bm.checkpoint_chunk(seq, num_hit, num_new)
            if not bm.allocate(seq, num_new):
                if not self._anything_holds_resources():
                    # The whole pool is free or evictable and this still does not fit.
                    self.waiting.popleft()
                    self._finish_error(out, seq, KV_CACHE_TOO_SMALL)
                    continue
                break  # FIFO: nobody overtakes the head of the queue
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._add_scheduled(out, seq, num_new)
            budget -= num_new
            free_slots -= 1

    def _admit_load(self, out: SchedulerOutput, seq: Sequence) -> bool:
        """Admit the head of `waiting` for a remote KV load; False when it must wait for blocks."""
        from tandem.engine_service.kv_connector.scheduler_side import LoadRefused

        assert self.kv_connector is not None
        try:
            admitted = self.kv_connector.admit_load(seq)
        except LoadRefused as exc:
            self.waiting.popleft()
            self._finish_error(out, seq, SchedulerStop(SchedulerReason.KV_TRANSFER_REFUSED, str(exc)))
            return True
        if not admitted:
            if not self._anything_holds_resources():
                self.waiting.popleft()
                self._finish_error(out, seq, KV_CACHE_TOO_SMALL)
                return True
            return False
        self.waiting.popleft()
        seq.status = SequenceStatus.LOADING_KV
        self.loading[seq.request_id] = seq
        return True

    def _leases_hold_resources(self) -> bool:
        """Whether producer leases hold blocks or state slots (they return when the lease ends:
        pulled, released or expired)."""
        return self.kv_connector is not None and self.kv_connector.leases_hold_resources()

    def _anything_holds_resources(self) -> bool:
        """Whether any blocks or slots may still come back to the pool: held by running or
        loading sequences, or by leases. When nothing holds any, the whole pool is free or
        evictable, and a request that does not fit now can never fit."""
        return bool(self.running or self.loading) or self._leases_hold_resources()

    @property
    def blocked_on_leases(self) -> bool:
        """Only leases keep the waiting head out: nothing runs or loads, so no step frees
        anything until a lease ends (the engine waits a little instead of spinning)."""
        return bool(self.waiting) and not self.running and not self.loading and self._leases_hold_resources()

    @staticmethod
    def _add_scheduled(out: SchedulerOutput, seq: Sequence, num_new: int) -> None:
        sample = seq.num_computed_tokens + num_new == seq.num_tokens
        out.scheduled.append(ScheduledSeq(seq, num_new, sample))

    def _preempt(self, out: SchedulerOutput, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        log.debug("preempted", request_id=seq.request_id, num_tokens=seq.num_tokens)

    def _finish_error(self, out: SchedulerOutput, seq: Sequence, reason: SchedulerStop) -> None:
        self.block_manager.free(seq)
        seq.finish(FinishReason.ERROR, reason)
        self._requests.pop(seq.request_id, None)
        out.finished.append(seq)
        log.warning(
            "request_cannot_run", request_id=seq.request_id, reason=reason.reason.value, num_tokens=seq.num_tokens
        )

    def begin_step(self, output: SchedulerOutput) -> None:
        """The step was launched: its new tokens count as computed (the device writes their K/V
        before any later step reads them)."""
        for item in output.scheduled:
            if self._requests.get(item.seq.request_id) is item.seq:  # not aborted meanwhile
                item.seq.num_computed_tokens += item.num_new_tokens

    def end_step(self, output: SchedulerOutput) -> None:
        """The step's sampled tokens were read back, appended and stop-checked: cache newly full
        blocks, release finished sequences."""
        bm = self.block_manager
        for item in output.scheduled:
            seq = item.seq
            if self._requests.get(seq.request_id) is not seq:
                continue  # aborted or ended meanwhile; its blocks are already free
            bm.commit(seq)
            if item.sample and not seq.is_finished and seq.num_uncomputed_tokens == 0:
                raise RuntimeError(
                    f"sequence {seq.request_id} was sampled but no token was appended or marked pending"
                )
        if any(seq.is_finished for seq in self.running):
            still_running = []
            for seq in self.running:
                if seq.is_finished:
                    bm.free(seq)
                    self._requests.pop(seq.request_id, None)
                else:
                    still_running.append(seq)
            self.running = still_running
        for item in output.scheduled:
            # Preempted while its token was pending, and that token ended it: it waits no more.
            seq = item.seq
            if seq.is_finished and self._requests.get(seq.request_id) is seq:
                self.waiting.remove(seq)
                bm.free(seq)
                self._requests.pop(seq.request_id)

    def update(self, output: SchedulerOutput) -> None:
        """`begin_step` + `end_step`: the engine has already appended tokens and checked stops."""
        self.begin_step(output)
        self.end_step(output)
