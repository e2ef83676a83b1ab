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


__all__ = ["patch_tokens", "patch_tokens_ref", "unpack_tables", "unpack_tables_ref"]
