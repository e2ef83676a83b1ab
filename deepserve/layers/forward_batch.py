"""ForwardBatch: everything one forward pass needs, flattened over the batch ("varlen" layout).

Rows are tokens. Sequence b owns rows [query_start_loc[b], query_start_loc[b+1]); its query tokens sit
at positions [seq_lens[b] - query_lens[b], seq_lens[b]) and attend to its first seq_lens[b] keys,
which live in the paged KV cache at the slots its block table names. Decodes (1 row), whole
prefills, prefills over a cached prefix and prompt chunks are all the same shape of thing.

Built once per step on the host by the worker (`worker/batch_builder.py`), then moved to the device in one go.
It lives with the layers because they read it: the worker builds it, the models and layers consume it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


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
    # Each sequence's whole length (prompt and generated tokens) when the step was built, which can exceed
    # seq_lens for a prompt chunk (DeepSeek-V4.1's YOCO keeps a suffix of it). Empty: seq_lens.
    data_lens_cpu: list[int] = field(default_factory=list)
    # Speculative decoding: how many of each sequence's rows are drafts being verified (empty: none anywhere). Such
    # a sequence's rows are decode rows of consecutive lengths, and a backend may run them as such.
    draft_lens_cpu: list[int] = field(default_factory=list)
    # A decode batch captured in a CUDA graph (worker/cuda_graph.py): every row is a one-row sequence of its own, the
    # host-side lengths above are placeholders, and a row may see up to this many keys. A layer whose work is sized
    # by context (DeepSeek-V4.1's compressed-entry lists) sizes it by this instead of seq_lens_cpu. 0: not captured.
    graph_max_seq_len: int = 0
    # Models with a window pool (engine/block_manager.py: per-position states read only a few positions back,
    # DeepSeek-V4 / V4.1): each row's slot and each sequence's table in that pool (-1 entries of released blocks as
    # 0). None: the model has none, or a placeholder batch whose window states use the main tables (the start-up
    # profile).
    window_slot_mapping: torch.Tensor | None = None
    window_block_tables: torch.Tensor | None = None
    # logits_indices is every row in order (a decode step: each row is sampled), so the rows whose logits are needed
    # are the hidden states as they are: no gather launch (`logits_rows`).
    logits_every_row: bool = False

    def logits_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The rows of x ([T, ...]) in `logits_indices`: x itself where those are all its rows, in order."""
        return x if self.logits_every_row else x[self.logits_indices]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def window_slots(self) -> torch.Tensor:
        """Where each row's window states are written."""
        return self.slot_mapping if self.window_slot_mapping is None else self.window_slot_mapping

    @property
    def window_tables(self) -> torch.Tensor:
        return self.block_tables if self.window_block_tables is None else self.window_block_tables

    @property
    def is_decode_only(self) -> bool:
        return all(q == 1 for q in self.query_lens_cpu)


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
