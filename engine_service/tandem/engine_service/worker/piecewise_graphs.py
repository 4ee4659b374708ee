"""CUDA graphs for steps with prefill rows: the forward captured in pieces between attention calls.

An eager step launches every kernel from Python, and a launch costs tens of microseconds of host
time: a 1k-token prefill of a small model spends far longer launching than computing. Decode
steps replay whole-forward graphs (`cuda_graphs.py`); a step with prefill rows cannot, because the
attention kernel's grid follows the step's query lengths and sequence count. Everything else in
a layer (projections, norms, RoPE + KV store, MLP or MoE) depends only on the number of tokens.
So, per token-count bucket, the forward is captured as `num_layers + 1` pieces, cut at every
attention call, and a step replays piece 0, runs layer 0's attention eagerly, replays piece 1,
and so on; the logits of the sampling rows are computed eagerly after the last piece.

Fixed buffers and padding: the pieces read the step's token ids, positions and slot mappings
(every paged cache group's) from fixed buffers of the largest bucket. A step of T tokens in a
bucket of T' >= T runs rows T..T'-1 as dummies: whatever (valid) ids and positions an earlier
step left there, writing K/V into the scratch block (one past each group's pool, never handed
out), so they cannot touch a real sequence. Attention runs on the step's own metadata
(`query_start_loc` covers the real rows only), so the dummy rows' attention outputs are never
written and hold whatever an earlier step left there: finite values that only reach the dummy
rows of later layers, whose results are dropped.

Each attention call reads its queries from a fixed buffer (the last kernel of the piece before
copies them there) and writes a fixed output buffer (the piece after reads it), so the eager
call between two replays touches no memory of the graphs' pool. Which attention call belongs to
which paged cache group is found at capture by identity with the capture metadata's group views.

Steps of few sequences (at most `WHOLE_BATCHES[-1]`: a lightly loaded server's prefills, where
time to first token is decided) replay one whole graph per (token bucket, sequence bucket)
instead, attention included: the prefill kernel's grid is fixed at capture from the token bucket
and the sequence bucket, and reads the step's lengths from fixed buffers. Padded sequences have
no query rows (their `query_start_loc` entries repeat the step's token count), so their programs
return at once, as do the query tiles past a sequence's own rows.

What is not captured (the step runs eagerly, as before): pure-decode steps (whole-forward graphs
or eager), steps beyond the largest bucket, models with state cache groups (Gated DeltaNet layers
choose kernels from host-side state flags), and backends without an `attend_hook`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import structlog
import torch
from torch import nn

from tandem.engine_service.layers.attention import AttentionMetadata
from tandem.engine_service.layers.triton_backend import attend_paged
from tandem.engine_service.worker.cuda_graphs import bucket_for
from tandem.engine_service.worker.input_batch import HostInputs, PinnedStaging, host_to_device

log = structlog.get_logger(__name__)

# Buckets grow by powers of two up to this many tokens, then in steps of it: padding wastes at
# most half of a small step and at most one step of this size of a large one.
_LINEAR_STEP = 256
_SMALLEST = 16
# Sequence buckets of the whole-forward graphs; steps of more sequences replay the pieces.
WHOLE_BATCHES = (1, 2, 4)


def token_buckets(max_tokens: int) -> list[int]:
    """Token-count buckets to capture, ascending, the last one `max_tokens` itself."""
    if max_tokens < 1:
        raise ValueError("max_tokens must be >= 1")
    sizes: list[int] = []
    size = _SMALLEST
    while size < min(max_tokens, _LINEAR_STEP):
        sizes.append(size)
        size *= 2
    size = _LINEAR_STEP
    while size < max_tokens:
        sizes.append(size)
        size += _LINEAR_STEP
    sizes.append(max_tokens)
    return sorted(set(sizes))


@dataclass
class AttentionCall:
    """One attention call between two pieces: what it reads and writes, fixed at capture."""

    group: int  # paged cache group of the layer (its block tables in the step metadata)
    kv_cache: torch.Tensor
    scale: float
    sliding_window: int | None
    q: torch.Tensor  # view of a fixed query buffer, [bucket, heads, head_dim]
    out: torch.Tensor  # view of a fixed output buffer, same shape

    def run(self, metadata: AttentionMetadata) -> None:
        attend_paged(self.q, self.kv_cache, metadata.for_group(self.group), self.scale, self.sliding_window,
                     out=self.out)

    def __call__(self, q: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """As the forward sees it without graphs: `q` into the fixed buffer, attend, the output."""
        self.q.copy_(q)
        self.run(metadata)
        return self.out


@dataclass
class _Bucket:
    pieces: list[torch.cuda.CUDAGraph]  # empty when graphs are off (the forward runs eagerly)
    calls: list[AttentionCall]
    hidden: torch.Tensor | None  # the last piece's output, [bucket, hidden]


@dataclass
class _Whole:
    graph: torch.cuda.CUDAGraph | None  # None when graphs are off (the forward runs eagerly)
    metadata: AttentionMetadata  # over the fixed buffers, sized (token bucket, sequence bucket)
    hidden: torch.Tensor | None  # the graph's output, [bucket, hidden]


class PiecewiseCudaGraphs:
    """Captured pieces of the forward per token-count bucket, for steps with prefill rows.

    `capture()` once at start-up (after the decode graphs); then `can_run(host)` / `run(host,
    staging, previous_tokens)` per step. `run` returns float32 logits of the sampling rows, like
    `ModelRunner.forward`.

    `capture_graphs=False` keeps the buffers, the padding and the attention hook but runs each
    step's forward eagerly on them: how the padding and buffer logic is tested without a GPU.
    """

    def __init__(
        self,
        model: nn.Module,
        layer_caches: list,
        *,
        max_tokens: int,
        block_size: int,
        max_blocks_per_seq: int,
        scratch_block: int,
        device: torch.device,
        capture_graphs: bool = True,
        extra_scratch_blocks: list[int] | tuple[int, ...] = (),
        whole_batches: tuple[int, ...] = WHOLE_BATCHES,
    ) -> None:
        backend = model.attn_backend
        if not hasattr(backend, "attend_hook"):
            raise ValueError(f"attention backend {backend.name!r} has no attend_hook: it cannot be captured in pieces")
        self.model = model
        self.backend = backend
        self.layer_caches = layer_caches
        self.sizes = token_buckets(max_tokens)
        self.block_size = block_size
        self.device = device
        self.capture_graphs = capture_graphs
        largest = self.sizes[-1]
        self.scratch_blocks = (scratch_block, *extra_scratch_blocks)
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        # One slot mapping per paged cache group, each pointing at its group's scratch block.
        self.slot_mappings = [
            torch.full((largest,), scratch * block_size, dtype=torch.int64, device=device)
            for scratch in self.scratch_blocks
        ]
        # Fixed query / output buffers per attention geometry (heads, head_dim, dtype).
        self._buffers: dict[tuple[int, int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        self._buckets: dict[int, _Bucket] = {}
        # The whole graphs' step metadata: lengths and one block table per paged group.
        self.whole_batches = tuple(sorted(whole_batches))
        most = self.whole_batches[-1] if self.whole_batches else 0
        self.max_blocks_per_seq = max_blocks_per_seq
        self.query_start_loc = torch.zeros(most + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(most, dtype=torch.int32, device=device)
        self.block_tables = [torch.full((most, max_blocks_per_seq), scratch, dtype=torch.int32, device=device)
                             for scratch in self.scratch_blocks]
        self._whole: dict[tuple[int, int], _Whole] = {}

    @property
    def captured_sizes(self) -> list[int]:
        """The token buckets, once captured (ascending; empty before `capture`)."""
        return self.sizes if self._buckets else []

    # ------------------------------------------------------------------ buffers and metadata

    def _buffers_for(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = (q.shape[1], q.shape[2], q.dtype)
        if key not in self._buffers:
            shape = (self.sizes[-1], q.shape[1], q.shape[2])
            self._buffers[key] = (torch.zeros(shape, dtype=q.dtype, device=self.device),
                                  torch.zeros(shape, dtype=q.dtype, device=self.device))
        return self._buffers[key]

    def _capture_metadata(self, bucket: int) -> AttentionMetadata:
        """One sequence of `bucket` tokens on scratch blocks: what warm-up and capture run on."""
        width = -(-bucket // self.block_size)
        tables = [torch.full((1, width), scratch, dtype=torch.int32, device=self.device)
                  for scratch in self.scratch_blocks]
        return AttentionMetadata(
            positions=self.positions[:bucket],
            slot_mapping=self.slot_mappings[0][:bucket],
            query_start_loc=torch.tensor([0, bucket], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([bucket], dtype=torch.int32, device=self.device),
            block_tables=tables[0],
            logits_indices=torch.tensor([bucket - 1], dtype=torch.int64, device=self.device),
            seq_lens_cpu=[bucket],
            query_lens_cpu=[bucket],
            extra_groups=tuple((t, s[:bucket]) for t, s in zip(tables[1:], self.slot_mappings[1:])),
        )

    @staticmethod
    def _group_of(metadata: AttentionMetadata, template: AttentionMetadata) -> int:
        if metadata is template:
            return 0
        for group, view in template._group_views.items():
            if view is metadata:
                return group
        raise RuntimeError("an attention call's metadata is not a group view of the step's metadata")

    def _forward(self, bucket: int, metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(self.input_ids[:bucket], metadata.positions, self.layer_caches, metadata)

    # ------------------------------------------------------------------ capture

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up (compiling every kernel variant) and capture every bucket, largest first,
        into one memory pool shared by all pieces (they never run at the same time)."""
        start = time.monotonic()
        pool = stream = None
        if self.capture_graphs:
            pool = torch.cuda.graph_pool_handle()
            # Warm-up and capture on one side stream: cuBLAS sets up its workspace for a stream
            # at its first GEMM there, which must not happen inside a capture.
            stream = torch.cuda.Stream(self.device)
        for bucket in reversed(self.sizes):
            template = self._capture_metadata(bucket)
            calls: list[AttentionCall] = []
            self.backend.attend_hook = self._recording_hook(template, calls)
            try:
                # Warm-up: compiles every kernel variant of the bucket, sizes the fixed buffers.
                if stream is None:
                    self._forward(bucket, template)
                else:
                    stream.wait_stream(torch.cuda.current_stream(self.device))
                    with torch.cuda.stream(stream):
                        self._forward(bucket, template)
            finally:
                self.backend.attend_hook = None
            if stream is None:
                self._buckets[bucket] = _Bucket(pieces=[], calls=calls, hidden=None)
            else:
                self._buckets[bucket] = self._capture_bucket(bucket, template, calls, pool, stream)
            for seqs in self.whole_batches:
                if seqs <= bucket:
                    self._whole[(bucket, seqs)] = self._capture_whole(bucket, seqs, pool, stream)
        if self.capture_graphs:
            torch.cuda.synchronize(self.device)
        log.info("piecewise cuda graphs captured", buckets=self.sizes, seconds=round(time.monotonic() - start, 1))

    def _recording_hook(self, template: AttentionMetadata, calls: list[AttentionCall]) -> Callable[..., torch.Tensor]:
        """Runs each attention through the fixed buffers and records the call."""
        def hook(q, kv_cache, metadata, scale, sliding_window):
            q_buf, out_buf = self._buffers_for(q)
            n = q.shape[0]
            call = AttentionCall(self._group_of(metadata, template), kv_cache, scale, sliding_window,
                                 q_buf[:n], out_buf[:n])
            calls.append(call)
            return call(q, template)
        return hook

    def _capture_bucket(self, bucket: int, template: AttentionMetadata, calls: list[AttentionCall],
                        pool, stream: torch.cuda.Stream) -> _Bucket:
        torch.cuda.synchronize(self.device)
        pieces: list[torch.cuda.CUDAGraph] = []
        cut = iter(calls)

        def begin() -> None:
            graph = torch.cuda.CUDAGraph()
            pieces.append(graph)
            # thread_local: the engine process has other threads (gRPC, metrics) that may touch
            # CUDA meanwhile; only this thread's calls must be capture-safe.
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")

        def hook(q, kv_cache, metadata, scale, sliding_window):
            call = next(cut)
            if call.kv_cache is not kv_cache or call.q.shape != q.shape:
                raise RuntimeError("the forward's attention calls changed between warm-up and capture")
            call.q.copy_(q)  # the piece's last kernel
            pieces[-1].capture_end()
            begin()
            return call.out

        with torch.cuda.stream(stream):
            self.backend.attend_hook = hook
            capturing = False
            try:
                begin()
                capturing = True
                hidden = self._forward(bucket, template)
                capturing = False
                pieces[-1].capture_end()
            finally:
                self.backend.attend_hook = None
                if capturing:  # leave no stream capturing behind a failure
                    try:
                        pieces[-1].capture_end()
                    except RuntimeError:
                        pass
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if len(pieces) != len(calls) + 1:
            raise RuntimeError(f"captured {len(pieces)} pieces for {len(calls)} attention calls")
        # `hidden` stays referenced: the last piece writes it on every replay.
        return _Bucket(pieces=pieces, calls=calls, hidden=hidden)

    def _whole_metadata(self, bucket: int, seqs: int) -> AttentionMetadata:
        """Metadata over the fixed buffers; the host lists make the kernels' grid (`bucket` query
        rows at most, `seqs` sequences) and choose the prefill kernel (not all lengths are 1)."""
        return AttentionMetadata(
            positions=self.positions[:bucket],
            slot_mapping=self.slot_mappings[0][:bucket],
            query_start_loc=self.query_start_loc[: seqs + 1],
            seq_lens=self.seq_lens[:seqs],
            block_tables=self.block_tables[0][:seqs],
            logits_indices=torch.zeros(0, dtype=torch.int64, device=self.device),  # unused: logits are eager
            seq_lens_cpu=[bucket] * seqs,
            query_lens_cpu=[bucket] + [0] * (seqs - 1),
            extra_groups=tuple((t[:seqs], s[:bucket]) for t, s in zip(self.block_tables[1:], self.slot_mappings[1:])),
        )

    def _capture_whole(self, bucket: int, seqs: int, pool, stream: torch.cuda.Stream | None) -> _Whole:
        """One graph of the whole forward for steps of at most `seqs` sequences and `bucket` tokens,
        warmed up and captured on a step of one `bucket`-token sequence on the scratch blocks."""
        metadata = self._whole_metadata(bucket, seqs)
        # Within the block table's width (a bucket can be longer than max_model_len).
        rows = min(bucket, self.max_blocks_per_seq * self.block_size)
        self.query_start_loc[: seqs + 1] = torch.tensor([0] + [rows] * seqs, dtype=torch.int32)
        self.seq_lens[:seqs] = torch.tensor([rows] + [0] * (seqs - 1), dtype=torch.int32)
        if stream is None:
            return _Whole(graph=None, metadata=metadata, hidden=None)
        self.backend.attend_hook = self._fixed_output_hook
        try:
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._forward(bucket, metadata)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                hidden = self._forward(bucket, metadata)
        finally:
            self.backend.attend_hook = None
        return _Whole(graph=graph, metadata=metadata, hidden=hidden)

    def _fixed_output_hook(self, q, kv_cache, metadata, scale, sliding_window) -> torch.Tensor:
        """Attention into the fixed output buffer: the kernel writes the step's rows only, so the
        dummy rows read what an earlier step left there (finite), never uninitialised memory
        (which could be inf or NaN, and NaN rows would reach the MoE router)."""
        _, out = self._buffers_for(q)
        return attend_paged(q, kv_cache, metadata, scale, sliding_window, out=out[: q.shape[0]])

    # ------------------------------------------------------------------ steps

    def can_run(self, host: HostInputs) -> bool:
        """A step with prefill rows, no state groups, within the largest bucket and the groups
        captured."""
        if not self._buckets or host.is_pure_decode or host.state_indices is not None:
            return False
        return (int(host.input_ids.shape[0]) <= self.sizes[-1]
                and len(host.extra_groups) == len(self.scratch_blocks) - 1
                and host.block_tables.shape[1] <= self.max_blocks_per_seq)

    @torch.inference_mode()
    def run(self, host: HostInputs, staging: PinnedStaging | None,
            previous_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Copy the step into the fixed buffers (dummy rows past it), replay the pieces with the
        attention calls between them, return the sampling rows' float32 logits."""
        if not self.can_run(host):
            raise ValueError("no piecewise graph runs this step")
        inputs = host_to_device(host, self.device, staging, previous_tokens)
        md = inputs.metadata
        n = md.num_tokens
        bucket = bucket_for(n, self.sizes)
        # Rows past the step keep the (valid) ids and positions an earlier step left; only their
        # slots matter: a longer step's real slots there must become the scratch block again.
        self.input_ids[:n].copy_(inputs.input_ids)
        self.positions[:n].copy_(md.positions)
        group_slots = [md.slot_mapping, *(slots for _, slots in md.extra_groups)]
        for buf, slots, scratch in zip(self.slot_mappings, group_slots, self.scratch_blocks):
            buf[:n].copy_(slots)
            buf[n:bucket].fill_(scratch * self.block_size)
        seqs = bucket_for(md.num_seqs, self.whole_batches)  # None past the largest: the pieces
        whole = self._whole.get((bucket, seqs))
        hidden = self._run_whole(whole, host, md, seqs) if whole is not None else self._run_pieces(bucket, md)
        return self.model.compute_logits(hidden.index_select(0, md.logits_indices)).float()

    def _run_pieces(self, bucket: int, md: AttentionMetadata) -> torch.Tensor:
        """Replay the bucket's pieces with the step's attention calls between them (the step's
        metadata over the fixed buffers); returns the last piece's hidden states."""
        step_md = replace(
            md, positions=self.positions[:bucket], slot_mapping=self.slot_mappings[0][:bucket],
            extra_groups=tuple((tables, buf[:bucket]) for (tables, _), buf in zip(md.extra_groups, self.slot_mappings[1:])),
            _group_views={},
        )
        entry = self._buckets[bucket]
        if not entry.pieces:  # graphs off: the forward, each attention call as a replay runs it
            calls = iter(entry.calls)
            self.backend.attend_hook = lambda q, kv_cache, metadata, scale, sliding_window: next(calls)(q, step_md)
            try:
                return self._forward(bucket, step_md)
            finally:
                self.backend.attend_hook = None
        for piece, call in zip(entry.pieces, entry.calls):
            piece.replay()
            call.run(step_md)
        entry.pieces[-1].replay()
        assert entry.hidden is not None
        return entry.hidden

    def _run_whole(self, whole: _Whole, host: HostInputs, md: AttentionMetadata, seqs: int) -> torch.Tensor:
        """Fill the fixed length and block-table buffers (padded sequences without rows) and
        replay the whole forward; returns its hidden states."""
        b = md.num_seqs
        self.query_start_loc[: b + 1].copy_(md.query_start_loc)
        self.query_start_loc[b + 1 : seqs + 1].fill_(int(host.query_start_loc[-1]))
        self.seq_lens[:b].copy_(md.seq_lens)
        self.seq_lens[b:seqs].zero_()
        tables = [md.block_tables, *(t for t, _ in md.extra_groups)]
        for buf, table in zip(self.block_tables, tables):
            # Columns past this step's width keep stale ids: never read, as seq_lens bound reads.
            buf[:b, : table.shape[1]].copy_(table)
        if whole.graph is None:
            self.backend.attend_hook = self._fixed_output_hook
            try:
                return self._forward(whole.metadata.num_tokens, whole.metadata)
            finally:
                self.backend.attend_hook = None
        whole.graph.replay()
        assert whole.hidden is not None
        return whole.hidden
