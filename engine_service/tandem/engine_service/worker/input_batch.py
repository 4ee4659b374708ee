"""Builds a step's model inputs (token ids + attention metadata) from the scheduled batch.

Two stages: the host arrays are computed on the host (numpy, from Python lists, so nothing waits
on the device) by `assemble_host_inputs` — fed by the worker's rows in the engine
(`worker_rows.host_inputs_from_rows`), or by hand-built Sequence batches in tests and tools
(`prepare_host_inputs`) — and `host_to_device` ships them. On CUDA the
arrays go through `PinnedStaging` — packed into two reusable pinned buffers, copied with
`non_blocking=True` — so building a step's inputs never stalls the host on the GPU. The CUDA-graph
runner (`cuda_graphs.py`) pads the same host arrays and copies them into its fixed buffers.

Overlapped scheduling: a sequence's newest token may still be *pending* — sampled by the step
in flight, not yet read back. Its input slot then holds a placeholder on the host, and
`pending_dst`/`pending_src` say which input row takes which row of the previous step's
sampled-token tensor; `ship_step_arrays` copies those indices with the step's arrays and
returns the gather that fills them in on the device, so the next step
is built and launched without waiting for the tokens.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np
import torch

from tandem.engine_service.worker.group_tables import group_arrays
from tandem.engine_service.layers.attention import AttentionMetadata, StateSplit
from tandem.engine_service.sequence import Sequence


class ScheduledLike(Protocol):
    """What the runner reads of the scheduler's `ScheduledSeq` (duck-typed, not imported)."""

    seq: Sequence
    num_new_tokens: int
    sample: bool


@dataclass
class ModelInputs:
    """Everything one forward pass needs."""

    input_ids: torch.Tensor  # [T] int64
    metadata: AttentionMetadata


PENDING_PLACEHOLDER = 0  # the host-side input id of a pending token (overwritten on the device)


def _token_slice(seq: Sequence, start: int, end: int) -> list[int]:
    # Slices prompt/output directly: `seq.token_ids` would copy the whole context every step.
    known = seq.num_known_tokens
    if end > known:
        head = _token_slice(seq, start, known) if start < known else []
        return head + [PENDING_PLACEHOLDER] * (end - max(start, known))
    p = seq.num_prompt_tokens
    if end <= p:
        return seq.prompt_token_ids[start:end]
    if start >= p:
        return seq.output_token_ids[start - p : end - p]
    return seq.prompt_token_ids[start:] + seq.output_token_ids[: end - p]


@dataclass
class HostInputs:
    """A step's inputs as host arrays, before any device copy (see `AttentionMetadata`)."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [B+1] int32
    seq_lens: np.ndarray  # [B] int32
    block_tables: np.ndarray  # [B, max_blocks] int32
    logits_indices: np.ndarray  # [S] int64
    seq_lens_cpu: list[int]
    query_lens_cpu: list[int]
    # Pending tokens: input row pending_dst[i] takes row pending_src[i] of the previous step's
    # sampled tokens (both empty when every input id is known).
    pending_dst: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    pending_src: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # (block_tables, slot_mapping) of paged cache groups 1, 2, ... (group 0's are the fields above).
    extra_groups: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    # Models with state groups: [B] int32 state slot and [B] bool "the slot holds this
    # sequence's state" (False on the first chunk after admission or resume); None otherwise.
    state_indices: np.ndarray | None = None
    has_initial_state: np.ndarray | None = None
    # Mixed steps with state groups: the rows that take the single-token state kernels.
    state_split: HostStateSplit | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_pure_decode(self) -> bool:
        return int(self.input_ids.shape[0]) == self.num_seqs


@dataclass
class HostStateSplit:
    """`layers.attention.StateSplit` as host arrays (see there)."""

    num_decodes: int
    rows: np.ndarray | None  # [T] int64, or None when the decode rows already come first
    state_indices: np.ndarray  # [B] int32
    has_initial_state: np.ndarray  # [B - D] bool
    query_start_loc: np.ndarray  # [B - D + 1] int32

    def arrays(self) -> list[np.ndarray]:
        """The arrays to ship, in `StateSplit` field order (`rows` only when not None)."""
        head = [] if self.rows is None else [self.rows]
        return [*head, self.state_indices, self.has_initial_state, self.query_start_loc]


def plan_state_split(
    query_lens: np.ndarray, state_indices: np.ndarray, has_initial_state: np.ndarray, query_start_loc: np.ndarray
) -> HostStateSplit | None:
    """The state-kernel split of a step (host data only): None when every sequence is a state
    decode (the pure-decode path) or none is (the varlen path takes the whole step).

    A stable partition: decode sequences first, then the others, each in step order; when the
    decodes already lead, the split order is the step's own (`rows` None: the layer slices)."""
    decode = (query_lens == 1) & has_initial_state
    num_decodes = int(decode.sum())
    if num_decodes in (0, len(query_lens)):
        return None
    order = np.concatenate((np.flatnonzero(decode), np.flatnonzero(~decode)))
    rest = order[num_decodes:]
    rest_lens = query_lens[rest]
    rest_loc = np.zeros(len(rest) + 1, dtype=np.int32)
    np.cumsum(rest_lens, out=rest_loc[1:])
    rows = None
    if not decode[:num_decodes].all():
        starts = query_start_loc[order].astype(np.int64)
        lens = query_lens[order].astype(np.int64)
        rows = np.repeat(starts, lens) + (np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens))
    return HostStateSplit(
        num_decodes=num_decodes,
        rows=rows,
        state_indices=state_indices[order].astype(np.int32),
        has_initial_state=has_initial_state[rest],
        query_start_loc=rest_loc,
    )


