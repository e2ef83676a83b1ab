"""Scheduler output -> ForwardBatch: the step's token ids, positions, KV slots and block tables, on the device."""

from __future__ import annotations

import numpy as np
import torch

from deepserve.layers.forward_batch import ForwardBatch, upload_int64
from deepserve.worker.scheduler_output import SchedulerOutput


def build_forward_batch(out: SchedulerOutput, block_size: int, device: torch.device,
                        logits_rows: list[list[int]]) -> ForwardBatch:
    """`logits_rows[b]`: offsets, within sequence b's rows, whose logits are wanted.

    Plain Python lists on the host (a decode row is a handful of int operations, cheaper than numpy calls
    at these sizes), packed into one int64 buffer and copied to the device in a single transfer."""
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    q_lens, s_lens, d_lens, logit_idx = [], [], [], []
    inflight: list[tuple[int, int]] = []
    for sched, wanted in zip(out.scheduled, logits_rows):
        seq, start, n = sched.seq, sched.start, sched.num_new_tokens
        table = seq.block_table
        if sched.draft_token_ids:
            # A decode row and the drafts it verifies: the known last token, then the drafts at the next positions.
            assert start < len(seq.token_ids), "a row with drafts reads a known token"
            ids.append(seq.token_ids[start])
            ids.extend(sched.draft_token_ids)
            pos.extend(range(start, start + n))
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, start + n))
        elif n == 1:
            if start < len(seq.token_ids):
                ids.append(seq.token_ids[start])
            else:
                inflight.append((len(ids), seq.seq_id))
                ids.append(0)
            pos.append(start)
            slots.append(table[start // block_size] * block_size + start % block_size)
        else:
            assert start + n <= len(seq.token_ids), "only a decode row can read an in-flight token"
            ids.extend(seq.token_ids[start:start + n])
            pos.extend(range(start, start + n))
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, start + n))
        row = len(ids) - n
        logit_idx.extend(row + i for i in wanted)
        q_lens.append(n)
        s_lens.append(start + n)
        d_lens.append(max(seq.num_tokens, start + n))
    num_seqs = len(q_lens)
    max_blocks = max((len(s.seq.block_table) for s in out.scheduled), default=0)
    tables = np.zeros((num_seqs, max_blocks), dtype=np.int64)
    for b, sched in enumerate(out.scheduled):
        tables[b, :len(sched.seq.block_table)] = sched.seq.block_table
    starts = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(q_lens, out=starts[1:])
    parts = [np.asarray(ids, dtype=np.int64), np.asarray(pos, dtype=np.int64), np.asarray(slots, dtype=np.int64),
             tables.ravel(), starts, np.asarray(s_lens, dtype=np.int64), np.asarray(logit_idx, dtype=np.int64)]
    with_window = any(s.seq.window_table for s in out.scheduled)
    if with_window:
        parts += window_tables_and_slots(out, pos, block_size, max_blocks)
    views = upload_int64(parts, device)
    return ForwardBatch(
        input_ids=views[0], positions=views[1], slot_mapping=views[2],
        block_tables=views[3].view(num_seqs, max_blocks), query_start_loc=views[4], seq_lens=views[5],
        query_lens_cpu=q_lens, seq_lens_cpu=s_lens, logits_indices=views[6], block_size=block_size,
        inflight_rows=inflight, data_lens_cpu=d_lens,
        draft_lens_cpu=[len(s.draft_token_ids) for s in out.scheduled] if any(s.draft_token_ids for s in out.scheduled)
        else [],
        window_slot_mapping=views[8] if with_window else None,
        window_block_tables=views[7].view(num_seqs, max_blocks) if with_window else None,
    )


def window_tables_and_slots(out: SchedulerOutput, positions: list[int], block_size: int,
                            max_blocks: int) -> list[np.ndarray]:
    """[window tables (flat), window slot of each row] for a model with a window pool (engine/block_manager.py).
    Released entries (-1) become block 0: nothing reads them (they lie beyond every row's reach)."""
    tables = np.zeros((len(out.scheduled), max_blocks), dtype=np.int64)
    for b, sched in enumerate(out.scheduled):
        tables[b, :len(sched.seq.window_table)] = sched.seq.window_table
    np.maximum(tables, 0, out=tables)
    row_seq = np.repeat(np.arange(len(out.scheduled)), [s.num_new_tokens for s in out.scheduled])
    pos = np.asarray(positions, dtype=np.int64)
    slots = tables[row_seq, pos // block_size] * block_size + pos % block_size
    return [tables.ravel(), slots]
