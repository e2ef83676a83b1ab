"""Static inputs of mixed steps (prompt chunks beside decodes) replayed from CUDA graphs (worker/cuda_graph.py).

An eager step of prompt work is bound by the host, not the device: on an H200 a step prefilling 16 prompts of 128
tokens through the default model's 30 layers takes 18.8 ms of wall time for 1.85 ms of device time (282 kernel
launches, about 55 us of Python and launcher time each; benchmarks/profile_prefill_h200.json). Every new request
waits for such a step, so it set the server's time to first token. A mixed step replayed from a graph costs one
launch.

A graph is captured per token bucket T (rows), for up to S sequences (S = the largest decode capture size), with
fixed shapes:

    rows 0 .. T-1     the step's tokens in scheduled order, then padding; row T is always padding
    sequences 0..S-1  the scheduled sequences, then padding ones with no rows; sequence S is the padding sequence
                      (one key: slot 0 of block 0, a valid address; its rows write nothing, slot -1)
    decode rows [S]   the row and sequence of each one-row sequence; padding entries point at row T, sequence S
    prefill tiles     (sequence, first row) of each PREFILL_BLOCK_M rows of every longer sequence, heaviest first;
                      padding tiles name sequence S, which has no rows: the kernel's programs store nothing
    logits rows [S]   each sequence's last row (padding: row T); sampling runs after the replay, outside the graph

so the attention kernels' grids are fixed (S decode programs, cdiv(T, BLOCK_M) + S prefill tiles) and every
padding program reads valid addresses and writes nothing a sequence owns. Everything lives in one int64 buffer,
filled on the host and copied to the device in one transfer per step (up to the last scheduled sequence's table row;
`compact`: the scheduled sequences' tables packed at their longest one's width, which the graph unpacks first,
kernels/graph_inputs.py).
"""

from __future__ import annotations

import numpy as np
import torch

from deepserve.kernels.graph_inputs import unpack_tables, unpack_tables_ref
from deepserve.layers.forward_batch import ForwardBatch
from deepserve.layers.kernel_dispatch import use_triton
from deepserve.worker.scheduler_output import SchedulerOutput


def mixed_buckets(max_tokens: int, largest: int = 2048, smallest: int = 256) -> list[int]:
    """Token buckets of mixed-step graphs: smallest, 2·smallest, ... up to min(largest, max_tokens) (which is the
    last); none when that is below the smallest."""
    top = min(largest, max_tokens)
    buckets, b = [], smallest
    while b < top:
        buckets.append(b)
        b *= 2
    return buckets + [top] if top >= smallest else []


