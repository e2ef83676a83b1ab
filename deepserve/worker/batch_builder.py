"""Scheduler output -> ForwardBatch: the step's token ids, positions, KV slots and block tables, on the device."""

from __future__ import annotations

from itertools import chain

import numpy as np
import torch

from deepserve.layers.forward_batch import ForwardBatch, upload_int64
from deepserve.worker.scheduler_output import SchedulerOutput


def build_forward_batch(out: SchedulerOutput, block_size: int, device: torch.device,
                        logits_rows: list[list[int]]) -> ForwardBatch:
    """`logits_rows[b]`: offsets, within sequence b's rows, whose logits are wanted.

    One pass over the sequences collects plain Python lists (a decode row is a handful of appends, cheaper than
    numpy calls at these sizes); block tables and KV slots are then filled by a few numpy operations for the whole
    batch, packed into one int64 buffer and copied to the device in a single transfer."""
    ids: list[int] = []
    pos: list[int] = []
    q_lens, s_lens, d_lens, logit_idx = [], [], [], []
    tables, window_tables, draft_lens = [], [], []
    inflight: list[tuple[int, int]] = []
    for sched, wanted in zip(out.scheduled, logits_rows):
        seq, start, n, drafts = sched.seq, sched.start, sched.num_new_tokens, sched.draft_token_ids
        token_ids = seq.token_ids
        if drafts:
            # A decode row and the drafts it verifies: the known last token, then the drafts at the next positions.
            assert start < len(token_ids), "a row with drafts reads a known token"
            ids.append(token_ids[start])
            ids.extend(drafts)
            pos.extend(range(start, start + n))
        elif n == 1:
            if start < len(token_ids):
                ids.append(token_ids[start])
            else:
                inflight.append((len(ids), seq.seq_id))
                ids.append(0)
            pos.append(start)
        else:
            assert start + n <= len(token_ids), "only a decode row can read an in-flight token"
            ids.extend(token_ids[start:start + n])
            pos.extend(range(start, start + n))
        row = len(ids) - n
        if len(wanted) == 1:        # the common case (a row that samples): no comprehension for one offset
            logit_idx.append(row + wanted[0])
        else:
            logit_idx.extend([row + i for i in wanted])
        q_lens.append(n)
        s_lens.append(start + n)
        d_lens.append(max(len(token_ids) + seq.num_inflight, start + n))     # max(num_tokens, start + n)
        tables.append(seq.block_table)
        window_tables.append(seq.window_table)
        draft_lens.append(len(drafts))
    num_seqs = len(q_lens)
    max_blocks = max(map(len, tables), default=0)
    block_tables = padded_rows(tables, max_blocks)
    positions = np.asarray(pos, dtype=np.int64)
    # Each row's KV slot, from its sequence's table: one gather for the batch instead of a Python expression a row.
    row_seq = np.repeat(np.arange(num_seqs), q_lens)
    slots = block_tables[row_seq, positions // block_size] * block_size + positions % block_size
    starts = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(q_lens, out=starts[1:])
    parts = [np.asarray(ids, dtype=np.int64), positions, slots, block_tables.ravel(), starts,
             np.asarray(s_lens, dtype=np.int64), np.asarray(logit_idx, dtype=np.int64)]
    with_window = any(window_tables)
    if with_window:
        parts += window_tables_and_slots(window_tables, row_seq, positions, block_size, max_blocks)
    views = upload_int64(parts, device)
    return ForwardBatch(
        input_ids=views[0], positions=views[1], slot_mapping=views[2],
        block_tables=views[3].view(num_seqs, max_blocks), query_start_loc=views[4], seq_lens=views[5],
        query_lens_cpu=q_lens, seq_lens_cpu=s_lens, logits_indices=views[6], block_size=block_size,
        inflight_rows=inflight, data_lens_cpu=d_lens,
        draft_lens_cpu=draft_lens if any(draft_lens) else [],
        logits_every_row=len(logit_idx) == len(ids) and logit_idx == list(range(len(ids))),
        window_slot_mapping=views[8] if with_window else None,
        window_block_tables=views[7].view(num_seqs, max_blocks) if with_window else None,
    )


def padded_rows(rows: list[list[int]], width: int) -> np.ndarray:
    """[len(rows), width] int64: row i holds rows[i], then zeros. One numpy fill for the whole batch (assigning row by
    row costs a list-to-array conversion per row)."""
    lens = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    padded = np.zeros((len(rows), width), dtype=np.int64)
    # A boolean mask assigns in row-major order: the rows' entries one after another, as chain() yields them.
    padded[np.arange(width) < lens[:, None]] = np.fromiter(chain.from_iterable(rows), dtype=np.int64,
                                                           count=int(lens.sum()))
    return padded


def window_tables_and_slots(window_tables: list[list[int]], row_seq: np.ndarray, positions: np.ndarray,
                            block_size: int, max_blocks: int) -> list[np.ndarray]:
    """[window tables (flat), window slot of each row] for a model with a window pool (engine/block_manager.py).
    `row_seq`: each row's sequence. Released entries (-1) become block 0: nothing reads them (they lie beyond every
    row's reach)."""
    tables = padded_rows(window_tables, max_blocks)
    np.maximum(tables, 0, out=tables)
    slots = tables[row_seq, positions // block_size] * block_size + positions % block_size
    return [tables.ravel(), slots]
