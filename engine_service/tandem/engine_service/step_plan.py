"""The step plan: what the scheduler side tells the workers each step (typed, torch-free).

A worker keeps one persistent row per request (`worker_rows.py`) and is told only what changed:

- `NewRequest`: a request the worker does not know yet, whole — its known token ids, sampling
  parameters, block ids per cache group, optional state slot, and this step's share.
- `CachedRequests`: the requests the worker already holds (as columns) — only the block ids
  added since the last plan (per group), how many leading table entries a sliding window has
  given back since (per group), the computed-token count, this step's share, and whether the
  request resumes after a preemption (then its block ids and state slot replace the row's).
- `finished_req_ids` (finished or aborted: drop the row) and `preempted_req_ids` (drop the
  row's blocks, keep its tokens and its random generator: it comes back as a resumed request).

Decode tokens never travel in a plan: the worker samples them and appends them to its own rows.

Structured output: `grammar_bitmask` (None when no sampled request of the step is constrained)
gives the allowed next tokens of the constrained sampled entries, which the sampler applies on
the device. The scheduler side fills it from its matchers after the previous step's tokens were
read back (a constrained request never samples past a pending token).

State checkpoints (models with state groups and prefix caching): `state_copies_before` lists
(src, dst) state-slot copies the worker runs over every state tensor before the step's forward
(a prefix hit restores a checkpoint slot into the request's slot), `state_copies_after` those it
runs after the forward (a chunk that ended on a checkpoint position saves the request's slot
into a checkpoint slot). Within each list the destinations are distinct.

The plan crosses a process boundary (tensor-parallel ranks receive it by broadcast) as msgpack:
`encode_plan` / `decode_plan`; in one process the objects are handed over as they are. A step's
batch order is `cached_requests` then `new_requests`; sampled tokens come back in that order,
restricted to the entries with `sample`.

Invariants: a request id appears at most once among `new_requests` and `cached_requests`; the
columns of `cached_requests` have equal lengths; ids in
`finished_req_ids` are dropped before the step's requests are applied, so an id may finish and be
new in the same plan (a reused id); block ids are listed per paged cache group
(`num_cache_groups` of them, every group's table of a request has the same length).

Tables do not only grow: in a sliding-window group the block manager gives back blocks behind the
window and leaves `NULL_BLOCK` in their entries (always a prefix of the table). A worker never
keeps such a stale id: a given-back block may be handed to another request at once, so the plan
marks those entries (`CachedRequests.num_null_blocks`) and the worker's table equals the
scheduler's after every plan — the same arrays as the Sequence-reading path, with no reliance on
every kernel path skipping positions before the window.
"""

from __future__ import annotations

import msgspec

from tandem.core_protocol import SamplingParams
from tandem.engine_service.kv_connector.metadata import KVConnectorMetadata


