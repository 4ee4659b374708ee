"""CUDA graphs for decode: one captured forward (+ logits) per batch-size bucket.

A pure-decode step (every sequence brings one token) of `n` sequences runs the graph of the
smallest bucket >= n. The graphs read fixed device buffers — token ids, positions, slot mapping,
sequence lengths and a block table as wide as `max_model_len` needs — so a step only copies its
(padded) arrays into them and replays. Padding rows are dummies: token 0 at position 0 with
sequence length 1, writing their K/V into a scratch block that the block manager never hands out
(the runner allocates it past the pool), so they cannot disturb a real sequence; their logits are
dropped. Steps with prefill tokens, and batches beyond the largest bucket, run eagerly.

The split-KV decode kernel's split count is a launch parameter, so it is fixed per bucket at
capture (from the bucket size and the block table's full width, never from the data).

Models with state cache groups (Gated DeltaNet) also read a fixed `state_indices` buffer: each
row's slot in the state pools, padded rows pointing at the scratch slot one past the pool (the
runner allocates it), so a dummy row's recurrent and convolution state writes land there. Only
steps whose every row continues its state (`has_initial_state`) replay a graph: the
single-token state kernels read the slot as the request's state.

Capture happens once at start-up, after the KV cache is allocated: each bucket is first run
eagerly (compiling every Triton variant it needs) and then captured, largest first, into one
memory pool shared by all graphs (they never run at the same time).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import structlog
import torch
from torch import nn

from tandem.engine_service.worker.input_batch import HostInputs, PinnedStaging, ship_step_arrays
from tandem.engine_service.layers.attention import AttentionMetadata
from tandem.kernels._utils import num_compute_units
from tandem.kernels.paged_attention import choose_num_splits

log = structlog.get_logger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Bucket sizes to capture, ascending: the standard buckets up to `max_num_seqs`, plus
    `max_num_seqs` itself (at most 256) so every batch the scheduler can form has a graph."""
    if max_num_seqs < 1:
        raise ValueError("max_num_seqs must be >= 1")
    cap = min(max_num_seqs, BATCH_BUCKETS[-1])
    sizes = [b for b in BATCH_BUCKETS if b <= cap]
    if sizes[-1] != cap:
        sizes.append(cap)
    return sizes


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest size >= `num_seqs` (sizes ascending), or None when none is large enough."""
    for size in sizes:
        if size >= num_seqs:
            return size
    return None


def splits_per_bucket(
    sizes: list[int], num_kv_heads: int, max_blocks_per_seq: int, block_size: int, num_units: int,
    sliding_window: int | None = None,
) -> dict[int, int]:
    """The decode kernel's split-KV count for each bucket: chosen from the bucket size and the
    block table's full width only (or the window, which bounds what a query reads), so it is the
    same at capture and at every replay."""
    max_context = max_blocks_per_seq * block_size
    if sliding_window is not None:
        max_context = min(max_context, sliding_window)
    return {b: choose_num_splits(b, num_kv_heads, max_context, num_units) for b in sizes}


@dataclass
class PaddedDecode:
    """A decode step's arrays padded to a bucket (rows `num_seqs..bucket-1` are dummies)."""

    input_ids: np.ndarray  # [bucket] int64
    positions: np.ndarray  # [bucket] int64
    slot_mapping: np.ndarray  # [bucket] int64
    seq_lens: np.ndarray  # [bucket] int32
    block_tables: np.ndarray  # [bucket, width] int32
    # (block_tables, slot_mapping) of paged cache groups 1.., padded the same way.
    extra_groups: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    # [bucket] int32 state slots (models with state groups), padded with the scratch slot.
    state_indices: np.ndarray | None = None


def _pad_group(tables: np.ndarray, slots: np.ndarray, bucket: int, scratch_block: int,
               block_size: int) -> tuple[np.ndarray, np.ndarray]:
    n = tables.shape[0]
    padded_tables = np.full((bucket, tables.shape[1]), scratch_block, dtype=np.int32)
    padded_tables[:n] = tables
    padded_slots = np.concatenate([slots, np.full(bucket - n, scratch_block * block_size, dtype=slots.dtype)])
    return padded_tables, padded_slots


