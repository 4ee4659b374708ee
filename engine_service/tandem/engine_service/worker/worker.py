"""The worker: applies step plans to its persistent rows, runs the model, samples, reads back.

`StepWorker` is what one rank would run: `launch(plan, previous)` updates the rows from the plan,
builds the step's inputs from the rows, queues the forward pass and the sampler on the device and
marks the sampled rows' tokens pending (a plan's state-slot copies run around the forward:
checkpoint restores before it, saves after it); `collect(step)` waits for those tokens and appends them
to the rows. Nothing here reads a scheduler object: the engine hands over a `StepPlan` and gets
back token ids (and logprobs) in the plan's sampled-row order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine_service.kv_connector.metadata import KVLoadReport
from tandem.engine_service.kv_connector.worker_side import KVConnectorWorker
from tandem.engine_service.worker.model_runner import ModelRunner
from tandem.core_protocol import TokenLogprobs
from tandem.engine_service.worker.prompt_logprobs import (
    PendingPromptLogprobs,
    compute_prompt_logprobs,
    hidden_rows,
    take_prompt_logprob_spans,
)
from tandem.engine_service.worker.sampler import PendingSample, Sampler, SamplerOutput
from tandem.engine_service.step_plan import StepPlan
from tandem.engine_service.worker.worker_rows import RequestRow, StepBatch, WorkerRows, host_inputs_from_rows


@dataclass
class WorkerStep:
    """A launched step: its batch, the rows it samples (sampled-row order) and their tokens, and
    the prompt logprobs its prefill chunks compute."""

    batch: StepBatch
    sampling: list[RequestRow]
    sample: PendingSample | None
    prompt_logprobs: PendingPromptLogprobs | None = None

    @property
    def token_ids(self) -> torch.Tensor | None:
        """The sampled tokens on the device (what the next step's pending inputs read)."""
        return self.sample.token_ids if self.sample is not None else None


class StepWorker:
    """Runs step plans on one model replica over persistent per-request rows.

    Invariants: the rows change only through `launch` (the plan, then the pending marks) and
    `collect` (read-back tokens); a row dropped or replaced (reused id) between a launch and its
    collect is no longer among the rows, so that step's token reaches no live row.
    """

    def __init__(self, runner: ModelRunner, sampler: Sampler, num_cache_groups: int = 1,
                 kv_worker: KVConnectorWorker | None = None) -> None:
        self.runner = runner
        self.sampler = sampler
        self.rows = WorkerRows(num_cache_groups)
        # The KV connector's worker side (consumer engines): starts/cancels the plan's loads and
        # writes completed ones; what completed waits in `_kv_report` for the scheduler side.
        self.kv_worker = kv_worker
        self._kv_report = KVLoadReport()

    def take_kv_report(self) -> KVLoadReport:
        """Loads written (or failed) since the last call: what the scheduler side learns next."""
        report, self._kv_report = self._kv_report, KVLoadReport()
        return report

    def execute(self, batch: StepBatch, previous: WorkerStep | None = None) -> torch.Tensor:
        """Forward `batch` (from `rows.apply`); float32 logits of its sampling entries. The rows
        are not changed, so a batch may be executed again (benchmarks time this)."""
        host = host_inputs_from_rows(batch, self.runner.block_size)
        return self.runner.forward(host, previous.token_ids if previous is not None else None)

    def launch(self, plan: StepPlan, previous: WorkerStep | None = None) -> WorkerStep | None:
        """Apply `plan` and queue its step on the device (nothing waits); None when the plan
        schedules nothing (it only dropped rows). `previous` is the step still in flight, whose
        sampled tokens this step's pending inputs read on the device."""
        if self.kv_worker is not None:
            # Cancellations, then new loads, then completed loads written into the cache: all
            # before this step's forward, so a cancelled load never writes and a written one is
            # in stream order with the steps.
            self.kv_worker.apply(plan.kv_connector_metadata)
            self._kv_report.merge(self.kv_worker.poll())
        elif plan.kv_connector_metadata:
            raise ValueError("the plan carries KV loads but this worker has no KV connector")
        batch = self.rows.apply(plan)
        if not batch:
            return None
        # State checkpoints: restores land in the requests' slots before the forward reads them;
        # saves copy the slots the forward wrote (same stream, so in this order on the device).
        if plan.state_copies_before:
            self.runner.copy_state_slots(plan.state_copies_before)
        spans = take_prompt_logprob_spans(batch) if self.rows.num_prompt_logprob_rows else None
        prompt_logprobs = None
        if spans:  # the forward also keeps the hidden states the prompt logprobs come from
            host = host_inputs_from_rows(batch, self.runner.block_size)
            logits, hidden = self.runner.forward_eager(host, previous.token_ids if previous is not None else None,
                                                       hidden_rows(spans, self.runner.device))
            prompt_logprobs = compute_prompt_logprobs(hidden, spans, self.runner.model.compute_logits,
                                                      self.runner.vocab_size)
        else:
            logits = self.execute(batch, previous)
        if plan.state_copies_after:
            self.runner.copy_state_slots(plan.state_copies_after)
        sampling = batch.sampling_rows
        sample = None
        if sampling:
            if plan.grammar_bitmask is None:
                sample = self.sampler.sample_async(logits, sampling)
            else:  # structured output: the constrained rows' token masks, applied on the device
                sample = self.sampler.sample_async(logits, sampling, bitmask=plan.grammar_bitmask)
            for i, row in enumerate(sampling):
                row.mark_pending(i)
        return WorkerStep(batch, sampling, sample, prompt_logprobs)

    def collect(self, step: WorkerStep) -> SamplerOutput | None:
        """Wait for `step`'s sampled tokens and append them to the rows still held."""
        if step.sample is None:
            return None
        result = step.sample.result()
        # A row dropped meanwhile is no longer in `rows`: appending to it changes nothing.
        for row, token_id in zip(step.sampling, result.token_ids):
            row.confirm_token(token_id)
        return result

    @staticmethod
    def collect_prompt_logprobs(step: WorkerStep) -> dict[str, list[TokenLogprobs]]:
        """`step`'s prompt logprobs per request id, positions in order (empty: none asked)."""
        return step.prompt_logprobs.result() if step.prompt_logprobs is not None else {}
