"""The connector's scheduler side (engine-core thread, torch-free): loads, leases, parameters.

Consumer (a request with `do_remote_prefill`): `admit_load` decides how many tokens come from the
producer — its own prefix cache covers the first h full blocks, the producer's blocks h..n-1
cover prompt tokens [h * block_size, num_prompt_tokens) — allocates the blocks for them through
the block manager (prefix hits taken as usual), and queues a `LoadSpec` for the next plan's
`kv_connector_metadata`. The scheduler keeps the request out of the batch until
`loads_done` reports it; then its computed count jumps to `num_prompt_tokens`. The rest (at
least the first token's position) is computed locally, so the logits come from this engine.

Hybrid models (state groups): the recurrent/convolution state after the prompt cannot be
recomputed from K/V, so the load also carries the producer's state slot (`remote_state_slot`)
into the request's own, freshly taken slot. That state covers all `num_prompt_tokens` tokens, so
the local hit needs K/V blocks only and no local state checkpoint is restored over it
(`BlockManager.allocate(state_loaded=True)`); the first local chunk starts at `num_prompt_tokens`
and continues the pulled state (`has_initial_state`). Parameters without a state slot are refused.

Producer (a request with `do_remote_decode` that finished by length): `on_request_finished`
moves the request's blocks (and state slot) into a lease instead of letting them be freed, and
returns the parameters the decode leg needs. A hybrid model's slot is offered only while it holds
the state after exactly `num_prompt_tokens` tokens: the leg computed the prompt and sampled its
one token without feeding it (a leg that fed more tokens gets no lease; the decode leg then
computes the prompt itself). `sweep` frees the leases that were released (pull done, abort
of the prefill id) or expired — the only place leased blocks go back to the pool.

Trust and binding (`auth.py`): a load is refused (`LoadRefused`, INVALID_ARGUMENT) before any
connection when its producer address is not one this engine trusts (`KVTransferConfig.producers`,
or its own pull address), when a group names a block twice, or when a field does not fit this
engine; a refused load whose producer is trusted releases the lease (with its secret), so a
refusal never leaves it to expire. The load presents the lease's secret and the digest of this
engine's own prompt, so the producer serves a lease only to the prompt it was made for. The
lease a producer grants records its prompt's digest and returns its secret in the parameters
(`lease_secret`), which travel only on the trusted path.

Invariants: a request id is in `_loading` from `admit_load` until `loads_done` or `cancel_load`;
its LoadSpec is sent in exactly one plan, and a cancellation of a load the worker may hold is
sent in one plan too (a load cancelled before its plan was sent becomes a lease release, so the
producer never waits for expiry); leased blocks are owned by exactly one lease and freed exactly
once.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import structlog

from tandem.core_protocol import FinishReason, KVTransferParams, SchedulerReason, SchedulerStop
from tandem.engine_service.config import KVTransferConfig
from tandem.engine_service.cache.block_manager import NULL_BLOCK, BlockManager, first_needed_block
from tandem.engine_service.kv_connector.auth import prompt_digest
from tandem.engine_service.kv_connector.leases import LeasedBlocks, LeaseTable
from tandem.engine_service.kv_connector.metadata import KVConnectorMetadata, KVLoadReport, LoadSpec
from tandem.engine_service.sequence import Sequence

log = structlog.get_logger(__name__)


class LoadRefused(ValueError):
    """The request's transfer parameters cannot be served by this engine (the request fails)."""


@dataclass
class KVTransferCounters:
    """Monotonic counters of the connector (engine stats)."""

    remote_loads: int = 0  # loads finished
    remote_load_failures: int = 0
    remote_tokens_loaded: int = 0  # prompt tokens whose KV came from a producer
    remote_blocks_pulled: int = 0  # blocks pulled over every group
    remote_bytes_pulled: int = 0
    remote_load_seconds: float = 0.0  # summed load times (plan to written), for GB/s
    leases_granted: int = 0