class NewRequest(msgspec.Struct, kw_only=True):
    """A request the worker sees for the first time: everything its row needs.

    `token_ids` are the prompt followed by any output tokens already known (a request is new
    to a worker only once, so in practice the prompt). `block_ids[g]` is the request's block
    table in cache group g, covering at least `num_computed_tokens + num_scheduled_tokens`.
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    block_ids: list[list[int]]
    num_computed_tokens: int
    num_scheduled_tokens: int
    sample: bool
    state_slot: int | None = None


class CachedRequests(msgspec.Struct, kw_only=True, array_like=True, gc=False):
    """This step's deltas of the requests the worker already holds, as columns: entry i of
    every list belongs to `request_ids[i]`.

    `new_block_ids[i]` is None when request i got no new block, else its added block ids per
    cache group — appended to the row's tables, or, when `resumed[i]` (back from a preemption),
    the whole new tables. `num_null_blocks[i]` is None when no entry of request i's tables was
    given back since the last plan, else per cache group the length of the table's leading run
    of `NULL_BLOCK` entries (sliding-window groups free from the front; the worker overwrites
    those entries, applied after `new_block_ids`). `state_slots[i]` is the slot a resumed request holds now (a slot is
    given back at preemption and taken again at resume; None otherwise, and for requests
    without per-request state). `num_computed_tokens[i]` is authoritative (prefix hits after a resume
    may change it). Columns rather than one object per request: a decode step of 256 requests
    then allocates a few lists instead of hundreds of objects, and the garbage collector's
    passes over them showed up as ~1 ms of host time per step.
    """

    request_ids: list[str] = msgspec.field(default_factory=list)
    new_block_ids: list[list[list[int]] | None] = msgspec.field(default_factory=list)
    num_computed_tokens: list[int] = msgspec.field(default_factory=list)
    num_scheduled_tokens: list[int] = msgspec.field(default_factory=list)
    sample: list[bool] = msgspec.field(default_factory=list)
    resumed: list[bool] = msgspec.field(default_factory=list)
    state_slots: list[int | None] = msgspec.field(default_factory=list)
    num_null_blocks: list[list[int] | None] = msgspec.field(default_factory=list)

    def __len__(self) -> int:
        return len(self.request_ids)

    def append(self, request_id: str, new_block_ids: list[list[int]] | None, num_computed_tokens: int,
               num_scheduled_tokens: int, sample: bool, resumed: bool = False, state_slot: int | None = None,
               num_null_blocks: list[int] | None = None) -> None:
        """Add one request's delta (tests and tools; the plan builder fills the columns itself)."""
        self.request_ids.append(request_id)
        self.new_block_ids.append(new_block_ids)
        self.num_computed_tokens.append(num_computed_tokens)
        self.num_scheduled_tokens.append(num_scheduled_tokens)
        self.sample.append(sample)
        self.resumed.append(resumed)
        self.state_slots.append(state_slot)
        self.num_null_blocks.append(num_null_blocks)


class TokenBitmask(msgspec.Struct, kw_only=True, array_like=True):
    """Allowed next tokens of some sampled entries: `rows[i]` (an index in the step's sampled-row
    order) may sample token t iff bit t % 32 of int32 word t // 32 of its mask is set. `words` is
    `len(rows)` × `num_words` little-endian int32, row after row."""

    rows: list[int]
    num_words: int
    words: bytes


class StepPlan(msgspec.Struct, kw_only=True):
    """One step's instructions to every worker (see the module docstring for the invariants)."""

    step_id: int
    new_requests: list[NewRequest] = msgspec.field(default_factory=list)
    cached_requests: CachedRequests = msgspec.field(default_factory=CachedRequests)
    finished_req_ids: list[str] = msgspec.field(default_factory=list)
    preempted_req_ids: list[str] = msgspec.field(default_factory=list)
    num_cache_groups: int = 1
    kv_connector_metadata: KVConnectorMetadata | None = None
    state_copies_before: list[tuple[int, int]] = msgspec.field(default_factory=list)
    state_copies_after: list[tuple[int, int]] = msgspec.field(default_factory=list)
    grammar_bitmask: TokenBitmask | None = None

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(self.cached_requests.num_scheduled_tokens) + sum(r.num_scheduled_tokens for r in self.new_requests)

    @property
    def has_work(self) -> bool:
        """Whether the step runs the model (otherwise it only carries drops)."""
        return bool(self.new_requests or self.cached_requests)

    def batch_request_ids(self) -> list[str]:
        """Request ids in batch order: cached requests, then new ones."""
        return self.cached_requests.request_ids + [r.request_id for r in self.new_requests]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(StepPlan)


def encode_plan(plan: StepPlan) -> bytes:
    """The plan as msgpack bytes (what a broadcast to other ranks sends)."""
    return _ENCODER.encode(plan)


def decode_plan(data: bytes) -> StepPlan:
    """A `StepPlan` from `encode_plan`'s bytes; types are checked while decoding."""
    return _DECODER.decode(data)
