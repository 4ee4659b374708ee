"""The engine core: applies typed core messages to an `LLMEngine` and turns steps into messages.

`EngineCore` is the loop body both core clients run: the in-process client on a thread, the
engine-core process (core_process.py) in its main thread. It never waits on a consumer: it takes
the messages it was given, runs one step and returns one `CoreOutputs` with every request's
delta, which the caller hands on (a queue or a socket) without waiting for anyone to read it.
"""

from __future__ import annotations

import time

import structlog

from tandem.core_protocol import (
    CoreAbort,
    CoreInfo,
    CoreInput,
    CoreOutputs,
    CoreRequest,
    FinishReason,
    FlushResult,
    RequestOutput,
    UtilityCall,
    UtilityCommand,
    UtilityResult,
)
from tandem.engine_service.core.engine import LLMEngine

log = structlog.get_logger(__name__)


class InjectedFault(RuntimeError):
    """The fault-injection hook fired (testing only)."""


def core_info(engine: LLMEngine) -> CoreInfo:
    """What the gRPC side needs to know about the loaded model."""
    runner = engine.runner
    bm = engine.block_manager
    return CoreInfo(
        model=engine.config.model.model,
        model_path=str(runner.model_path) if runner.model_path else None,
        architecture=getattr(runner, "architecture", ""),
        max_model_len=engine.max_model_len,
        vocab_size=runner.vocab_size,
        eos_token_ids=list(engine.eos_token_ids),
        dtype=str(getattr(runner, "dtype", "")),
        device=str(getattr(runner, "device", "")),
        kv_blocks=bm.num_blocks,
        block_size=bm.block_size,
        kv_capacity_tokens=engine.kv_capacity_tokens,
        enable_prefix_caching=bm.enable_prefix_caching,
        kv_transfer=engine.kv.info() if engine.kv is not None else None,
        tokenizer_path=engine.tokenizer_path(),
    )


class EngineCore:
    """One engine replica's loop body over typed messages.

    Invariants: only the thread that calls `apply`/`step` touches the engine; every CoreRequest
    taken yields outputs ending in exactly one finished output (a failed admission ends at once
    with ERROR); every UtilityCall yields exactly one UtilityResult.
    """

    def __init__(self, engine: LLMEngine, fail_after_steps: int | None = None) -> None:
        self.engine = engine
        # Fault injection for the failure tests: raise inside the loop after this many steps.
        self.fail_after_steps = fail_after_steps
        self._outputs: list[RequestOutput] = []
        self._added_requests = 0
        self._added_tokens = 0
        # The live lease count the latest CoreOutputs' stats reported: a sweep that changes it
        # (a lease expired or was released while idle) is published at once, so gauges read
        # from the stats snapshot never show ended leases as active.
        self._published_leases = 0

    def has_work(self) -> bool:
        return self.engine.has_work() or self._leases_changed()

    def _live_leases(self) -> int:
        kv = self.engine.kv
        return len(kv.scheduler.leases) if kv is not None else 0

    def _leases_changed(self) -> bool:
        return self._live_leases() != self._published_leases

    # How often an idle core with live leases looks at them (a released lease's blocks return
    # within this; an idle core without leases sleeps until a message comes).
    LEASE_POLL_S = 0.05

    def idle_timeout(self, default: float) -> float:
        """How long an idle loop may block waiting for input before calling `tick`."""
        kv = self.engine.kv
        return min(default, self.LEASE_POLL_S) if kv is not None and len(kv.scheduler.leases) else default

    def tick(self) -> None:
        """Idle housekeeping: free released or expired leases (the next `step` publishes the
        stats when that changed the live count: `has_work` says so)."""
        self.engine.kv_housekeeping()

    def apply(self, msg: CoreInput) -> UtilityResult | None:
        """Applies one message; a UtilityCall's result is returned, other outputs are kept for
        the next `step`."""
        if isinstance(msg, CoreRequest):
            self._add(msg)
        elif isinstance(msg, CoreAbort):
            for request_id in msg.request_ids:
                self._abort(request_id)
        elif isinstance(msg, UtilityCall):
            return self._utility(msg)
        return None

    def step(self) -> CoreOutputs | None:
        """Runs one step if there is work; returns everything produced since the last call
        (None when there is nothing to report)."""
        outputs, self._outputs = self._outputs, []
        step_time, stepped = 0.0, False
        if self.engine.has_work():
            if self.fail_after_steps is not None and self.engine.counters.steps >= self.fail_after_steps:
                raise InjectedFault(f"injected fault after {self.fail_after_steps} steps")
            t0 = time.perf_counter()
            steps_before = self.engine.counters.steps
            produced = self.engine.step()
            outputs.extend(produced)
            # A call that only told the worker of endings (a plan of drops) ran no step.
            stepped = bool(produced) or self.engine.counters.steps > steps_before
            step_time = time.perf_counter() - t0 if stepped else 0.0
        if not outputs and not self._added_requests and not stepped and not self._leases_changed():
            return None
        self._published_leases = self._live_leases()
        batch = CoreOutputs(
            outputs=outputs,
            stats=self.engine.stats(),
            step_time=step_time,
            stepped=stepped,
            added_requests=self._added_requests,
            added_tokens=self._added_tokens,
            timestamp=time.monotonic(),
        )
        self._added_requests = self._added_tokens = 0
        return batch

    # -- messages ----------------------------------------------------------------------------------
    def _add(self, msg: CoreRequest) -> None:
        self._added_requests += 1
        self._added_tokens += len(msg.prompt_token_ids)
        try:
            self.engine.add_request(msg.request_id, msg.prompt_token_ids, msg.sampling,
                                    arrival_time=msg.arrival_time, kv_transfer_params=msg.kv_transfer_params,
                                    deadline=msg.deadline, caller=msg.caller)
        except Exception as exc:  # invalid after all: report instead of dying
            log.warning("add_request_failed", request_id=msg.request_id, error=str(exc))
            self._outputs.append(RequestOutput(request_id=msg.request_id, finished=True,
                                               finish_reason=FinishReason.ERROR, error=str(exc)))

    def _abort(self, request_id: str) -> None:
        # Read before the abort forgets it: the request's spans and queue time need it too.
        first_scheduled = self.engine.first_scheduled_time(request_id)
        seq = self.engine.abort(request_id)
        self._outputs.append(
            RequestOutput(
                request_id=request_id,
                finished=True,
                finish_reason=FinishReason.ABORT,
                num_prompt_tokens=seq.num_prompt_tokens if seq else 0,
                num_output_tokens=seq.num_output_tokens if seq else 0,
                num_cached_prompt_tokens=(seq.num_cached_prompt_tokens or 0) if seq else 0,
                arrival_time=seq.arrival_time if seq else 0.0,
                first_scheduled_time=first_scheduled,
                first_token_time=seq.first_token_time if seq else None,
                kv_transfer_params=seq.kv_transfer_params if seq else None,
            )
        )

    def _utility(self, call: UtilityCall) -> UtilityResult:
        try:
            if call.command == UtilityCommand.STATS:
                self.engine.kv_housekeeping()  # released leases count as free in the answer
                return UtilityResult(call.call_id, self.engine.stats())
            if call.command == UtilityCommand.FLUSH_PREFIX_CACHE:
                return UtilityResult(call.call_id, FlushResult(bool(self.engine.block_manager.reset_prefix_cache())))
            return UtilityResult(call.call_id, error=f"unknown utility command {call.command!r}")
        except Exception as exc:
            return UtilityResult(call.call_id, error=str(exc))
