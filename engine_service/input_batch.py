"""Builds a step's model inputs (token ids + attention metadata) from the scheduled batch.

Kept apart from the model runner so that fixed-size CUDA-graph buffers can later be filled by
the same code (the host-side arrays built here are copied into them).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from tandem.engine_service.layers.attention import AttentionMetadata
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


def _token_slice(seq: Sequence, start: int, end: int) -> list[int]:
    # Slices prompt/output directly: `seq.token_ids` would copy the whole context every step.
    p = seq.num_prompt_tokens
    if end <= p:
        return seq.prompt_token_ids[start:end]
    if start >= p:
        return seq.output_token_ids[start - p : end - p]
    return seq.prompt_token_ids[start:] + seq.output_token_ids[: end - p]


def build_model_inputs(batch: SequenceOf[ScheduledLike], block_size: int, device: torch.device) -> ModelInputs:
    """Flatten the batch's new tokens and compute positions, cache slots and block tables.

    For each entry the new tokens are `seq.token_ids[c : c + num_new_tokens]` with
    `c = seq.num_computed_tokens`; `seq.block_table` must already cover `c + num_new_tokens`.
    """
    if not batch:
        raise ValueError("empty batch")
    token_chunks: list[list[int]] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    tables: list[list[int]] = []
    logits_indices: list[int] = []
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
        token_chunks.append(_token_slice(seq, start, end))
        query_lens.append(n)
        seq_lens.append(end)
        tables.append(seq.block_table)
        num_tokens += n
        if item.sample:
            logits_indices.append(num_tokens - 1)

    query_lens_np = np.asarray(query_lens, dtype=np.int64)
    seq_lens_np = np.asarray(seq_lens, dtype=np.int64)
    query_start_loc = np.zeros(len(batch) + 1, dtype=np.int32)
    np.cumsum(query_lens_np, out=query_start_loc[1:])
    # Positions: for sequence i, (seq_len_i - q_len_i) .. seq_len_i - 1, vectorised over the batch.
    seq_index = np.repeat(np.arange(len(batch)), query_lens_np)
    offsets = np.arange(num_tokens) - np.repeat(query_start_loc[:-1], query_lens_np)
    positions = np.repeat(seq_lens_np - query_lens_np, query_lens_np) + offsets

    max_blocks = max(len(t) for t in tables)
    block_tables = np.zeros((len(batch), max_blocks), dtype=np.int32)
    for i, table in enumerate(tables):
        block_tables[i, : len(table)] = table
    block_ids = block_tables[seq_index, positions // block_size].astype(np.int64)
    slot_mapping = block_ids * block_size + positions % block_size

    def to_device(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device, non_blocking=True)

    input_ids = np.fromiter((t for chunk in token_chunks for t in chunk), dtype=np.int64, count=num_tokens)
    metadata = AttentionMetadata(
        positions=to_device(positions.astype(np.int64)),
        slot_mapping=to_device(slot_mapping),
        query_start_loc=to_device(query_start_loc),
        seq_lens=to_device(seq_lens_np.astype(np.int32)),
        block_tables=to_device(block_tables),
        logits_indices=to_device(np.asarray(logits_indices, dtype=np.int64)),
        seq_lens_cpu=seq_lens,
        query_lens_cpu=query_lens,
    )
    return ModelInputs(input_ids=to_device(input_ids), metadata=metadata)