class KVConnectorScheduler:
    """Decides loads and keeps leases for one engine (see the module docstring)."""

    def __init__(self, config: KVTransferConfig, block_manager: BlockManager, engine_id: str,
                 pull_address: tuple[str, int] | None, leases: LeaseTable | None = None,
                 local_transports: tuple[str, ...] = ("tcp",)) -> None:
        self.config = config
        self.bm = block_manager
        self.engine_id = engine_id
        self.pull_address = pull_address
        self.leases = leases if leases is not None else LeaseTable()
        self.local_transports = local_transports
        self.counters = KVTransferCounters()
        self._loading: dict[str, LoadSpec] = {}
        self._start: list[LoadSpec] = []
        self._cancel: list[str] = []
        self._release: list[tuple[str, int, str]] = []
        # Prefill legs admitted to make a lease (request id -> caller), until they end: they
        # count against the lease caps so a burst cannot overshoot them.
        self._lease_legs: dict[str, str | None] = {}

    # -- consumer ----------------------------------------------------------------------------------
    def needs_load(self, seq: Sequence) -> bool:
        p = seq.kv_transfer_params
        return (self.config.is_consumer and p is not None and p.do_remote_prefill
                and not seq.remote_kv_done)

    def admit_load(self, seq: Sequence) -> bool:
        """Allocate `seq`'s blocks and queue its load; False when the pool is too full now.
        Raises LoadRefused when the parameters cannot be served (nothing allocated then)."""
        p = seq.kv_transfer_params
        assert p is not None
        bs = self.bm.block_size
        try:
            num_tokens, groups, transport = self._check(seq, p)
        except LoadRefused:
            self._release_refused(p)
            raise
        # Hybrid models: the pulled state covers every prompt token (see the module docstring).
        state_loaded = self.bm.state_slots is not None
        hit_tokens = self.bm.match_prefix(seq, state_loaded=state_loaded)
        num_new = max(0, num_tokens - hit_tokens)
        if not self.bm.allocate(seq, num_new, state_loaded=state_loaded):
            return False
        assert not state_loaded or seq.state_slot is not None
        h = seq.num_computed_tokens // bs
        n = -(-num_tokens // bs)
        remote: list[list[int]] = []
        local: list[list[int]] = []
        for g, pool in enumerate(self.bm.pools):
            # A windowed group never reads blocks behind the window of the first local query.
            cut = first_needed_block(num_tokens, pool.window, bs)
            if cut:
                self.bm.give_back_before(seq, g, cut)
            ids = [i for i in range(max(h, cut), n)]
            r = [groups[g][i] for i in ids]
            if NULL_BLOCK in r:
                self.bm.free(seq)
                seq.num_computed_tokens = 0
                self._release_refused(p)
                raise LoadRefused(f"the producer's group {g} no longer holds blocks the window needs")
            remote.append(r)
            local.append([seq.block_tables[g][i] for i in ids])
        spec = LoadSpec(request_id=seq.request_id, remote_engine_id=p.remote_engine_id or "",
                        remote_host=p.remote_host or "", remote_port=int(p.remote_port or 0),
                        lease_id=p.lease_id or "", transport=transport,
                        remote_block_ids=remote, local_block_ids=local, num_tokens=num_tokens,
                        remote_state_slot=p.remote_state_slot if state_loaded else None,
                        local_state_slot=seq.state_slot if state_loaded else None,
                        lease_secret=p.lease_secret or "",
                        prompt_digest=prompt_digest(seq.prompt_token_ids[:num_tokens]))
        self._loading[seq.request_id] = spec
        self._start.append(spec)
        log.info("kv_load_queued", request_id=seq.request_id, hit_tokens=seq.num_computed_tokens,
                 load_tokens=num_tokens - seq.num_computed_tokens, blocks=spec.num_blocks, transport=transport)
        return True

    def _trusted(self, p: KVTransferParams) -> bool:
        return (p.remote_host is not None and p.remote_port is not None
                and self.config.trusts_producer(p.remote_host, int(p.remote_port), self.pull_address))

    def _release_refused(self, p: KVTransferParams) -> None:
        """A refused load's lease goes back now (only to a trusted producer, with its secret)."""
        if self._trusted(p) and p.lease_id and p.lease_secret:
            self._release.append((p.remote_host, int(p.remote_port), p.lease_id, p.lease_secret))  # type: ignore[arg-type]

    def _check(self, seq: Sequence, p: KVTransferParams) -> tuple[int, list[list[int]], str]:
        missing = [k for k in ("remote_host", "remote_port", "lease_id", "num_prompt_tokens")
                   if getattr(p, k) is None]
        if missing:
            raise LoadRefused(f"kv_transfer_params lacks {', '.join(missing)}")
        if not self._trusted(p):
            raise LoadRefused("kv_transfer_params name a producer this engine does not trust (its pull addresses "
                              "come from --kv-producer)")
        if p.block_size is not None and p.block_size != self.bm.block_size:
            raise LoadRefused(f"the producer's block size {p.block_size} differs from this engine's "
                              f"{self.bm.block_size}")
        num_tokens = int(p.num_prompt_tokens)  # type: ignore[arg-type]
        if not 0 < num_tokens < seq.num_tokens:
            raise LoadRefused(f"num_prompt_tokens={num_tokens} must be in [1, {seq.num_tokens - 1}] (the decode "
                              "leg's prompt is the prefill's prompt and its first token)")
        groups = p.remote_group_block_ids or ([p.remote_block_ids] if p.remote_block_ids is not None else None)
        if groups is None:
            raise LoadRefused("kv_transfer_params lacks remote_block_ids")
        if len(groups) != self.bm.num_groups:
            raise LoadRefused(f"the producer has {len(groups)} cache groups, this engine {self.bm.num_groups}")
        n = -(-num_tokens // self.bm.block_size)
        if any(len(g) < n for g in groups):
            raise LoadRefused(f"{num_tokens} tokens need {n} blocks per group, the parameters name fewer")
        for g, ids in enumerate(groups):
            named = [b for b in ids[:n] if b != NULL_BLOCK]
            if len(set(named)) != len(named):
                raise LoadRefused(f"the parameters name a block of group {g} twice")
        if self.bm.state_slots is not None:
            if p.remote_state_slot is None:
                raise LoadRefused("this model has state groups (a hybrid model): the decode leg needs the "
                                  "producer's state slot, and kv_transfer_params lacks remote_state_slot")
            if p.remote_state_slot < 0:
                raise LoadRefused(f"remote_state_slot={p.remote_state_slot} is not a slot")
        transport = p.remote_transport or "tcp"
        if transport not in self.local_transports:
            transport = "tcp"  # every producer serves TCP
        if transport == "nixl" and self.bm.state_slots is not None:
            transport = "tcp"  # NIXL moves blocks only; TCP carries the state too
        return num_tokens, groups, transport

    def loads_done(self, report: KVLoadReport) -> tuple[list[LoadSpec], dict[str, SchedulerStop]]:
        """Apply the worker's report; (finished loads, failed ids with how they end) of loads
        still wanted (`_failure_reason`)."""
        finished = [spec for rid in report.finished if (spec := self._loading.pop(rid, None)) is not None]
        failed = {rid: SchedulerStop(_failure_reason(report, rid), why)
                  for rid, why in report.failed.items() if self._loading.pop(rid, None) is not None}
        self.counters.remote_loads += len(finished)
        self.counters.remote_load_failures += len(failed)
        self.counters.remote_blocks_pulled += report.blocks_loaded
        self.counters.remote_bytes_pulled += report.bytes_loaded
        self.counters.remote_load_seconds += report.seconds
        return finished, failed

    def load_finished(self, seq: Sequence, spec_tokens: int) -> None:
        self.counters.remote_tokens_loaded += spec_tokens - seq.num_computed_tokens
        seq.num_computed_tokens = spec_tokens
        seq.remote_kv_done = True

    def loading_spec(self, request_id: str) -> LoadSpec | None:
        return self._loading.get(request_id)

    def cancel_load(self, request_id: str) -> None:
        """The request was aborted while loading: the worker drops the load unwritten."""
        spec = self._loading.pop(request_id, None)
        if spec is None:
            return
        if spec in self._start:
            # Never sent: the worker never heard of it, but the producer still holds the lease.
            self._start.remove(spec)
            self._release.append((spec.remote_host, spec.remote_port, spec.lease_id, spec.lease_secret))
        else:
            self._cancel.append(request_id)

    @property
    def num_loading(self) -> int:
        return len(self._loading)

    def has_pending_metadata(self) -> bool:
        return bool(self._start or self._cancel or self._release)

    def take_metadata(self) -> KVConnectorMetadata | None:
        if not self.has_pending_metadata():
            return None
        meta = KVConnectorMetadata(start_loads=self._start, cancel_loads=self._cancel, release_leases=self._release)
        self._start, self._cancel, self._release = [], [], []
        return meta

    # -- producer ----------------------------------------------------------------------------------
    def reserve_lease(self, seq: Sequence, caller: str | None) -> SchedulerStop | None:
        """Admission of a prefill leg that will make a lease (`do_remote_decode` on a producer):
        None when it fits the caps (`max_leases` in all, `max_leases_per_caller` for `caller`),
        counting live leases and admitted legs; else why it is refused (kv_leases_exhausted).
        Other requests always fit."""
        p = seq.kv_transfer_params
        if not self.config.is_producer or p is None or not p.do_remote_decode:
            return None
        total = len(self.leases) + len(self._lease_legs)
        if total >= self.config.max_leases:
            return SchedulerStop(SchedulerReason.KV_LEASES_EXHAUSTED,
                                 f"this producer holds its most leases ({self.config.max_leases}); retry later")
        mine = self.leases.count_for(caller) + sum(1 for c in self._lease_legs.values() if c == caller)
        if mine >= self.config.max_leases_per_caller:
            return SchedulerStop(SchedulerReason.KV_LEASES_EXHAUSTED,
                                 f"this caller holds its most leases ({self.config.max_leases_per_caller}); "
                                 "release or use them, or retry later")
        self._lease_legs[seq.request_id] = caller
        return None

    def on_request_finished(self, seq: Sequence) -> None:
        """A prefill leg finished: keep its blocks under a lease and put the decode leg's
        parameters on `seq.kv_transfer_params` (idempotent; other requests are untouched)."""
        caller = self._lease_legs.pop(seq.request_id, None)
        p = seq.kv_transfer_params
        if (not self.config.is_producer or p is None or not p.do_remote_decode or seq.kv_lease_id is not None
                or seq.finish_reason != FinishReason.LENGTH or not seq.output_token_ids):
            return
        if self.pull_address is None:
            return
        bs = self.bm.block_size
        num_tokens = seq.num_prompt_tokens
        if seq.num_computed_tokens < num_tokens or len(seq.block_tables[0]) * bs < num_tokens:
            return  # nothing complete to offer (cannot happen for a finished prefill)
        if self.bm.state_slots is not None and (seq.state_slot is None or seq.num_computed_tokens != num_tokens):
            # The slot holds the state after every token fed so far: only a leg that fed exactly
            # the prompt (its one sampled token never went through the model) can hand it over.
            log.warning("kv_lease_refused_state_advanced", request_id=seq.request_id,
                        computed=seq.num_computed_tokens, num_prompt_tokens=num_tokens)
            return
        self.bm.commit(seq)  # the last chunk's full blocks join the prefix cache now
        blocks = LeasedBlocks(seq.request_id, seq.block_tables, seq.block_hashes, seq.state_slot)
        seq.block_tables = [[] for _ in self.bm.pools]
        seq.block_hashes = []
        seq.state_slot = None
        lease = self.leases.grant(seq.request_id, blocks, self.config.lease_seconds,
                                  prompt_digest=prompt_digest(seq.prompt_token_ids[:num_tokens]), caller=caller)
        self.counters.leases_granted += 1
        seq.kv_lease_id = lease.lease_id
        n = -(-num_tokens // bs)
        groups = [list(t[:n]) for t in blocks.block_tables]
        host, port = self.pull_address
        seq.kv_transfer_params = KVTransferParams(
            do_remote_prefill=True, remote_engine_id=self.engine_id, remote_host=host, remote_port=port,
            remote_block_ids=groups[0], remote_group_block_ids=groups, remote_state_slot=blocks.state_slot,
            num_prompt_tokens=num_tokens, first_token_id=seq.output_token_ids[0], lease_id=lease.lease_id,
            lease_secret=lease.secret,
            lease_expiry_unix=lease.expiry_unix, remote_transport=self.config.transport, block_size=bs,
            extra=dict(p.extra))

    def leases_hold_resources(self) -> bool:
        """Whether live leases hold blocks or state slots (they return to the pool at `sweep`
        once a lease is pulled, released or expired): admission counts them as held."""
        return len(self.leases) > 0

    def release_request(self, request_id: str) -> bool:
        """The prefill request id was aborted: its lease (if any) goes at the next sweep."""
        self._lease_legs.pop(request_id, None)
        return self.leases.release_request_id(request_id)

    def sweep(self) -> int:
        """Free the blocks of every released or expired lease; how many leases went."""
        gone = self.leases.take_releasable()
        for lease in gone:
            self.bm.free(lease.blocks)  # type: ignore[arg-type]
        if gone:
            log.debug("kv_leases_freed", count=len(gone), live=len(self.leases))
        return len(gone)


def _failure_reason(report: KVLoadReport, rid: str) -> SchedulerReason:
    """How a failed load ends its request: a refused pull is KV_TRANSFER_REFUSED (the parameters
    were wrong), a load this engine could not write KV_TRANSFER_FAILED (its own fault), anything
    else (a producer unreachable, gone mid-pull, or sending corrupt bytes) KV_PRODUCER_UNAVAILABLE
    (retryable)."""
    if rid in report.refused:
        return SchedulerReason.KV_TRANSFER_REFUSED
    if rid in report.write_failed:
        return SchedulerReason.KV_TRANSFER_FAILED
    return SchedulerReason.KV_PRODUCER_UNAVAILABLE


def new_engine_id() -> str:
    return f"tandem-{uuid.uuid4().hex[:12]}"
