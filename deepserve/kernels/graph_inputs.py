"""Kernels that finish a decode CUDA graph's static inputs inside the graph (worker/cuda_graph.py), as its first
launches.

The in-flight token patch: input_ids[r] = tokens[token_src[r]] where token_src[r] >= 0. With overlapped scheduling
a decode row's input token may not have reached the host yet: the previous step sampled it on the device. When that
step's tokens are the argmax its own replay left in the graphs' token buffer (DEEPSERVE_GRAPH_TOKENS), the next
replay patches them in itself, reading the row each token came from in the step's static inputs (token_src, -1: the
host's token stands). One launch of one program, where the patch outside the graph is a device copy (or an index
upload and two index kernels) queued between two replays.

The block tables' unpacking: the host copies the step's tables packed at the step's width (its longest table:
[rows, width], DEEPSERVE_COMPACT_BLOCK_TABLES; the shape rides along), and this spreads them into the [rows,
max_blocks] tables the kernels read (a decode graph's rows, a mixed graph's scheduled sequences), whose width is
fixed by max_model_len (8,192 entries a row at a 128k context and 16-token blocks: 16 MB a step at batch 256 over
PCIe, for sequences that may hold a few dozen blocks). Entries past a row's width keep what earlier steps left
there: no kernel reads past a sequence's own blocks.

The inputs read from the host (DEEPSERVE_MAPPED_STEP_IO): instead of a host-to-device copy queued before the replay,
the graph's first launch reads the step's inputs from the pinned host buffer itself (mapped into the GPU's address
space, read over PCIe), a program a row: its column entries, its token patched in, its packed tables spread into
place. The copy engine's operation and its hand-over to the graph's first kernel leave the device's queue.
"""

from __future__ import annotations

import torch

from deepserve.kernels import next_pow2, require_triton, tl, triton

UNPACK_BLOCK = 1024


@triton.jit
def _patch_tokens_kernel(ids_ptr, src_ptr, tokens_ptr, n, BLOCK: tl.constexpr):
    r = tl.arange(0, BLOCK)
    ok = r < n
    src = tl.load(src_ptr + r, mask=ok, other=-1)
    carried = src >= 0
    token = tl.load(tokens_ptr + src, mask=ok & carried, other=0)
    ids = tl.load(ids_ptr + r, mask=ok & ~carried, other=0)
    tl.store(ids_ptr + r, tl.where(carried, token, ids), mask=ok)


def patch_tokens(input_ids: torch.Tensor, token_src: torch.Tensor, tokens: torch.Tensor) -> None:
    """In place: input_ids[r] = tokens[token_src[r]] for the rows with token_src[r] >= 0 (int64 tensors, one row
    each, input_ids and token_src of the same length)."""
    require_triton(input_ids)
    n = input_ids.shape[0]
    assert token_src.shape == (n,) and input_ids.is_contiguous() and token_src.is_contiguous()
    if n:
        _patch_tokens_kernel[(1,)](input_ids, token_src, tokens, n, BLOCK=max(16, next_pow2(n)), num_warps=1)


def patch_tokens_ref(input_ids: torch.Tensor, token_src: torch.Tensor, tokens: torch.Tensor) -> None:
    carried = token_src >= 0
    input_ids.copy_(torch.where(carried, tokens[token_src.clamp(min=0)], input_ids))


