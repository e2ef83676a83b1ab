"""Decode steps replayed from CUDA graphs.

A decode step of a small model is a few hundred kernel launches of a few microseconds each; launched one by
one from Python they take longer than the GPU needs to run them. At start-up we capture the whole forward
(embedding -> layers -> LM head) of a decode-only batch once per batch size in `capture_sizes`, and a step
replays the graph of the smallest size that holds its batch:

  - inputs live in static device buffers (one flat int64 buffer, filled by one host-to-device copy per step, or,
    mapped, by the graph's first launch from the host buffer);
  - padding rows read one key of block 0 (a valid address) and write nothing (slot -1);
  - attention metadata is fixed per size: the split-K partition is sized for `max_model_len`, so a context
    of any length fits the same launch grid (splits past a sequence's end are empty and weigh nothing);
  - logits land in a static output buffer; sampling runs outside the graph, unless `carry_tokens`
    (DEEPSERVE_GRAPH_TOKENS): then every decode graph also ends with the greedy argmax of its rows into a token
    buffer it keeps, and starts by patching in the in-flight tokens the previous replay left there (token_src among
    the static inputs, kernels/graph_inputs.py). A greedy step without logprobs takes those tokens as its sample:
    between two replays there is then only the inputs' copy in and the tokens' copy out, and with `mapped_io`
    (DEEPSERVE_MAPPED_STEP_IO, on by default) not even those: the graph reads the inputs from pinned host memory in
    its first launch and its argmax writes the tokens there;
  - with `keep_hidden`, so do the hidden states the model returns (every row's), for a drafter that runs eagerly
    after sampling (DeepSeek-V3's MTP layer reads the target's final hidden state of every position).

A decode verifying drafts (speculative decoding) is one decode row per position: row j attends to the keys up
to its own position, the rows before it included. Batches with prefill rows, prompt logprobs, or more rows than
the largest size run eagerly.

Context buckets: a model whose decode work is sized by the context, not by the step's rows (DeepSeek-V4.1 scores
and gathers every compressed entry a row may see: `decode_work_grows_with_context`), is captured per (size,
context bucket): 4k, 8k, ... up to max_model_len keys. A step replays the smallest bucket holding its longest
sequence, so a short context does not pay for max_model_len. The first bucket is captured at start-up, the others
the first time a step needs them (logged). Every other model has one bucket, max_model_len.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from deepserve.kernels.graph_inputs import (load_inputs, load_inputs_ref, patch_tokens, patch_tokens_ref, unpack_tables,
                                            unpack_tables_ref)
from deepserve.layers.forward_batch import ForwardBatch
from deepserve.layers.kernel_dispatch import use_triton
from deepserve.layers.sampler import greedy_tokens
from deepserve.worker.batch_builder import padded_rows
from deepserve.worker.mixed_graph import StaticMixedInputs
from deepserve.worker.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)

_MAX_CAPTURE_SIZE = 512
_SMALLEST_CONTEXT_BUCKET = 4096


def context_buckets(max_model_len: int, smallest: int = _SMALLEST_CONTEXT_BUCKET) -> list[int]:
    """smallest, 2·smallest, ... (doubling) up to max_model_len, which is always the last."""
    buckets, b = [], smallest
    while b < max_model_len:
        buckets.append(b)
        b *= 2
    return buckets + [max_model_len]


def default_capture_sizes(max_num_seqs: int, limit: int | None = None) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to the largest batch the scheduler can form."""
    top = min(max_num_seqs, limit or _MAX_CAPTURE_SIZE)
    sizes = [s for s in (1, 2, 4, 8) if s <= top] + list(range(16, top + 1, 16))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


