"""ForwardBatch: everything one forward pass needs, flattened over the batch ("varlen" layout).

Rows are tokens. Sequence b owns rows [query_start_loc[b], query_start_loc[b+1]); its query tokens sit
at positions [seq_lens[b] - query_lens[b], seq_lens[b]) and attend to its first seq_lens[b] keys,
which live in the paged KV cache at the slots its block table names. Decodes (1 row), whole
prefills, prefills over a cached prefix and prompt chunks are all the same shape of thing.

Built once per step by `ForwardBatch.build` on the host, then moved to the device in one go.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from deepserve.engine.scheduler import SchedulerOutput


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor          # [T] int64
    positions: torch.Tensor          # [T] int64
    slot_mapping: torch.Tensor       # [T] int64: KV slot each row's key/value is written to
    block_tables: torch.Tensor       # [B, max_blocks] int64, padded with 0
    query_start_loc: torch.Tensor    # [B + 1] int64
    seq_lens: torch.Tensor           # [B] int64: keys visible to each sequence after this step
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    logits_indices: torch.Tensor     # [S] int64: rows whose logits are needed
    block_size: int
    # Filled by the attention backend once per step (index tensors shared by every layer).
    attn_metadata: Any = field(default=None)
    # (row, seq_id) of rows whose input token is still in flight: input_ids holds 0 there until the runner
    # copies the token in from the previous step's device tensor (overlapped scheduling).
    inflight_rows: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return all(q == 1 for q in self.query_lens_cpu)

    @classmethod
    def build(cls, out: SchedulerOutput, block_size: int, device: torch.device,
              logits_rows: list[list[int]]) -> "ForwardBatch":
        """`logits_rows[b]`: offsets, within sequence b's rows, whose logits are wanted.

        Plain Python lists on the host (a decode row is a handful of int operations, cheaper than numpy calls
        at these sizes), packed into one int64 buffer and copied to the device in a single transfer."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        q_lens, s_lens, logit_idx = [], [], []
        inflight: list[tuple[int, int]] = []
        for sched, wanted in zip(out.scheduled, logits_rows):
            seq, start, n = sched.seq, sched.start, sched.num_new_tokens
            table = seq.block_table
            if n == 1:
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
        num_seqs = len(q_lens)
        max_blocks = max((len(s.seq.block_table) for s in out.scheduled), default=0)
        tables = np.zeros((num_seqs, max_blocks), dtype=np.int64)
        for b, sched in enumerate(out.scheduled):
            tables[b, :len(sched.seq.block_table)] = sched.seq.block_table
        starts = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=starts[1:])
        parts = [np.asarray(ids, dtype=np.int64), np.asarray(pos, dtype=np.int64), np.asarray(slots, dtype=np.int64),
                 tables.ravel(), starts, np.asarray(s_lens, dtype=np.int64), np.asarray(logit_idx, dtype=np.int64)]
        views = upload_int64(parts, device)
        return cls(
            input_ids=views[0], positions=views[1], slot_mapping=views[2],
            block_tables=views[3].view(num_seqs, max_blocks), query_start_loc=views[4], seq_lens=views[5],
            query_lens_cpu=q_lens, seq_lens_cpu=s_lens, logits_indices=views[6], block_size=block_size,
            inflight_rows=inflight,
        )


def upload_int64(parts: list, device: torch.device) -> list[torch.Tensor]:
    """int64 arrays (or int lists) -> device views of one buffer, filled by one host-to-device copy. Every view starts on a
    16-byte boundary: Triton compiles a kernel variant per pointer alignment, and views at whatever offset the
    previous parts left would compile new variants in the middle of serving (~1 s each)."""
    offsets, total = [], 0
    for p in parts:
        offsets.append(total)
        total += len(p) + (len(p) & 1)          # pad odd lengths: 2 int64 = 16 bytes
    buf = np.zeros(total, dtype=np.int64)
    for p, o in zip(parts, offsets):
        buf[o:o + len(p)] = p
    flat = torch.from_numpy(buf).to(device, non_blocking=True)
    return [flat[o:o + len(p)] for p, o in zip(parts, offsets)]