@triton.jit
def _unpack_tables_kernel(packed_ptr, shape_ptr, out_ptr, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    rows = tl.load(shape_ptr)
    width = tl.load(shape_ptr + 1)
    if row < rows:
        for c0 in range(0, width, BLOCK):
            c = c0 + tl.arange(0, BLOCK)
            ok = c < width
            tl.store(out_ptr + row * stride_out + c, tl.load(packed_ptr + row * width + c, mask=ok), mask=ok)


def unpack_tables(packed: torch.Tensor, shape: torch.Tensor, out: torch.Tensor) -> None:
    """out[r, :w] = packed[r * w:(r + 1) * w] for the rows r < n of out ([R, max_blocks], unit stride along a row),
    (n, w) = shape (a two-element int64 tensor on the device: the graph reads it at every replay; n <= R)."""
    require_triton(out)
    assert out.dim() == 2 and out.stride(1) == 1 and packed.is_contiguous() and shape.numel() == 2
    if out.shape[0]:
        _unpack_tables_kernel[(out.shape[0],)](packed, shape, out, out.stride(0), BLOCK=UNPACK_BLOCK, num_warps=4)


def unpack_tables_ref(packed: torch.Tensor, shape: torch.Tensor, out: torch.Tensor) -> None:
    n, w = shape.tolist()
    out[:n, :w] = packed[:n * w].view(n, w)


@triton.jit
def _load_inputs_kernel(host_ptr, dev_ptr, tables_ptr, tokens_ptr, rows_per_column, tables_start, max_blocks,
                        COLUMNS: tl.constexpr, IDS_COLUMN: tl.constexpr, SRC_COLUMN: tl.constexpr,
                        TABLES_PER_ROW: tl.constexpr, BLOCK: tl.constexpr):
    """Row `program_id` of a step's inputs from the host buffer (layout: worker/cuda_graph.py StaticDecodeInputs,
    tables packed at the step's width) into the device buffer and the unpacked tables, its input token patched."""
    row = tl.program_id(0)
    c = tl.arange(0, 8)
    ok = c < COLUMNS
    values = tl.load(host_ptr + c * rows_per_column + row, mask=ok, other=0)     # one PCIe round trip for all
    shape = tl.load(host_ptr + tables_start - 2 + tl.arange(0, 2))
    src = tl.sum(tl.where(c == SRC_COLUMN, values, 0), 0)
    token = tl.load(tokens_ptr + tl.maximum(src, 0))
    values = tl.where((c == IDS_COLUMN) & (src >= 0), token, values)
    tl.store(dev_ptr + c * rows_per_column + row, values, mask=ok)
    if row == 0:
        tl.store(dev_ptr + tables_start - 2 + tl.arange(0, 2), shape)
    width = tl.sum(tl.where(tl.arange(0, 2) == 1, shape, 0), 0)
    for t in tl.static_range(TABLES_PER_ROW):
        table = (row * TABLES_PER_ROW + t).to(tl.int64)
        for c0 in range(0, width, BLOCK):
            col = c0 + tl.arange(0, BLOCK)
            in_row = col < width
            entries = tl.load(host_ptr + tables_start + table * width + col, mask=in_row)
            tl.store(tables_ptr + table * max_blocks + col, entries, mask=in_row)


def load_inputs(host: torch.Tensor, device: torch.Tensor, tables: torch.Tensor, tokens: torch.Tensor, size: int,
                rows_per_column: int, columns: int, tables_start: int, ids_column: int, src_column: int) -> None:
    """A decode step's inputs for rows < `size` from `host` (pinned, int64, StaticDecodeInputs' layout with the
    tables packed at the step's width: its shape at tables_start - 2) into `device` (the same layout; the columns and
    the shape) and `tables` ([max_batch, tables a row, max_blocks] int64, the unpacked tables), each row's input id
    replaced by tokens[its token source] where that source is >= 0 (`patch_tokens`). One launch of `size`
    programs."""
    require_triton(device)
    assert columns <= 8 and host.dtype == device.dtype == tables.dtype == tokens.dtype == torch.int64
    assert tables.is_contiguous() and tables.shape[0] >= size
    if size:
        _load_inputs_kernel[(size,)](host, device, tables, tokens, rows_per_column, tables_start, tables.shape[-1],
                                     COLUMNS=columns, IDS_COLUMN=ids_column, SRC_COLUMN=src_column,
                                     TABLES_PER_ROW=tables.shape[1], BLOCK=256, num_warps=1)


def load_inputs_ref(host: torch.Tensor, device: torch.Tensor, tables: torch.Tensor, tokens: torch.Tensor, size: int,
                    rows_per_column: int, columns: int, tables_start: int, ids_column: int, src_column: int) -> None:
    for c in range(columns):
        device[c * rows_per_column:c * rows_per_column + size] = host[c * rows_per_column:c * rows_per_column + size]
    device[tables_start - 2:tables_start] = host[tables_start - 2:tables_start]
    ids = device[ids_column * rows_per_column:ids_column * rows_per_column + size]
    patch_tokens_ref(ids, device[src_column * rows_per_column:src_column * rows_per_column + size], tokens)
    width = int(host[tables_start - 1])
    n = size * tables.shape[1]
    tables.view(-1, tables.shape[-1])[:n, :width] = host[tables_start:tables_start + n * width].view(n, width)


__all__ = ["load_inputs", "load_inputs_ref", "patch_tokens", "patch_tokens_ref", "unpack_tables", "unpack_tables_ref"]
