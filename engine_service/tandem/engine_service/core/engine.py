"""The engine loop body: one `step()` schedules, runs the model, samples and reports deltas.

`LLMEngine` is single-threaded on purpose: the scheduler, block manager and sequences are
touched only by the thread that calls `step()`. `EngineCore` (core.py) drives it with typed
messages, in the engine-core process or on a thread of the gRPC process.

Overlapped scheduling (on by default on CUDA): `step()` schedules and launches step N — its
decode inputs read step N-1's sampled tokens on the device — and only then waits for step N-1's
tokens, appends them, checks stops and reports them. The host's scheduling, input building and
output handling so run while the device computes. Steps whose sampling needs every earlier
token on the host (repetition/presence/frequency penalties) first finish the step in flight.
Without overlap, `step()` launches step N and finishes it before returning.

The scheduler side and the worker side meet only through a `StepPlan` (step_plan.py): each
step the `StepPlanBuilder` turns the scheduler's output into a plan (new requests whole, cached
ones as deltas, drops), the `StepWorker` applies it to its persistent rows and runs it, and hands
back sampled token ids; appending them to the `Sequence`s, stop checks and outputs stay here.

Structured output: a constrained request's matcher compiles on the `GrammarCompiler`'s threads
while the request waits in the scheduler; each step, the sampled constrained sequences' matchers
fill the plan's token bitmask (after the step in flight finished: like penalties, a matcher
needs every earlier token), and every read-back token advances its sequence's matcher before
the stop check. With no constrained request alive none of this runs.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import structlog

from tandem.core_protocol import EngineStats, KVTransferParams, RequestOutput, SchedulerStop
from tandem.engine_service.config import EngineConfig
from tandem.engine_service.cache.block_manager import BlockManager
from tandem.engine_service.kv_connector.connector import KVConnector, build_kv_connector
from tandem.engine_service.worker.model_runner import ModelRunner
from tandem.engine_service.core.plan_builder import StepPlanBuilder
from tandem.engine_service.worker.sampler import Sampler
from tandem.engine_service.core.scheduler import Scheduler, SchedulerOutput
from tandem.engine_service.sequence import FinishReason, SamplingParams, Sequence
from tandem.engine_service.core.stopping import check_stop
from tandem.engine_service.grammar.bitmask import fill_bitmask, num_words
from tandem.engine_service.grammar.compiler import GrammarCompiler
from tandem.engine_service.step_plan import TokenBitmask
from tandem.engine_service.dummy_configs import get_dummy_config
from tandem.engine_service.worker.tokenizer_files import dummy_tokenizer_dir
from tandem.model_spec import DUMMY_PREFIX
from tandem.engine_service.worker.worker import StepWorker, WorkerStep

log = structlog.get_logger(__name__)


# Entries of `BlockManager.group_usage()` that are not paged cache groups.
_NOT_PAGED = ("state_slots", "state_checkpoints")

# One request's delta of one step: the protocol's RequestOutput (torch-free, sent per step).
StepOutput = RequestOutput


@dataclass
class EngineCounters:
    """Monotonic counters since start (for Utility STATS and metrics)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0


# How long a step that could admit nothing, because leases hold the blocks or slots the waiting
# head needs, waits before the next one looks again (the sweep frees ended leases each step).
LEASE_WAIT_S = 0.005


@dataclass
class LaunchedStep:
    """A step queued on the device whose sampled tokens are not yet on the host."""

    plan: SchedulerOutput
    sampling: list[Sequence]  # in sampled-token row order (the step plan's batch order)
    worker_step: WorkerStep | None  # None when the plan ran nothing


