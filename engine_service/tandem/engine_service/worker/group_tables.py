"""Per-cache-group block tables and slot mappings of a step, as functions of block-id lists.

Each paged cache group gives every sequence its own block table; a step needs, per group, the
padded `[B, max_blocks]` table and the `[T]` slot each new token's entry is written to. These
helpers compute both from plain lists (whatever object holds them: the worker's per-request rows
in the engine, `Sequence`s in hand-built batches), and `input_batch.assemble_host_inputs` calls
them once per step for every group.
"""

from __future__ import annotations

from collections.abc import Sequence as SeqOf

import numpy as np

from tandem.engine_service.cache.block_manager import NULL_BLOCK


def block_table_array(tables: SeqOf[SeqOf[int]]) -> np.ndarray:
    """`[B, max_len]` int32, padded with 0; given-back entries (`NULL_BLOCK`) read as block 0
    (kernels never read them: they lie before every query's window)."""
    width = max((len(t) for t in tables), default=0)
    out = np.zeros((len(tables), max(width, 1)), dtype=np.int32)
    for i, table in enumerate(tables):
        out[i, : len(table)] = table
    if NULL_BLOCK < 0:
        np.maximum(out, 0, out=out)
    return out


def slot_mapping_array(
    block_tables: np.ndarray, seq_index: np.ndarray, positions: np.ndarray, block_size: int
) -> np.ndarray:
    """`[T]` int64: the cache slot of token t (sequence `seq_index[t]`, position `positions[t]`)."""
    block_ids = block_tables[seq_index, positions // block_size].astype(np.int64)
    return block_ids * block_size + positions % block_size


def group_arrays(
    group_tables: SeqOf[SeqOf[SeqOf[int]]], seq_index: np.ndarray, positions: np.ndarray, block_size: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """`(block_tables, slot_mapping)` per group; `group_tables[g][i]` is sequence i's table in group g."""
    out = []
    for tables in group_tables:
        arr = block_table_array(tables)
        out.append((arr, slot_mapping_array(arr, seq_index, positions, block_size)))
    return out