class StaticMixedInputs:
    """One buffer for every bucket (each graph reads prefix views of the segments):
    ids | positions | slots [T_max + 1] | seq_lens [S + 1] | query_start_loc [S + 2] | logits rows [S] |
    decode rows [S] | decode seqs [S] | tile seqs [M_max] | tile first rows [M_max] | tables' shape [2] |
    block tables [(S + 1) x blocks] (`compact`: the scheduled sequences' tables packed, [rows x width], and the
    block tables the kernels read in a tensor of their own)."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, tile_rows: int,
                 device: torch.device, compact: bool = False) -> None:
        self.max_tokens, self.max_seqs, self.max_blocks, self.tile_rows = max_tokens, max_seqs, max_blocks, tile_rows
        self.compact = compact
        t, s = max_tokens + 1, max_seqs
        self.max_tiles = self.tiles_for(max_tokens)
        sizes = [t, t, t, s + 1, s + 2, s, s, s, self.max_tiles, self.max_tiles, 2, (s + 1) * max_blocks]
        self.offsets = np.cumsum([0] + sizes).tolist()
        n = self.offsets[-1]
        pin = device.type == "cuda"
        self.hosts = [torch.zeros(n, dtype=torch.int64, pin_memory=pin) for _ in range(2)]    # used in turn
        self.turn = 0
        self.device = torch.zeros(n, dtype=torch.int64, device=device)
        (self.input_ids, self.positions, self.slots, self.seq_lens, self.query_start_loc, self.logits_rows,
         self.decode_rows, self.decode_seqs, self.tile_seq, self.tile_m0, self.shape,
         self.packed) = self._segments(self.device)
        self.block_tables = (torch.zeros(s + 1, max_blocks, dtype=torch.int64, device=device) if compact
                             else self.packed.view(s + 1, max_blocks))

    def tiles_for(self, tokens: int) -> int:
        """Prefill tiles a bucket of `tokens` rows may need: one per tile_rows rows, plus one partial per sequence."""
        return -(-tokens // self.tile_rows) + self.max_seqs

    def _segments(self, buf):
        return [buf[a:b] for a, b in zip(self.offsets[:-1], self.offsets[1:])]

    def fill(self, out: SchedulerOutput, tokens: int, block_size: int) -> list[tuple[int, int]]:
        """The step into a host buffer, padded to `tokens` rows, then one copy to the device. Returns (row, seq_id) of
        decode rows whose input token is in flight (left 0 for the caller to patch)."""
        self.turn ^= 1
        host = self.hosts[self.turn].numpy()
        (ids, pos, slots, lens, qsl, logit_rows, dec_rows, dec_seqs, tile_seq, tile_m0, shape,
         tables) = self._segments(host)
        num = len(out.scheduled)
        stride = max(1, max((len(s.seq.block_table) for s in out.scheduled), default=0)) if self.compact \
            else self.max_blocks
        tables = tables[:(self.max_seqs + 1) * stride].reshape(self.max_seqs + 1, stride)
        shape[:] = num, stride
        inflight, tiles = [], []
        row = nd = 0
        for b, s in enumerate(out.scheduled):
            seq, start, n = s.seq, s.start, s.num_new_tokens
            table = seq.block_table
            qsl[b], lens[b] = row, start + n
            tables[b, :len(table)] = table          # (entries past a table are never read: beyond its keys)
            if n == 1:                              # a decode row: plain ints (most rows of a busy step)
                pos[row] = start
                slots[row] = table[start // block_size] * block_size + start % block_size
                if start < len(seq.token_ids):
                    ids[row] = seq.token_ids[start]
                else:
                    ids[row] = 0
                    inflight.append((row, seq.seq_id))
                dec_rows[nd], dec_seqs[nd] = row, b
                nd += 1
            else:
                p = np.arange(start, start + n)
                pos[row:row + n] = p
                slots[row:row + n] = np.asarray(table, dtype=np.int64)[p // block_size] * block_size + p % block_size
                ids[row:row + n] = seq.token_ids[start:start + n]
                tiles.extend((b, m0) for m0 in range(0, n, self.tile_rows))
            logit_rows[b] = row + n - 1
            row += n
        s_pad, pad_row = self.max_seqs, tokens
        ids[row:tokens + 1], pos[row:tokens + 1], slots[row:tokens + 1] = 0, 0, -1
        qsl[num:], lens[num:], tables[s_pad] = row, 1, 0       # the padding sequence: one key, block 0
        logit_rows[num:] = pad_row
        dec_rows[nd:], dec_seqs[nd:] = pad_row, s_pad
        tiles.sort(key=lambda e: -e[1])             # the last tiles of the longest chunks (most keys) first
        nt = len(tiles)
        if nt:
            tile_seq[:nt], tile_m0[:nt] = zip(*tiles)
        tile_seq[nt:], tile_m0[nt:] = s_pad, 0
        # Block tables are the last segment: copy only the scheduled sequences' rows (max_blocks long, or packed at
        # the step's width; the padding sequence's row stays the zeros the device's tables started with).
        used = self.offsets[-2] + num * stride
        self.device[:used].copy_(self.hosts[self.turn][:used], non_blocking=True)
        return inflight

    def unpack(self) -> None:
        """(compact) The scheduled sequences' packed tables into the block tables: a mixed graph's first launch."""
        out = self.block_tables[:self.max_seqs]
        (unpack_tables if use_triton(out) else unpack_tables_ref)(self.packed, self.shape, out)

    def fits(self, out: SchedulerOutput, tokens: int) -> bool:
        return len(out.scheduled) <= self.max_seqs and out.num_batched_tokens <= tokens

    def batch(self, tokens: int, block_size: int, max_seq_len: int) -> ForwardBatch:
        """A ForwardBatch of views into the static buffers for the bucket of `tokens` rows (+ the padding row); the
        host-side lengths are placeholders (the layers of a model whose attention reads prebuilt metadata never
        read them)."""
        t, s = tokens + 1, self.max_seqs
        return ForwardBatch(
            input_ids=self.input_ids[:t], positions=self.positions[:t], slot_mapping=self.slots[:t],
            block_tables=self.block_tables, query_start_loc=self.query_start_loc, seq_lens=self.seq_lens,
            query_lens_cpu=[t] + [0] * s, seq_lens_cpu=[max_seq_len] * (s + 1), logits_indices=self.logits_rows,
            block_size=block_size, graph_max_seq_len=max_seq_len)
