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
        """`logits_rows[b]`: offsets, within sequence b's rows, whose logits are wanted."""
        ids, pos, slots, tables, q_lens, s_lens, logit_idx = [], [], [], [], [], [], []
        row = 0
        for sched, wanted in zip(out.scheduled, logits_rows):
            seq, start, n = sched.seq, sched.start, sched.num_new_tokens
            positions = np.arange(start, start + n, dtype=np.int64)
            table = np.asarray(seq.block_table, dtype=np.int64)
            ids.append(np.asarray(seq.token_ids[start:start + n], dtype=np.int64))
            pos.append(positions)
            slots.append(table[positions // block_size] * block_size + positions % block_size)
            tables.append(table)
            q_lens.append(n)
            s_lens.append(start + n)
            logit_idx.extend(row + i for i in wanted)
            row += n
        max_blocks = max((len(t) for t in tables), default=0)
        table_arr = np.zeros((len(tables), max_blocks), dtype=np.int64)
        for b, t in enumerate(tables):
            table_arr[b, :len(t)] = t
        starts = np.zeros(len(q_lens) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=starts[1:])

        def to_dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device, non_blocking=True)

        cat = np.concatenate
        empty = np.zeros(0, dtype=np.int64)
        return cls(
            input_ids=to_dev(cat(ids) if ids else empty),
            positions=to_dev(cat(pos) if pos else empty),
            slot_mapping=to_dev(cat(slots) if slots else empty),
            block_tables=to_dev(table_arr),
            query_start_loc=to_dev(starts),
            seq_lens=to_dev(np.asarray(s_lens, dtype=np.int64)),
            query_lens_cpu=q_lens,
            seq_lens_cpu=s_lens,
            logits_indices=to_dev(np.asarray(logit_idx, dtype=np.int64)),
            block_size=block_size,
        )
