"""The one interface every cache kind's manager implements, so `BlockManager` only coordinates.

A group manager keeps one cache kind's books for every request: a paged group's block ids
(`paged_manager.py`: full attention, sliding window, latent) or the per-request state slots and
their checkpoints (`state_slot_manager.py`). Managers never see each other; the coordinator
(`block_manager.py`) walks its list of managers (paged ones first, in the layout's order) and
calls the same method on each. A new cache kind is a new module with a new subclass.

What the coordinator calls, and when:

- lookup (no side effects): `hit_scan(state_loaded)` once, then per leading full block i of the
  sequence `scan.feed(i, hash)` (False: no hit of i + 1 blocks or more can hold in this group)
  and `scan.valid(i + 1, hash)`. A hit of k blocks needs `valid(k)` in every group; a hit the
  paged groups alone allow is the K/V hit (`Hit.kv_blocks`).
- allocate: an admitted request first gets `trim(seq)` (blocks no later query reads go back);
  then, unless the tables already cover the tokens, `fits(seq, n, hit)` in every group decides
  (no side effects, so a failure changes nothing); an admission then runs `take_hit(seq, hit,
  restore)` in every group before `grow(seq, n, state_loaded)` in every group.
- after a step: `commit(seq, computed)`; when blocks got hashed, `cache_blocks(seq, first, end)`.
- `free(seq)` on every way out; `reset_prefix_cache()`, `reset_counters()`, `usage()`.
- scheduling: `cut_chunk(seq, start, n)` may shorten a prefill chunk (each group in turn).
- `eviction_listener()`: a callback paged pools call with every hash an eviction removes, for
  a kind whose entries belong to cached blocks (state checkpoints); None when not needed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

if TYPE_CHECKING:
    from tandem.engine_service.sequence import Sequence

# A table entry whose block was given back (sliding-window groups only). Input building maps it
# to block 0; kernels and the reference never read positions before the window.
NULL_BLOCK = -1


@dataclass(frozen=True)
class Hit:
    """A prefix-cache hit at admission: `blocks` leading full blocks (hashes `hashes`) usable in
    every group, and `kv_blocks` the paged groups alone would allow (>= `blocks`)."""

    blocks: int
    hashes: list[int] = field(default_factory=list)
    kv_blocks: int = 0


NO_HIT = Hit(0, [], 0)


class HitScan(Protocol):
    """One group's view of one prefix lookup, fed the sequence's full blocks in order."""

    def feed(self, index: int, block_hash: int) -> bool:
        """Block `index` has hash `block_hash`; False when no longer hit can hold in this group."""
        ...

    def valid(self, num_blocks: int, block_hash: int) -> bool:
        """Whether a hit of the first `num_blocks` blocks fed (the last of hash `block_hash`)
        can be resumed as far as this group is concerned."""
        ...


class GroupManager(ABC):
    """One cache kind's per-request books; see the module docstring for the calling protocol.

    `paged`: the kind holds a block table per request (`seq.block_tables[index]`); the paged
    groups' lookups make the K/V hit, the others may only shorten it.
    """

    kind: ClassVar[str]
    paged: ClassVar[bool]

    @abstractmethod
    def hit_scan(self, state_loaded: bool) -> HitScan:
        """A fresh scan for one prefix lookup. `state_loaded`: the request's state comes from
        elsewhere (a disaggregated decode leg), so no local state is needed at the hit."""

    @abstractmethod
    def fits(self, seq: Sequence, num_new_tokens: int, hit: Hit | None) -> bool:
        """Whether this group can cover `num_new_tokens` more tokens of `seq` (after taking `hit`
        when admitting; `hit` is None for an admitted request). No side effects."""

    @abstractmethod
    def take_hit(self, seq: Sequence, hit: Hit, restore: bool) -> None:
        """Admission: take the hit's entries (and whatever a request holds from its start).
        `restore`: the request's state is rebuilt locally from the hit (not loaded)."""

    @abstractmethod
    def grow(self, seq: Sequence, num_new_tokens: int, state_loaded: bool) -> None:
        """Cover `seq.num_computed_tokens + num_new_tokens` tokens (`fits` said it can)."""

    @abstractmethod
    def free(self, seq: Sequence) -> None:
        """Give back everything `seq` holds in this group (finish, abort, error, preemption)."""

    @abstractmethod
    def usage(self) -> dict[str, dict[str, int]]:
        """Capacity report entries: name -> {"total", "used", ...}."""

    def trim(self, seq: Sequence) -> None:
        """An admitted request moves on: release what no later query of it reads."""

    def commit(self, seq: Sequence, computed: int) -> None:
        """The model wrote the cache of `seq` up to token `computed` (ids known)."""

    def cache_blocks(self, seq: Sequence, first: int, end: int) -> None:
        """Blocks `first .. end - 1` of `seq` were hashed (`seq.block_hashes`): cache them."""

    def cut_chunk(self, seq: Sequence, start: int, num_new_tokens: int) -> int:
        """`num_new_tokens` of a chunk from `start`, possibly shortened for this group."""
        return num_new_tokens

    def reset_prefix_cache(self) -> None:
        """Forget every cached entry; nothing computed before may be hit afterwards."""

    def reset_counters(self) -> None:
        """Zero this group's totals (what a warm-up leaves in them)."""

    def eviction_listener(self) -> Callable[[int], None] | None:
        """Called with each hash a paged pool evicts; None: this kind does not care."""
        return None