# What `host_to_device` ships for a forward pass (the pending indices travel with them).
_ARRAY_FIELDS = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables",
                 "logits_indices")


def build_model_inputs(
    batch: SequenceOf[ScheduledLike],
    block_size: int,
    device: torch.device,
    staging: PinnedStaging | None = None,
) -> ModelInputs:
    """`prepare_host_inputs` then `host_to_device` (through `staging` when given)."""
    return host_to_device(prepare_host_inputs(batch, block_size), device, staging)


def prepare_host_inputs(batch: SequenceOf[ScheduledLike], block_size: int) -> HostInputs:
    """Flatten the batch's new tokens and compute positions, cache slots and block tables.

    For each entry the new tokens are `seq.token_ids[c : c + num_new_tokens]` with
    `c = seq.num_computed_tokens`; `seq.block_table` must already cover `c + num_new_tokens`.
    Only a sequence's last new token may be pending (see the module docstring).
    """
    if not batch:
        raise ValueError("empty batch")
    token_chunks: list[list[int]] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    sample: list[bool] = []
    pending_dst: list[int] = []
    pending_src: list[int] = []
    num_tokens = 0
    for item in batch:
        seq, n = item.seq, item.num_new_tokens
        start = seq.num_computed_tokens
        end = start + n
        if n < 1 or end > seq.num_tokens:
            raise ValueError(
                f"{seq.request_id}: cannot run {n} new tokens from {start} (sequence has {seq.num_tokens})"
            )
        if len(seq.block_table) * block_size < end:
            raise ValueError(
                f"{seq.request_id}: {len(seq.block_table)} blocks cannot hold {end} tokens (block size {block_size})"
            )
        num_pending = end - seq.num_known_tokens
        if num_pending > 0:
            if num_pending > 1 or seq.num_pending_tokens != 1:
                raise ValueError(f"{seq.request_id}: only the last new token may be pending")
            pending_dst.append(num_tokens + n - 1)
            pending_src.append(seq.pending_row)
        token_chunks.append(_token_slice(seq, start, end))
        query_lens.append(n)
        seq_lens.append(end)
        sample.append(item.sample)
        num_tokens += n
    group_tables = [[item.seq.block_tables[g] for item in batch] for g in range(len(batch[0].seq.block_tables))]
    return assemble_host_inputs(token_chunks, query_lens, seq_lens, group_tables, sample, block_size,
                                np.asarray(pending_dst, dtype=np.int64), np.asarray(pending_src, dtype=np.int64),
                                [item.seq.state_slot for item in batch])


