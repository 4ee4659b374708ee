"""What the connector's scheduler side tells its worker side, and what comes back (torch-free).

`KVConnectorMetadata` rides in a `StepPlan` (`step_plan.StepPlan.kv_connector_metadata`):
loads to start and loads to cancel. `KVLoadReport` is what the worker side answers after it
polled its loads: which requests' blocks are now written into the cache tensors, and which
failed (with why). Both are msgspec structs so they cross a process boundary as msgpack.
"""

from __future__ import annotations

import msgspec


class LoadSpec(msgspec.Struct, kw_only=True):
    """One request's pull: which producer blocks go into which local blocks, per paged group.

    Invariants: `remote_block_ids[g]` and `local_block_ids[g]` have equal lengths (entry j of one
    is written into entry j of the other) for every paged cache group g; no local id is
    `NULL_BLOCK`. `num_tokens` is the token count the loaded blocks complete (the consumer's
    computed count once the load finished). Hybrid models: `remote_state_slot` (the producer's
    slot, holding the state after exactly `num_tokens` tokens) goes into `local_state_slot` (the
    request's own slot); both are None for a model without state groups, both set otherwise.
    `lease_secret` (from the trusted path's parameters) and `prompt_digest` (of this engine's own
    prompt, `auth.prompt_digest`) are presented to the producer, which serves only a match.
    """

    request_id: str
    remote_engine_id: str
    remote_host: str
    remote_port: int
    lease_id: str
    transport: str
    remote_block_ids: list[list[int]]
    local_block_ids: list[list[int]]
    num_tokens: int
    remote_state_slot: int | None = None
    local_state_slot: int | None = None
    lease_secret: str = ""
    prompt_digest: str = ""

    @property
    def num_blocks(self) -> int:
        """Blocks pulled over every group."""
        return sum(len(g) for g in self.local_block_ids)


class KVConnectorMetadata(msgspec.Struct, kw_only=True):
    """One step's instructions to the worker side: loads to start, loads to cancel.

    Cancellations are applied before starts and before the worker writes any finished load, so a
    cancelled request's blocks (already freed by the scheduler, maybe handed to another request
    in this very plan) are never written.
    """

    start_loads: list[LoadSpec] = msgspec.field(default_factory=list)
    cancel_loads: list[str] = msgspec.field(default_factory=list)
    # Leases to release without pulling (a load cancelled before any worker started it):
    # (host, port, lease id, lease secret) of each.
    release_leases: list[tuple[str, int, str, str]] = msgspec.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.start_loads or self.cancel_loads or self.release_leases)


class KVLoadReport(msgspec.Struct, kw_only=True):
    """The worker side's answer: loads whose blocks are written, and failed loads with why."""

    finished: list[str] = msgspec.field(default_factory=list)
    failed: dict[str, str] = msgspec.field(default_factory=dict)
    # Failed ids whose producer refused what the parameters named (the caller's mistake, not a
    # broken or unreachable producer).
    refused: list[str] = msgspec.field(default_factory=list)
    # Failed ids whose bytes arrived but could not be written here (a fault of this engine).
    write_failed: list[str] = msgspec.field(default_factory=list)
    blocks_loaded: int = 0
    bytes_loaded: int = 0
    seconds: float = 0.0  # summed over finished loads: from the plan that started each to its write

    def __bool__(self) -> bool:
        return bool(self.finished or self.failed)

    def merge(self, other: "KVLoadReport") -> None:
        self.finished += other.finished
        self.failed.update(other.failed)
        self.refused += other.refused
        self.write_failed += other.write_failed
        self.blocks_loaded += other.blocks_loaded
        self.bytes_loaded += other.bytes_loaded
        self.seconds += other.seconds