def padded_size(batch_size: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds `batch_size` rows, or None (run eagerly)."""
    for size in sizes:
        if size >= batch_size:
            return size
    return None


COLUMNS = 6      # per-row columns of StaticDecodeInputs before the tables
# DEEPSERVE_COMPACT_BLOCK_TABLES=auto packs the tables where a row at max_model_len's width holds this many blocks.
# Measured ends (H100, Llama-3.2-1B at 1k, batch 64, two passes, compact_tables_ml*_ab_h100_s43.json): at 69 blocks
# (the sweep's ~1.1k) packing cost 0.5% (2.113-2.116 -> 2.123 ms, the unpack launch); at 8192 (128k) it saved 3.4%
# (2.195-2.198 -> 2.121). Between them, the full rows' bytes (8 a block) at batch 64 pass the unpack's ~10 us over
# PCIe near 512 blocks (8k tokens in 16-token blocks).
COMPACT_MIN_BLOCKS = 512


def compact_tables_for(setting: str, max_model_len: int, block_size: int) -> bool:
    """Whether a step's block tables travel packed (DEEPSERVE_COMPACT_BLOCK_TABLES `setting`: "1" / "0", or "auto":
    where max_model_len's table row holds COMPACT_MIN_BLOCKS blocks or more)."""
    if setting == "auto":
        return -(-max_model_len // block_size) >= COMPACT_MIN_BLOCKS
    return setting == "1"


class StaticDecodeInputs:
    """Host staging buffer and device buffer with a fixed layout: ids | positions | slots | seq_lens | window slots |
    token sources | tables' shape | tables, a row per batch row: its block table, then (`window`: a model with a
    window pool) its window table. A row's token source is -1, or the row of the graphs' token buffer its input
    token is in.

    `compact`: the tables travel packed at the step's width (its longest table), and the graph spreads them into
    `block_tables` / `window_tables` ([max_batch, max_blocks], a tensor of their own: kernels/graph_inputs.py)
    with `unpack`. Otherwise they travel at max_blocks entries a row, straight into place.

    `mapped` (compact too): nothing is copied; the graph's first launch reads the host buffer of the fill's `turn`
    itself (`load`), so a graph is captured per host buffer. A third host buffer, `scratch`, holds padding for the
    captures' warm-ups, which run while the other two may still be read by a replay in flight."""

    def __init__(self, max_batch: int, max_blocks: int, device: torch.device, window: bool = False,
                 compact: bool = False, mapped: bool = False) -> None:
        compact = compact or mapped
        self.max_batch, self.max_blocks, self.compact, self.mapped = max_batch, max_blocks, compact, mapped
        self.tables_per_row = 2 if window else 1
        self.tables_start = COLUMNS * max_batch + 2
        n = self.tables_start + max_batch * max_blocks * self.tables_per_row
        pin = device.type == "cuda"
        # Two host buffers used in turn: with overlapped scheduling the copy out of one may still be queued
        # while the next step fills the other (a step is collected before the one after next is filled).
        self.hosts = [torch.zeros(n, dtype=torch.int64, pin_memory=pin) for _ in range(3 if mapped else 2)]
        if mapped:      # what a replay before the first fill loads (the verification-cost curve's timing replays)
            for host in self.hosts:
                self._write_padding(host, max_batch)
        self.turn = 0
        self.num_rows = 0       # rows (sequences and their drafts) of the last fill
        self.device = torch.zeros(n, dtype=torch.int64, device=device)
        mb = max_batch
        self.input_ids, self.positions, self.slots, self.seq_lens, self.window_slots, self.token_src = \
            (self.device[i * mb:(i + 1) * mb] for i in range(COLUMNS))
        self.shape = self.device[COLUMNS * mb:self.tables_start]      # (table rows, width) of the packed tables
        self.packed = self.device[self.tables_start:]
        tables = (torch.zeros(mb, self.tables_per_row, max_blocks, dtype=torch.int64, device=device) if compact
                  else self.packed.view(mb, self.tables_per_row, max_blocks))
        self.tables = tables
        self.block_tables = tables[:, 0]
        self.window_tables = tables[:, 1] if window else None
        self.query_start_loc = torch.arange(mb + 1, dtype=torch.int64, device=device)
        self.rows = torch.arange(mb, dtype=torch.int64, device=device)

    def fill(self, out: SchedulerOutput, size: int, block_size: int,
             carried: dict[int, int] | None = None) -> list[tuple[int, int]]:
        """Write the batch (padded to `size` rows) into a host buffer, then copy the used part over.
        Returns (row, seq_id) of rows whose input token is in flight (left 0 for the caller to patch), except those
        `carried` names (seq_id -> row of the graphs' token buffer): their token source is that row, and the replay
        patches them itself.

        One pass over the sequences collects Python lists; the rows are then written a column at a time (numpy
        writes of single elements cost ~100 ns each, a dozen a row)."""
        self.turn ^= 1
        host = self.hosts[self.turn]
        mb, h, per_row = self.max_batch, host.numpy(), self.tables_per_row
        ids, pos, slots, lens, wslots, src = (h[i * mb:(i + 1) * mb] for i in range(COLUMNS))
        row_ids, row_pos, tables = [], [], []
        inflight = []
        for s in out.scheduled:
            seq, p, drafts = s.seq, s.start, s.draft_token_ids
            token_ids = seq.token_ids
            if p < len(token_ids):
                row_ids.append(token_ids[p])
            else:
                inflight.append((len(row_ids), seq.seq_id))
                row_ids.append(0)
            row_pos.append(p)
            if drafts:
                # A row per draft after the known token: a decode row one position further (it sees the rows before
                # it, whose keys every layer writes before its attention reads).
                row_ids.extend(drafts)
                row_pos.extend(range(p + 1, p + 1 + len(drafts)))
            tables.append(seq.block_table)
        b = self.num_rows = len(row_ids)
        positions = np.asarray(row_pos, dtype=np.int64)
        # Each row's sequence: one row a sequence, unless some verify drafts.
        row_seq = (np.arange(b) if b == len(tables) else
                   np.repeat(np.arange(len(tables)), [1 + len(s.draft_token_ids) for s in out.scheduled]))
        width = max(map(len, tables), default=0)
        stride = max(width, 1) if self.compact else self.max_blocks     # entries a table row travels with
        start = self.tables_start
        all_tables = h[start:start + size * per_row * stride].reshape(size, per_row, stride)
        h[start - 2:start] = size * per_row, stride
        seq_tables = padded_rows(tables, width)
        ids[:b] = row_ids
        pos[:b] = positions
        slots[:b] = seq_tables[row_seq, positions // block_size] * block_size + positions % block_size
        lens[:b] = positions + 1
        all_tables[:b, 0, :width] = seq_tables[row_seq]
        if per_row == 2:          # (released window entries, -1, become block 0: beyond every row's reach)
            seq_windows = padded_rows([s.seq.window_table for s in out.scheduled], width)
            np.maximum(seq_windows, 0, out=seq_windows)
            wslots[:b] = seq_windows[row_seq, positions // block_size] * block_size + positions % block_size
            all_tables[:b, 1, :width] = seq_windows[row_seq]
        # Padding rows: one key of block 0 to read (a valid address), nothing to write.
        ids[b:size], pos[b:size], slots[b:size], lens[b:size], wslots[b:size] = 0, 0, -1, 1, -1
        all_tables[b:size] = 0
        src[:size] = -1
        if carried:
            kept = []
            for row, seq_id in inflight:
                if seq_id in carried:
                    src[row] = carried[seq_id]
                else:
                    kept.append((row, seq_id))
            inflight = kept
        if not self.mapped:
            used = start + size * per_row * stride
            self.device[:used].copy_(host[:used], non_blocking=True)
        return inflight

    def take_tokens_from_buffer(self, rows: list[tuple[int, int]]) -> None:
        """(mapped) The rows of the last fill whose in-flight tokens the caller writes into the graphs' token buffer
        at the same row before the replay: their token source becomes that row. (A copy into input_ids, as
        without `mapped`, would be overwritten by the replay's own load.)"""
        src = self.hosts[self.turn].numpy()[(COLUMNS - 1) * self.max_batch:COLUMNS * self.max_batch]
        for row, _ in rows:
            src[row] = row

    def load(self, size: int, turn: int | None, tokens: torch.Tensor) -> None:
        """(mapped) The step's inputs from host buffer `turn` (None: `scratch`) into the device buffers, the token
        sources patched from `tokens`: a decode graph's first launch."""
        host = self.hosts[2 if turn is None else turn]
        args = (host, self.device, self.tables, tokens, size, self.max_batch, COLUMNS, self.tables_start, 0,
                COLUMNS - 1)
        (load_inputs if use_triton(self.device) else load_inputs_ref)(*args)

    def unpack(self, size: int) -> None:
        """(compact) The step's packed tables into the tables the kernels read: a decode graph's first launch."""
        out = self.tables[:size].view(size * self.tables_per_row, self.max_blocks)
        (unpack_tables if use_triton(out) else unpack_tables_ref)(self.packed, self.shape, out)

    def clear(self, size: int) -> None:
        """Padding-only inputs for a capture: every row reads block 0 and writes nothing (slot -1). (mapped: in the
        scratch host buffer too, which the capture's warm-up loads.)"""
        if self.mapped:
            self._write_padding(self.hosts[2], size)
        self.input_ids[:size].zero_()
        self.positions[:size].zero_()
        self.slots[:size].fill_(-1)
        self.window_slots[:size].fill_(-1)
        self.token_src[:size].fill_(-1)
        self.seq_lens[:size].fill_(1)
        self.tables[:size].zero_()
        self.shape.copy_(torch.tensor([size * self.tables_per_row, 1]))
        self.packed[:size * self.tables_per_row].zero_()

    def _write_padding(self, host: torch.Tensor, size: int) -> None:
        """(mapped) `clear`'s padding rows into a host buffer: `size` rows, tables packed one entry wide."""
        mb = self.max_batch
        for column, value in enumerate((0, 0, -1, 1, -1, -1)):     # ids, positions, slots, lengths, window, source
            host[column * mb:column * mb + size] = value
        host[self.tables_start - 2:self.tables_start] = torch.tensor([size * self.tables_per_row, 1])
        host[self.tables_start:self.tables_start + size * self.tables_per_row] = 0

    def batch(self, size: int, block_size: int, max_seq_len: int) -> ForwardBatch:
        """A ForwardBatch of views into the static buffers (the same tensors at every replay); rows see at most
        `max_seq_len` keys."""
        return ForwardBatch(
            input_ids=self.input_ids[:size], positions=self.positions[:size], slot_mapping=self.slots[:size],
            block_tables=self.block_tables[:size], query_start_loc=self.query_start_loc[:size + 1],
            seq_lens=self.seq_lens[:size], query_lens_cpu=[1] * size, seq_lens_cpu=[1] * size,
            logits_indices=self.rows[:size], block_size=block_size, graph_max_seq_len=max_seq_len,
            window_slot_mapping=self.window_slots[:size] if self.window_tables is not None else None,
            window_block_tables=self.window_tables[:size] if self.window_tables is not None else None,
            logits_every_row=True)


@dataclass
class GraphReplay:
    """What one replay leaves for the rest of the step: views of the static buffers, valid until the next replay."""
    logits: torch.Tensor                # [rows, vocab] in the LM head's dtype: a row per scheduled position, in order
    hidden: torch.Tensor | None         # [rows, ...]: what model(batch) returned for those rows (keep_hidden only)
    batch: ForwardBatch                 # the static inputs the graph read (one decode row per position, padded)
    inflight: list[tuple[int, int]]     # (row, seq_id) of rows whose token was patched in on the device
    tokens: torch.Tensor | None = None  # [rows] int64: the greedy argmax of each row (carry_tokens graphs)
    host_tokens: torch.Tensor | None = None   # the same in pinned host memory (mapped_io graphs), an event later


class CUDAGraphRunner:
    """Captures and replays decode forwards. `model(batch)` -> `model.compute_logits` is what gets captured. A graph
    is keyed by (padded batch size, context bucket).

    window: the model keeps states in the window pool (engine/block_manager.py): each row also has its window table and
    window-state slot among the static inputs.

    keep_hidden: the graph also copies `model(batch)` (every row's hidden state before the LM head, whatever its
    shape and dtype) into a static buffer allocated at the first capture, and `run` hands it out: the way in for a
    drafter that runs eagerly after sampling (DeepSeek-V3's MTP layer reads the final hidden states).

    V4.1's DSpark drafter needs no hidden buffer: the target's forward writes what the draft blocks read (the main
    keys, into the draft layers' paged states) in place, and a replay does the same writes. After the replay,
    `run_dspark` runs eagerly on `GraphReplay.batch`, whose block tables have a row per position, not per sequence
    (a sequence's table is read at the row of its first position).

    carry_tokens: each decode graph ends with the greedy argmax of its rows into `tokens` and starts by patching the
    rows whose token_src names a row of it (the module docstring); `run` hands the argmax out as GraphReplay.tokens.
    The buffer holds the last decode replay's argmax until the next decode replay: mixed graphs leave it alone.

    compact_tables: the block tables travel packed at the step's width (StaticDecodeInputs, StaticMixedInputs).

    mapped_io (with carry_tokens, DEEPSERVE_MAPPED_STEP_IO): a decode graph reads its inputs from the host buffer
    itself and its argmax also writes the tokens into pinned host memory (`host_tokens`, one buffer a host input
    buffer): no copy is queued between two replays. Two graphs a key, one per host buffer (`turn_graphs` holds the
    second); `run` hands the host tokens out as GraphReplay.host_tokens."""

    def __init__(self, model, attn_backend, block_size: int, max_model_len: int, vocab_size: int,
                 capture_sizes: list[int], device: torch.device, keep_hidden: bool = False,
                 window: bool = False, mixed_buckets: list[int] = (), carry_tokens: bool = False,
                 compact_tables: bool = False, mapped_io: bool = False) -> None:
        self.model, self.attn_backend = model, attn_backend
        self.block_size, self.max_model_len = block_size, max_model_len
        self.sizes = sorted(capture_sizes)
        self.buckets = (context_buckets(max_model_len) if getattr(model, "decode_work_grows_with_context", False)
                        else [max_model_len])
        self.device = device
        max_blocks = -(-max_model_len // block_size)
        self.mapped = mapped_io and carry_tokens
        self.inputs = StaticDecodeInputs(self.sizes[-1], max_blocks, device, window, compact=compact_tables,
                                         mapped=self.mapped)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.batches: dict[tuple[int, int], ForwardBatch] = {}
        # One logits buffer for every graph: each copies its logits in, so the graphs' own outputs die after
        # capture and their memory is reused across sizes (one [size, vocab] tensor per graph would cost ~1 GB for
        # a 128k vocabulary). It holds the LM head's output in its own dtype (`head_logits`, bf16 for a bf16
        # model), allocated at the first capture's warm-up: a float32 copy in the graph wrote and read twice the
        # bytes (at Qwen3-MoE batch 128, ~230 MB more a step), for an argmax that gets the same answer from bf16.
        self.vocab_size = vocab_size
        self.logits: torch.Tensor | None = None
        self.keep_hidden = keep_hidden
        self.hidden: torch.Tensor | None = None     # allocated at the first capture, like the model's output
        self.tokens = torch.zeros(self.sizes[-1], dtype=torch.int64, device=device) if carry_tokens else None
        # (mapped) the argmax's copy on the host: one buffer per host input buffer (the last: the warm-ups')
        self.host_tokens = [torch.zeros(self.sizes[-1], dtype=torch.int64, pin_memory=device.type == "cuda")
                            for _ in range(3)] if self.mapped else None
        self.turn_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.capture_seconds = 0.0
        self.num_replays = 0
        self._pool = self._stream = None
        # Mixed steps (worker/mixed_graph.py): one graph per token bucket, for up to sizes[-1] sequences.
        self.mixed_buckets = sorted(mixed_buckets)
        self.mixed: StaticMixedInputs | None = None
        if self.mixed_buckets:
            self.mixed = StaticMixedInputs(self.mixed_buckets[-1], self.sizes[-1], max_blocks,
                                           attn_backend.mixed_tile_rows, device, compact=compact_tables)
        self.mixed_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.mixed_batches: dict[int, ForwardBatch] = {}
        self.num_mixed_replays = 0

    def _forward(self, batch: ForwardBatch, size: int, decode: bool = False, turn: int | None = None) -> None:
        """The captured work: (a decode graph: the packed tables' unpacking and, with carried tokens, the in-flight
        patch; mapped: the load of host buffer `turn`, None the scratch one, which does both,) the attention
        backend's per-forward input work (`begin_forward`, if it has one), the forward, its outputs copied into the
        static buffers (and the greedy argmax into `tokens`, mapped: and into `host_tokens[turn]`)."""
        mapped = decode and self.mapped
        if mapped:
            self.inputs.load(size, turn, self.tokens)
        elif decode and self.inputs.compact:
            self.inputs.unpack(size)
        elif not decode and self.mixed is not None and self.mixed.compact:
            self.mixed.unpack()
        carry = decode and self.tokens is not None
        if carry and not mapped:
            ids = self.inputs.input_ids[:size]
            (patch_tokens if use_triton(ids) else patch_tokens_ref)(ids, self.inputs.token_src[:size], self.tokens)
        self._forward_logits(batch, size)
        if carry:
            host_out = self.host_tokens[2 if turn is None else turn][:size] if mapped else None
            greedy_tokens(self.logits[:size], out=self.tokens[:size], host_out=host_out)

    def _forward_logits(self, batch: ForwardBatch, size: int) -> None:
        begin_forward = getattr(self.attn_backend, "begin_forward", None)
        if begin_forward is not None and batch.attn_metadata is not None:
            begin_forward(batch)
        hidden = self.model(batch)
        if self.keep_hidden:
            if self.hidden is None:         # the largest size comes first: one buffer holds every size's rows
                self.hidden = torch.empty(self.sizes[-1], *hidden.shape[1:], dtype=hidden.dtype, device=self.device)
            self.hidden[:size].copy_(hidden)
        head_logits = getattr(self.model, "head_logits", None)
        if head_logits is not None and self.logits is not None:
            head_logits(hidden, out=self.logits[:size])     # past 32 rows straight from cuBLAS, no copy
            return
        logits = (head_logits or self.model.compute_logits)(hidden)
        if self.logits is None:             # the first warm-up, outside any capture; the largest size comes first
            rows = max(self.sizes[-1], self.mixed.max_seqs if self.mixed is not None else 0)
            self.logits = torch.empty(rows, self.vocab_size, dtype=logits.dtype, device=self.device)
        self.logits[:size].copy_(logits)

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every mixed bucket and every size of the first context bucket, largest first so the smaller graphs
        reuse its memory. A mixed bucket that cannot be captured turns mixed graphs off (logged); decode graphs
        stay."""
        t0 = time.perf_counter()
        self._capture_mixed_buckets()
        for size in reversed(self.sizes):
            self._capture(size, self.buckets[0])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        logger.info("captured %d CUDA graphs (batch sizes %s, %d keys) in %.1f s", len(self.sizes), self.sizes,
                    self.buckets[0], self.capture_seconds)
        return self.capture_seconds

    def _capture(self, size: int, bucket: int) -> None:
        batch = self.inputs.batch(size, self.block_size, bucket)
        self.inputs.clear(size)
        if getattr(self.model, "reads_attention_metadata", True):
            batch.attn_metadata = self.attn_backend.build_graph_metadata(batch, bucket)
        self.graphs[size, bucket], self.batches[size, bucket] = self._record(size, batch, decode=True, turn=0), batch
        if self.mapped:
            self.turn_graphs[size, bucket] = self._record(size, batch, decode=True, turn=1)

    def _capture_mixed_buckets(self) -> None:
        try:
            for tokens in reversed(self.mixed_buckets):
                self.mixed.fill(SchedulerOutput(), tokens, self.block_size)        # padding only
                batch = self.mixed.batch(tokens, self.block_size, self.max_model_len)
                batch.attn_metadata = self.attn_backend.build_mixed_graph_metadata(self.mixed, tokens,
                                                                                   self.max_model_len)
                self.mixed_graphs[tokens] = self._record(self.mixed.max_seqs, batch)
                self.mixed_batches[tokens] = batch
        except Exception:   # a layer that cannot be captured with prompt rows: those steps run eagerly
            logger.exception("CUDA graph capture of mixed steps failed; steps with prompt work run eagerly")
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.mixed_graphs.clear()
            self.mixed_batches.clear()
        if self.mixed_graphs:
            logger.info("captured CUDA graphs of mixed steps: %s tokens, up to %d sequences",
                        sorted(self.mixed_graphs), self.mixed.max_seqs)

    def mixed_bucket_for(self, out: SchedulerOutput) -> int | None:
        """The mixed graph's token bucket for this step, or None (it runs eagerly, or as a decode graph)."""
        if not self.mixed_graphs or not out.scheduled:
            return None
        for s in out.scheduled:
            if s.draft_token_ids or s.seq.params.prompt_logprobs is not None:
                return None
        tokens = next((b for b in self.mixed_buckets if b >= out.num_batched_tokens), None)
        return tokens if tokens is not None and self.mixed.fits(out, tokens) else None

    def run_mixed(self, out: SchedulerOutput, tokens: int, patch_inflight=None) -> GraphReplay:
        """A step replayed from the mixed graph of `tokens` rows (from mixed_bucket_for): logits has one row per
        scheduled sequence (its last row), in order."""
        inflight = self.mixed.fill(out, tokens, self.block_size)
        if inflight and patch_inflight is not None:
            patch_inflight(self.mixed.input_ids, inflight)
        self.mixed_graphs[tokens].replay()
        self.num_mixed_replays += 1
        return GraphReplay(self.logits[:len(out.scheduled)], None, self.mixed_batches[tokens], inflight)

    def _record(self, size: int, batch: ForwardBatch, decode: bool = False, turn: int | None = None
                ) -> torch.cuda.CUDAGraph:
        """The CUDA graph of one forward of `batch`, its outputs copied into the static buffers (_forward; `decode`:
        a decode graph, on the static decode inputs; mapped: of host buffer `turn`, warmed up on the scratch one)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(self.device)
        stream, current = self._stream, torch.cuda.current_stream(self.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            self._forward(batch, size, decode)      # warm-up: compiles Triton kernels outside the capture
        current.wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=stream):
            self._forward(batch, size, decode, turn)
        current.wait_stream(stream)
        return graph

    @torch.inference_mode()
    def _capture_late(self, key: tuple[int, int]) -> None:
        t0 = time.perf_counter()
        # The capture's warm-up runs the argmax into `tokens`, which may hold the in-flight tokens this step patches.
        carried = self.tokens.clone() if self.tokens is not None else None
        self._capture(*key)
        if carried is not None:
            self.tokens.copy_(carried)
        logger.info("captured the CUDA graph of batch size %d, %d keys, in %.2f s (first step that needed it)",
                    key[0], key[1], time.perf_counter() - t0)

    def graph(self, size: int) -> torch.cuda.CUDAGraph:
        """The first bucket's graph of `size` (what a verification-cost curve times)."""
        return self.graphs[size, self.buckets[0]]

    def size_for(self, out: SchedulerOutput) -> tuple[int, int] | None:
        """The graph key (padded size, context bucket) for this step, or None when it must run eagerly."""
        if not self.graphs or not out.scheduled:
            return None
        rows = longest = 0
        for s in out.scheduled:     # one pass: every row a decode row, and the step's rows and longest sequence
            if s.num_new_tokens - len(s.draft_token_ids) != 1 or s.seq.params.prompt_logprobs is not None:
                return None
            rows += s.num_new_tokens
            longest = max(longest, s.start + s.num_new_tokens)
        size = padded_size(rows, self.sizes)
        if size is None:
            return None
        bucket = next((b for b in self.buckets if b >= longest), None)
        return None if bucket is None else (size, bucket)

    def run(self, out: SchedulerOutput, key: tuple[int, int], patch_inflight=None,
            carried: dict[int, int] | None = None) -> GraphReplay:
        """A decode-only step (a row per sequence and per draft it verifies, in order) replayed from the graph of
        `key` (from size_for). `patch_inflight(input_ids, rows)` fills rows whose token is still on the device
        before the replay, except those of sequences in `carried` (seq_id -> row of `tokens`: the previous
        decode replay's argmax, which was that step's sample), which the replay patches itself."""
        if key not in self.graphs:
            self._capture_late(key)         # before fill: capturing overwrites the static inputs
        inflight = self.inputs.fill(out, key[0], self.block_size, carried if self.tokens is not None else None)
        turn = self.inputs.turn
        if inflight and patch_inflight is not None:
            if self.mapped:     # through the token buffer: the replay's load would overwrite input_ids
                self.inputs.take_tokens_from_buffer(inflight)
                patch_inflight(self.tokens, inflight)
            else:
                patch_inflight(self.inputs.input_ids, inflight)
        (self.turn_graphs[key] if self.mapped and turn == 1 else self.graphs[key]).replay()
        self.num_replays += 1
        rows = self.inputs.num_rows
        return GraphReplay(self.logits[:rows], self.hidden[:rows] if self.hidden is not None else None,
                           self.batches[key], inflight, self.tokens[:rows] if self.tokens is not None else None,
                           self.host_tokens[turn][:rows] if self.mapped else None)


__all__ = ["CUDAGraphRunner", "GraphReplay", "StaticDecodeInputs", "context_buckets", "default_capture_sizes",
           "padded_size"]