def assemble_host_inputs(
    token_chunks: SequenceOf[SequenceOf[int]],
    query_lens: list[int],
    seq_lens: list[int],
    group_tables: SequenceOf[SequenceOf[SequenceOf[int]]],
    sample: SequenceOf[bool],
    block_size: int,
    pending_dst: np.ndarray,
    pending_src: np.ndarray,
    state_slots: SequenceOf[int | None] | None = None,
) -> HostInputs:
    """`HostInputs` from per-entry lists: entry i runs `token_chunks[i]` (`query_lens[i]` tokens
    ending at position `seq_lens[i] - 1`) over block table `group_tables[g][i]` in each paged
    cache group g (group 0's arrays are the `block_tables`/`slot_mapping` fields, the others
    `extra_groups`; both via `group_tables.group_arrays`), and yields logits when `sample[i]`.
    Shared by the worker's rows (`worker_rows.host_inputs_from_rows`) and the
    Sequence-shaped batches of `prepare_host_inputs`.

    `state_slots[i]` is entry i's state slot (models with state groups: every entry has one);
    the state arrays are built when every entry has one, and an entry continues the state in its
    slot unless it starts at position 0 (`has_initial_state`); a mixed step also gets its
    state-kernel split (`plan_state_split`)."""
    num_seqs = len(query_lens)
    num_tokens = sum(query_lens)
    query_lens_np = np.asarray(query_lens, dtype=np.int64)
    seq_lens_np = np.asarray(seq_lens, dtype=np.int64)
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int32)
    np.cumsum(query_lens_np, out=query_start_loc[1:])
    logits_indices = (query_start_loc[1:].astype(np.int64) - 1)[np.asarray(sample, dtype=bool)]
    # Positions: for sequence i, (seq_len_i - q_len_i) .. seq_len_i - 1, vectorised over the batch.
    seq_index = np.repeat(np.arange(num_seqs), query_lens_np)
    offsets = np.arange(num_tokens) - np.repeat(query_start_loc[:-1], query_lens_np)
    positions = np.repeat(seq_lens_np - query_lens_np, query_lens_np) + offsets

    (block_tables, slot_mapping), *extra_groups = group_arrays(group_tables, seq_index, positions, block_size)

    input_ids = np.fromiter((t for chunk in token_chunks for t in chunk), dtype=np.int64, count=num_tokens)
    # Only when every entry holds a slot (a model with state groups gives each request one; a
    # hybrid layer handed a step without them fails loudly rather than read a wrong slot).
    state_indices = has_initial_state = state_split = None
    if state_slots is not None and state_slots and all(s is not None for s in state_slots):
        state_indices = np.asarray(state_slots, dtype=np.int32)
        has_initial_state = seq_lens_np > query_lens_np
        state_split = plan_state_split(query_lens_np, state_indices, has_initial_state, query_start_loc)
    return HostInputs(
        input_ids=input_ids,
        positions=positions.astype(np.int64),
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens_np.astype(np.int32),
        block_tables=block_tables,
        logits_indices=logits_indices,
        seq_lens_cpu=list(seq_lens),
        query_lens_cpu=list(query_lens),
        pending_dst=pending_dst,
        pending_src=pending_src,
        extra_groups=extra_groups,
        state_indices=state_indices,
        has_initial_state=has_initial_state,
        state_split=state_split,
    )


def arrays_to_device(
    arrays: SequenceOf[np.ndarray], device: torch.device, staging: PinnedStaging | None = None
) -> list[torch.Tensor]:
    """Device tensors for `arrays`: through `staging` (pinned, one asynchronous copy per dtype)
    when given, else a plain copy per array (a no-op view on CPU)."""
    if staging is not None:
        return staging.to_device(arrays)
    return [torch.from_numpy(a).to(device, non_blocking=True) for a in arrays]


def ship_step_arrays(
    arrays: SequenceOf[np.ndarray],
    host: HostInputs,
    device: torch.device,
    staging: PinnedStaging | None,
    previous_tokens: torch.Tensor | None,
) -> tuple[list[torch.Tensor], Callable[[torch.Tensor], None]]:
    """`arrays` on the device, with `host`'s pending-token indices in the same copy; returns the
    tensors and a function that writes the pending tokens into a device input-id buffer
    (`ids[pending_dst] = previous_tokens[pending_src]`; a no-op when nothing is pending)."""
    if not host.pending_dst.size:
        return arrays_to_device(arrays, device, staging), lambda ids: None
    if previous_tokens is None:
        raise ValueError("the step has pending tokens but no previous step's tokens were given")
    *tensors, dst, src = arrays_to_device([*arrays, host.pending_dst, host.pending_src], device, staging)

    def fill(ids: torch.Tensor) -> None:
        ids.index_copy_(0, dst, previous_tokens.index_select(0, src).to(ids.dtype))

    return tensors, fill