def pad_decode_inputs(host: HostInputs, bucket: int, scratch_block: int, block_size: int,
                      extra_scratch_blocks: list[int] | tuple[int, ...] = (),
                      scratch_state_slot: int | None = None) -> PaddedDecode:
    """Pad a pure-decode step to `bucket` rows of dummies that only touch `scratch_block` (and,
    in paged cache group g >= 1, `extra_scratch_blocks[g - 1]`; in the state pools,
    `scratch_state_slot`)."""
    n = host.num_seqs
    if not host.is_pure_decode:
        raise ValueError("only pure-decode steps (one token per sequence) can be padded for a graph")
    if n > bucket:
        raise ValueError(f"{n} sequences do not fit a bucket of {bucket}")
    pad = bucket - n

    def padded(a: np.ndarray, fill: int) -> np.ndarray:
        return np.concatenate([a, np.full(pad, fill, dtype=a.dtype)])

    tables = np.full((bucket, host.block_tables.shape[1]), scratch_block, dtype=np.int32)
    tables[:n] = host.block_tables
    if len(host.extra_groups) != len(extra_scratch_blocks):
        raise ValueError(f"the step has {len(host.extra_groups)} extra cache groups, the graphs {len(extra_scratch_blocks)}")
    if (host.state_indices is None) != (scratch_state_slot is None):
        raise ValueError("state slots and a scratch state slot go together (models with state groups)")
    state_indices = None
    if host.state_indices is not None:
        state_indices = padded(host.state_indices.astype(np.int32), scratch_state_slot)  # type: ignore[arg-type]
    return PaddedDecode(
        input_ids=padded(host.input_ids, 0),
        positions=padded(host.positions, 0),
        slot_mapping=padded(host.slot_mapping, scratch_block * block_size),
        seq_lens=padded(host.seq_lens, 1),
        block_tables=tables,
        extra_groups=[_pad_group(t, sl, bucket, scratch, block_size)
                      for (t, sl), scratch in zip(host.extra_groups, extra_scratch_blocks)],
        state_indices=state_indices,
    )