class LLMEngine:
    """Continuous batching over one model replica: admission, stepping, stopping, aborts."""

    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None, kv_ipc=None) -> None:
        self.config = config
        self.runner = runner or ModelRunner(config)
        self.max_model_len = self.runner.max_model_len
        plan = getattr(self.runner, "memory_plan", None)  # stand-in runners have one plain pool
        prefix_caching = config.cache.enable_prefix_caching
        if prefix_caching and not getattr(self.runner, "supports_prefix_caching", True):
            # A model that cannot resume a cached prefix (hybrid models can: state checkpoints).
            log.info("prefix caching off: the model cannot resume a cached prefix",
                     architecture=getattr(self.runner, "architecture", None))
            prefix_caching = False
        # Models with state groups hit only where a state checkpoint exists (kv_cache.py).
        self.block_manager = (
            BlockManager.from_plan(plan, prefix_caching, config.cache.checkpoint_stride())
            if plan is not None
            else BlockManager(self.runner.num_blocks, self.runner.block_size, prefix_caching)
        )
        # Disaggregated prefill/decode (None unless --kv-role): leases, loads, the pull server.
        self.kv: KVConnector | None = build_kv_connector(config.kv_transfer, self.block_manager, self.runner,
                                                         ipc=kv_ipc)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len,
                                   device_type=self.runner.device.type,
                                   kv_connector=self.kv.scheduler if self.kv is not None else None)
        self.sampler = Sampler(vocab_size=self.runner.vocab_size)
        # One block table per paged cache group travels in every plan and lives in every row.
        num_cache_groups = len(self.block_manager.pools)
        self.plan_builder = StepPlanBuilder(num_cache_groups)
        self.worker = StepWorker(self.runner, self.sampler, num_cache_groups,
                                 kv_worker=self.kv.worker if self.kv is not None else None)
        self.eos_token_ids = tuple(self.runner.eos_token_ids)
        self.counters = EngineCounters()
        self._first_scheduled: dict[str, float] = {}
        mode = config.scheduler.overlap_scheduling
        self.overlap = mode == "on" or (mode == "auto" and self.runner.device.type == "cuda")
        self._in_flight: LaunchedStep | None = None
        # Structured output: the compiler (made on the first constrained request) and the ids of
        # the constrained requests alive (empty: steps skip every structured-output check).
        self._grammars: GrammarCompiler | None = None
        self._constrained: set[str] = set()

    # -- capacity ----------------------------------------------------------------------------
    @property
    def kv_capacity_tokens(self) -> int:
        return self.block_manager.num_blocks * self.block_manager.block_size

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    # -- requests ----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        kv_transfer_params: KVTransferParams | None = None,
        deadline: float | None = None,
        caller: str | None = None,
    ) -> Sequence:
        seq = Sequence(request_id, prompt_token_ids, params, eos_token_ids=self.eos_token_ids,
                       arrival_time=arrival_time, kv_transfer_params=kv_transfer_params, deadline=deadline)
        refused = self.kv.scheduler.reserve_lease(seq, caller) if self.kv is not None else None
        so = params.structured_output
        if refused is not None:  # a prefill leg past the lease caps: ends before it runs
            self.scheduler.add_refused(seq, refused)
        elif so is not None:  # waits in the scheduler until its matcher compiled
            prefix = prompt_token_ids[len(prompt_token_ids) - so.num_constrained_prompt_tokens:] \
                if so.num_constrained_prompt_tokens else []
            self.scheduler.add_compiling(seq, self.grammar_compiler().submit(so, prefix))
            self._constrained.add(request_id)
        else:
            self.scheduler.add(seq)
        self.counters.prompt_tokens += len(prompt_token_ids)
        return seq

    def grammar_compiler(self) -> GrammarCompiler:
        """The structured-output compiler, made on first use (the model's vocabulary loads on its
        threads, from `tokenizer_path()`)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer_path(), self.vocab_size, self.eos_token_ids)
        return self._grammars

    def tokenizer_path(self) -> str | None:
        """The model's directory, or for dummy weights the tokenizer that fits their vocabulary."""
        if self.runner.model_path:
            return str(self.runner.model_path)
        model = self.config.model
        if not model.model.startswith(DUMMY_PREFIX):
            return None
        return str(dummy_tokenizer_dir(get_dummy_config(model.model[len(DUMMY_PREFIX):]), model.cache_dir))

    def first_scheduled_time(self, request_id: str) -> float | None:
        """When a live request was first in a step (`time.monotonic()`); None before that."""
        return self._first_scheduled.get(request_id)

    def abort(self, request_id: str) -> Sequence | None:
        self._constrained.discard(request_id)
        seq = self.scheduler.abort(request_id)
        if self.kv is not None:
            # A prefill leg aborted after it finished (the client left before the decode leg).
            self.kv.scheduler.release_request(request_id)
        if seq is not None:
            self.plan_builder.drop(request_id)
            self.counters.aborted_requests += 1
            self._first_scheduled.pop(request_id, None)
        return seq

    def has_work(self) -> bool:
        """Whether `step()` has something to do: requests, a step in flight, or endings the
        worker has not been told of yet (they ride on the next plan)."""
        return (self._in_flight is not None or self.scheduler.has_work() or self.plan_builder.has_pending_drops
                or (self.kv is not None and self.kv.scheduler.has_pending_metadata()))

    def reset_after_warmup(self) -> None:
        """Forget what a warm-up (`warmup.py`) left: every cached prefix and state checkpoint, and
        every total STATS reports (engine counters, prefix lookups and hits, checkpoint saves,
        preemptions), so the engine serves from the state it was built in. Only when idle."""
        if self.has_work():
            raise RuntimeError("reset_after_warmup needs an idle engine")
        self.block_manager.reset_prefix_cache()
        self.block_manager.reset_counters()
        self.scheduler.num_preemptions = 0
        self.counters = EngineCounters()

    def abort_and_settle(self, request_ids: Iterable[str], max_steps: int = 1000) -> None:
        """Abort each of `request_ids` (unknown or finished ones are skipped) and step until the
        engine is idle, so it can be reused: the endings reach the worker on the next plans, a
        step or two. At most `max_steps` steps: it never spins."""
        for rid in list(request_ids):
            self.abort(rid)
        for _ in range(max_steps):
            if not self.has_work():
                return
            self.step()

    def kv_housekeeping(self) -> None:
        """Apply finished/failed KV loads and free released or expired leases (also called by an
        idle engine core, so a lease's blocks return without new requests)."""
        if self.kv is None:
            return
        self.scheduler.loads_done(self.worker.take_kv_report())
        self.kv.scheduler.sweep()

    def close(self) -> None:
        """Stop the KV pull server, cancel KV loads and stop the grammar compiler's threads (the model
        itself needs no closing)."""
        if self.kv is not None:
            self.kv.close()
        if self._grammars is not None:
            self._grammars.close()

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Schedule and launch one step; report the tokens of the step that completed (this one,
        or with overlap the one launched by the previous call)."""
        outputs: dict[str, StepOutput] = {}
        self.kv_housekeeping()
        plan = self.scheduler.schedule()
        for seq in plan.finished:  # ended by the scheduler itself (cannot ever fit)
            outputs[seq.request_id] = self._output(seq)
        previous, self._in_flight = self._in_flight, None
        if plan.scheduled:
            # Penalties count every earlier token, a matcher must have consumed them: neither
            # can sample past a pending one.
            if previous is not None and (
                    any(item.seq.params.uses_penalties for item in plan.scheduled if item.sample)
                    or (self._constrained and any(item.seq.grammar is not None for item in plan.scheduled if item.sample))):
                self._finish(previous, outputs)
                previous = None
            launched = self._launch(plan, previous)
            if self.overlap:
                self._in_flight = launched
            else:
                self._finish(launched, outputs)
        if previous is not None:
            self._finish(previous, outputs)
        self._forget_finished(outputs)
        if not plan.scheduled:
            # Nothing ran: the worker still hears of preemptions, endings and KV loads.
            self.worker.launch(self._with_kv(self.plan_builder.build(plan).plan))
            if (self.kv is not None and self.kv.worker is not None and self.scheduler.loading
                    and not outputs and self._in_flight is None and not self.scheduler.running):
                self.kv.worker.wait(0.005)  # only loads to wait for: do not spin
            elif not outputs and self._in_flight is None and self.scheduler.blocked_on_leases:
                time.sleep(LEASE_WAIT_S)  # only a lease's end can admit the head: do not spin
            elif not outputs and self._in_flight is None and self.scheduler.compiling:
                self.scheduler.wait_for_compiling(LEASE_WAIT_S)  # only grammars to wait for: do not spin
        return list(outputs.values())

    def _with_kv(self, plan):
        if self.kv is not None:
            plan.kv_connector_metadata = self.kv.scheduler.take_metadata()
        return plan

    def _launch(self, plan: SchedulerOutput, previous: LaunchedStep | None) -> LaunchedStep:
        """Queue the model and the sampler for `plan` on the device; nothing waits for it."""
        now = time.monotonic()
        for item in plan.scheduled:
            self._first_scheduled.setdefault(item.seq.request_id, now)
        planned = self.plan_builder.build(plan)
        if self._constrained:
            planned.plan.grammar_bitmask = self._grammar_bitmask(planned.sampling)
        worker_step = self.worker.launch(self._with_kv(planned.plan),
                                         previous.worker_step if previous is not None else None)
        self.scheduler.begin_step(plan)
        sampling = planned.sampling
        for row, seq in enumerate(sampling):
            seq.mark_pending(row)
        if worker_step is not None:
            self.counters.steps += 1
        return LaunchedStep(plan, sampling, worker_step)

    def _grammar_bitmask(self, sampling: list[Sequence]) -> TokenBitmask | None:
        """The allowed next tokens of the sampled constrained sequences (None if there are none).
        A sequence that ended meanwhile (its last token finished it) samples a token that is
        dropped: it needs no mask."""
        rows = [i for i, seq in enumerate(sampling) if seq.grammar is not None and not seq.is_finished]
        if not rows:
            return None
        matchers = []
        for i in rows:
            seq = sampling[i]
            seq.grammar.sync(seq.output_token_ids)
            matchers.append(seq.grammar)
        vocab = self.vocab_size
        return TokenBitmask(rows=rows, num_words=num_words(vocab), words=fill_bitmask(matchers, vocab).tobytes())

    def _finish(self, step: LaunchedStep, outputs: dict[str, StepOutput]) -> None:
        """Wait for `step`'s tokens; append them, check stops, fill `outputs`, release blocks."""
        sampled = self.worker.collect(step.worker_step) if step.worker_step is not None else None
        if step.worker_step is not None and step.worker_step.prompt_logprobs is not None:
            self._add_prompt_logprobs(step, outputs)
        if sampled is not None:
            for seq, token_id, lp in zip(step.sampling, sampled.token_ids, sampled.logprobs):
                if seq.is_finished:
                    continue  # aborted, or ended by an earlier token while this one was computed
                seq.confirm_token(token_id)
                if seq.grammar is not None:
                    seq.grammar.accept(token_id)
                check_stop(seq, self.max_model_len)
                o = outputs.get(seq.request_id) or outputs.setdefault(seq.request_id, self._output(seq))
                o.new_token_ids.append(token_id)
                o.new_logprobs.append(lp)
                self.counters.generation_tokens += 1
                if seq.is_finished:
                    self._fill_ending(o, seq)
        self.scheduler.end_step(step.plan)

    def _add_prompt_logprobs(self, step: LaunchedStep, outputs: dict[str, StepOutput]) -> None:
        """The prompt logprobs `step`'s prefill chunks computed, onto their requests' outputs
        (before the first token, which the last chunk's step samples)."""
        scheduled = {item.seq.request_id: item.seq for item in step.plan.scheduled}
        for request_id, entries in self.worker.collect_prompt_logprobs(step.worker_step).items():
            seq = scheduled.get(request_id)
            if seq is None or seq.is_finished:
                continue  # aborted while the step ran
            o = outputs.get(request_id) or outputs.setdefault(request_id, self._output(seq))
            o.new_prompt_logprobs.extend(entries)

    def _output(self, seq: Sequence) -> StepOutput:
        o = StepOutput(
            request_id=seq.request_id,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_prompt_tokens=seq.num_cached_prompt_tokens or 0,
            arrival_time=seq.arrival_time,  # on every output: metrics time the first token from it
        )
        if seq.is_finished:
            self._fill_ending(o, seq)
        return o

    def _fill_ending(self, o: StepOutput, seq: Sequence) -> None:
        if self.kv is not None:
            self.kv.scheduler.on_request_finished(seq)  # a prefill leg: lease, decode-leg parameters
        o.finished = True
        o.finish_reason = seq.finish_reason
        o.stop_reason = seq.stop_reason
        o.num_prompt_tokens = seq.num_prompt_tokens
        o.num_output_tokens = seq.num_output_tokens
        o.num_cached_prompt_tokens = seq.num_cached_prompt_tokens or 0
        o.arrival_time = seq.arrival_time
        o.first_scheduled_time = self.first_scheduled_time(seq.request_id)
        o.first_token_time = seq.first_token_time
        o.kv_transfer_params = seq.kv_transfer_params
        if seq.finish_reason == FinishReason.ERROR:
            reason = seq.stop_reason
            if isinstance(reason, SchedulerStop):
                o.error = f"{reason.reason.value}: {reason.detail}" if reason.detail else reason.reason.value
            else:
                o.error = "engine error"

    def _forget_finished(self, outputs: dict[str, StepOutput]) -> None:
        for o in outputs.values():
            if o.finished:
                self._constrained.discard(o.request_id)
                self.plan_builder.drop(o.request_id)
                self.counters.finished_requests += 1
                self._first_scheduled.pop(o.request_id, None)

    # -- introspection -----------------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm = self.block_manager
        groups = bm.group_usage()
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            waiting_tokens=self.scheduler.waiting_tokens,
            kv_blocks_total=bm.num_blocks,
            kv_blocks_used=bm.num_used_blocks,
            kv_usage=bm.usage,
            prefix_cache_queries=bm.prefix_queries,
            prefix_cache_hits=bm.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=self.counters.prompt_tokens,
            generation_tokens_total=self.counters.generation_tokens,
            steps_total=self.counters.steps,
            finished_requests_total=self.counters.finished_requests,
            aborted_requests_total=self.counters.aborted_requests,
            overlap_scheduling=self.overlap,
            max_prefill_tokens_per_seq=self.scheduler.prefill_cap,
            group_blocks_used=sum(g["used"] for name, g in groups.items() if name not in _NOT_PAGED),
            state_slots_used=groups.get("state_slots", {}).get("used", 0),
            prefix_cache_kv_hits=bm.prefix_kv_hits,
            state_checkpoints_total=groups.get("state_checkpoints", {}).get("total", 0),
            state_checkpoints_used=groups.get("state_checkpoints", {}).get("used", 0),
            state_checkpoints_pending=groups.get("state_checkpoints", {}).get("pending", 0),
            state_checkpoint_saves=bm.checkpoints.num_saved if bm.checkpoints is not None else 0,
            **self._kv_stats(),
        )

    def _kv_stats(self) -> dict:
        if self.kv is None:
            return {}
        c = self.kv.scheduler.counters
        leases = self.kv.scheduler.leases
        return dict(
            kv_remote_tokens_loaded=c.remote_tokens_loaded, kv_remote_blocks_pulled=c.remote_blocks_pulled,
            kv_remote_bytes_pulled=c.remote_bytes_pulled, kv_remote_load_seconds=c.remote_load_seconds,
            kv_remote_loads=c.remote_loads,
            kv_remote_load_failures=c.remote_load_failures, kv_loading_requests=len(self.scheduler.loading),
            kv_leases_active=len(leases), kv_leases_granted=c.leases_granted, kv_leases_expired=leases.expired_total,
        )