def host_to_device(
    host: HostInputs,
    device: torch.device,
    staging: PinnedStaging | None = None,
    previous_tokens: torch.Tensor | None = None,
) -> ModelInputs:
    """Device tensors for `host`, pending tokens filled in from `previous_tokens`."""
    extra = [a for pair in host.extra_groups for a in pair]
    state = [] if host.state_indices is None else [host.state_indices, host.has_initial_state]
    split = [] if host.state_split is None else host.state_split.arrays()
    tensors, fill_pending = ship_step_arrays(
        [*(getattr(host, n) for n in _ARRAY_FIELDS), *state, *split, *extra], host, device, staging, previous_tokens
    )
    arrays = dict(zip(_ARRAY_FIELDS, tensors))
    rest = iter(tensors[len(_ARRAY_FIELDS) :])
    state_tensors = [next(rest) for _ in state]
    split_tensors = [next(rest) for _ in split]
    extra_tensors = list(rest)
    extra_groups = tuple(zip(extra_tensors[0::2], extra_tensors[1::2]))
    input_ids = arrays.pop("input_ids")
    fill_pending(input_ids)
    metadata = AttentionMetadata(
        **arrays, seq_lens_cpu=host.seq_lens_cpu, query_lens_cpu=host.query_lens_cpu, extra_groups=extra_groups
    )
    if state_tensors:
        metadata.state_indices, metadata.has_initial_state = state_tensors
        metadata.has_initial_state_cpu = host.has_initial_state.tolist()
    if split_tensors:
        rows = None if host.state_split.rows is None else split_tensors.pop(0)
        metadata.state_split = StateSplit(host.state_split.num_decodes, rows, *split_tensors)
    return ModelInputs(input_ids=input_ids, metadata=metadata)


_ALIGN_BYTES = 16


class PinnedStaging:
    """Reusable pinned host buffers through which a step's arrays reach the GPU asynchronously.

    All arrays of one dtype are packed into one pinned buffer (each starting 16-byte aligned)
    and sent with one `non_blocking` copy; the device tensors returned are views of that copy. A buffer is
    refilled only after the copy that last read it has finished (an event wait). Two sets of
    buffers alternate, so with overlapped scheduling the step being built never waits on the
    copy of the step in flight, only on the one before it (long done). Buffers grow to the
    next power of two when a step needs more. For a CPU device the
    buffers are ordinary memory and each "copy" a clone (tests exercise the packing so).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self._buffers: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._events: dict[tuple[int, torch.dtype], torch.cuda.Event] = {}
        self._slot = 0

    def _buffer(self, key: tuple[int, torch.dtype], numel: int) -> torch.Tensor:
        event = self._events.get(key)
        if event is not None:
            event.synchronize()
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            size = 1 << max(numel - 1, 1023).bit_length()
            buf = self._buffers[key] = torch.empty(size, dtype=key[1], pin_memory=self._pinned)
        return buf

    def to_device(self, arrays: SequenceOf[np.ndarray]) -> list[torch.Tensor]:
        """One device tensor per array (same shape and dtype), in order."""
        out: list[torch.Tensor | None] = [None] * len(arrays)
        self._slot ^= 1
        by_dtype: dict[np.dtype, list[int]] = {}
        for i, a in enumerate(arrays):
            by_dtype.setdefault(a.dtype, []).append(i)
        for np_dtype, indices in by_dtype.items():
            dtype = torch.from_numpy(np.empty(0, dtype=np_dtype)).dtype
            # Each array starts 16-byte aligned in the packed copy: Triton compiles a variant per
            # alignment class of a pointer argument, and a class that depends on the step's
            # batch size would compile (or load from disk) mid-serving.
            align = max(1, _ALIGN_BYTES // np_dtype.itemsize)
            starts, total = [], 0
            for i in indices:
                starts.append(total)
                total += -(-arrays[i].size // align) * align
            key = (self._slot, dtype)
            buf = self._buffer(key, total)
            host = buf.numpy()
            for i, start in zip(indices, starts):
                host[start : start + arrays[i].size] = arrays[i].reshape(-1)
            if self._pinned:
                packed = buf[:total].to(self.device, non_blocking=True)
                if key not in self._events:
                    self._events[key] = torch.cuda.Event()
                self._events[key].record(torch.cuda.current_stream(self.device))
            else:  # a copy, not a view: the next step refills the buffer
                packed = buf[:total].clone()
            for i, start in zip(indices, starts):
                out[i] = packed[start : start + arrays[i].size].view(arrays[i].shape)
        return out  # type: ignore[return-value]