class DecodeCudaGraphs:
    """Captured decode forward passes, one per bucket, over fixed input and metadata buffers.

    `capture()` once at start-up; then `can_run(host)` / `run(host, staging)` per step. `run`
    returns float32 logits of the sampling rows, like `ModelRunner.forward`.

    `capture_graphs=False` keeps everything but the graphs: each `run` executes the same
    forward eagerly on the same fixed, padded buffers. That is how the padding and buffer logic
    is tested without a GPU, and a way to tell a capture problem from a padding problem.
    """

    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[torch.Tensor],
        *,
        sizes: list[int],
        block_size: int,
        max_blocks_per_seq: int,
        scratch_block: int,
        num_kv_heads: int,
        device: torch.device,
        capture_graphs: bool = True,
        sliding_window: int | None = None,
        extra_scratch_blocks: list[int] | tuple[int, ...] = (),
        scratch_state_slot: int | None = None,
    ) -> None:
        if not sizes or sizes != sorted(set(sizes)):
            raise ValueError(f"bucket sizes must be ascending and distinct, got {sizes}")
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = list(sizes)
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.scratch_block = scratch_block
        self.device = device
        self.capture_graphs = capture_graphs
        # The layers' windows are kernel arguments fixed per layer, so they are captured as is;
        # only the split count (shared by every layer of a bucket) depends on the window here.
        self.num_splits = splits_per_bucket(
            self.sizes, num_kv_heads, max_blocks_per_seq, block_size, num_compute_units(device), sliding_window
        )
        largest = self.sizes[-1]
        # The fixed buffers, initialised as all-dummy rows (what warm-up and capture run on).
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), scratch_block * block_size, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.full(
            (largest, max_blocks_per_seq), scratch_block, dtype=torch.int32, device=device
        )
        # Block tables and slot mappings of paged cache groups 1.. (each with its own scratch block).
        self.extra_scratch_blocks = tuple(extra_scratch_blocks)
        self.extra_groups = [
            (torch.full((largest, max_blocks_per_seq), scratch, dtype=torch.int32, device=device),
             torch.full((largest,), scratch * block_size, dtype=torch.int64, device=device))
            for scratch in self.extra_scratch_blocks
        ]
        # State slots (models with state groups): every row starts on the scratch slot; a
        # captured decode step always continues a state (see `can_run`).
        self.scratch_state_slot = scratch_state_slot
        self.state_indices = self.has_initial_state = None
        if scratch_state_slot is not None:
            self.state_indices = torch.full((largest,), scratch_state_slot, dtype=torch.int32, device=device)
            self.has_initial_state = torch.ones(largest, dtype=torch.bool, device=device)
        self._row_ids = torch.arange(largest, dtype=torch.int64, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph | None] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self._metadata: dict[int, AttentionMetadata] = {}

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(self._graphs)

    def _metadata_for(self, bucket: int) -> AttentionMetadata:
        # The host lists only steer kernel choice (pure decode) here; lengths live on the device.
        return AttentionMetadata(
            positions=self.positions[:bucket],
            slot_mapping=self.slot_mapping[:bucket],
            query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            logits_indices=self._row_ids[:bucket],
            seq_lens_cpu=[1] * bucket,
            query_lens_cpu=[1] * bucket,
            decode_num_splits=self.num_splits[bucket],
            extra_groups=tuple((tables[:bucket], slots[:bucket]) for tables, slots in self.extra_groups),
            state_indices=None if self.state_indices is None else self.state_indices[:bucket],
            has_initial_state=None if self.has_initial_state is None else self.has_initial_state[:bucket],
            has_initial_state_cpu=None if self.state_indices is None else [True] * bucket,
        )

    def _forward(self, bucket: int, metadata: AttentionMetadata) -> torch.Tensor:
        hidden = self.model(self.input_ids[:bucket], metadata.positions, self.kv_caches, metadata)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every bucket, largest first, into one shared memory pool."""
        if not self.capture_graphs:
            for bucket in self.sizes:
                self._metadata[bucket] = self._metadata_for(bucket)
                self._graphs[bucket] = None
            return
        start = time.monotonic()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        main = torch.cuda.current_stream(self.device)
        for bucket in reversed(self.sizes):
            metadata = self._metadata_for(bucket)
            # Warm-up off the capture: compiles the Triton variants of this shape and lets
            # cuBLAS set up its workspaces, neither of which may happen inside a capture.
            side.wait_stream(main)
            with torch.cuda.stream(side):
                self._forward(bucket, metadata)
            main.wait_stream(side)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            # thread_local: the engine process has other threads (gRPC, metrics) that may touch
            # CUDA meanwhile; only this thread's calls must be capture-safe.
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                logits = self._forward(bucket, metadata)
            self._graphs[bucket] = graph
            self._logits[bucket] = logits  # kept alive: the graph writes here on every replay
            self._metadata[bucket] = metadata
        torch.cuda.synchronize(self.device)
        log.info(
            "cuda graphs captured", sizes=self.sizes, num_splits=self.num_splits,
            seconds=round(time.monotonic() - start, 1),
        )

    def can_run(self, host: HostInputs) -> bool:
        """A pure-decode step that fits a captured bucket and the fixed block-table width (and,
        with state groups, whose every row continues the state in its slot)."""
        if not self._graphs or not host.is_pure_decode:
            return False
        if (host.state_indices is None) != (self.state_indices is None):
            return False
        if host.has_initial_state is not None and not host.has_initial_state.all():
            return False
        return (
            host.num_seqs <= self.captured_sizes[-1]
            and host.block_tables.shape[1] <= self.max_blocks_per_seq
            and len(host.extra_groups) == len(self.extra_groups)
        )

    def run(
        self, host: HostInputs, staging: PinnedStaging | None, previous_tokens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Copy the padded step into the fixed buffers (pending tokens from `previous_tokens`),
        replay, return the sampling rows' logits."""
        bucket = bucket_for(host.num_seqs, self.captured_sizes)
        if bucket is None or not self.can_run(host):
            raise ValueError(f"no captured graph runs this step ({host.num_seqs} sequences)")
        padded = pad_decode_inputs(host, bucket, self.scratch_block, self.block_size, self.extra_scratch_blocks,
                                   self.scratch_state_slot)
        extra = [a for pair in padded.extra_groups for a in pair]
        state = [] if padded.state_indices is None else [padded.state_indices]
        (ids, pos, slots, lens, tables, rows, *rest), fill_pending = ship_step_arrays([
            padded.input_ids, padded.positions, padded.slot_mapping, padded.seq_lens,
            padded.block_tables, host.logits_indices, *state, *extra,
        ], host, self.device, staging, previous_tokens)
        if state:
            assert self.state_indices is not None
            self.state_indices[:bucket].copy_(rest[0])
        extra_tensors = rest[len(state):]
        self.input_ids[:bucket].copy_(ids)
        fill_pending(self.input_ids)
        self.positions[:bucket].copy_(pos)
        self.slot_mapping[:bucket].copy_(slots)
        self.seq_lens[:bucket].copy_(lens)
        # Columns past this step's width keep stale block ids: never read, as seq_lens bound reads.
        self.block_tables[:bucket, : tables.shape[1]].copy_(tables)
        for (table_buf, slot_buf), group_tables, group_slots in zip(
            self.extra_groups, extra_tensors[0::2], extra_tensors[1::2]
        ):
            table_buf[:bucket, : group_tables.shape[1]].copy_(group_tables)
            slot_buf[:bucket].copy_(group_slots)
        graph = self._graphs[bucket]
        if graph is None:
            self._logits[bucket] = self._forward(bucket, self._metadata[bucket])
        else:
            graph.replay()
        # index_select copies, so the caller's logits survive the next replay.
        return self._logits[bucket].index_select(0, rows).float()
