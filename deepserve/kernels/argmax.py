"""Row-wise argmax over a vocabulary-sized row: the greedy sampler's pick on the GPU.

torch's argmax reduces one row in one thread block: at batch 1 a 128k-entry float32 row takes ~28 us on an
H200, longer than a transformer layer's matmuls. Here each row is cut into BLOCK-wide pieces reduced by separate
programs (value and first index of the maximum), and a second launch picks the best piece per row.

Ties go to the lowest index, as torch.argmax; a row of -inf gives 0, as torch does. NaN is not handled like
torch (which treats NaN as the maximum): logits are finite.
"""

from __future__ import annotations

import torch

from deepserve.kernels import cdiv, next_pow2, require_triton, tl, triton
from deepserve.kernels.pdl import pdl_launch_args, pdl_launch_dependents, pdl_wait

_BLOCK = 4096
# Inside the kernels the "no index" sentinel is the literal 2147483647 (int32 max): Triton kernels may only read
# globals that are constexprs, and the CPU-only install has no Triton to make one.


@triton.jit(do_not_specialize=["num_pieces"])
def _piece_argmax_kernel(x_ptr, val_ptr, idx_ptr, stride_x, n_cols, num_pieces, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr):
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    piece = tl.program_id(1)
    cols = piece * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
    best = tl.max(x, 0)
    # Columns past the row end read -inf, but every piece starts inside the row, so a real column comes first.
    first = tl.min(tl.where(x == best, cols, 2147483647), 0)
    tl.store(val_ptr + row * num_pieces + piece, best)
    tl.store(idx_ptr + row * num_pieces + piece, first)


@triton.jit(do_not_specialize=["num_pieces"])
def _row_argmax_kernel(val_ptr, idx_ptr, out_ptr, num_pieces, BLOCK_P: tl.constexpr, USE_PDL: tl.constexpr,
                       host_out_ptr, HOST_OUT: tl.constexpr):
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, BLOCK_P)
    ok = p < num_pieces
    vals = tl.load(val_ptr + row * num_pieces + p, mask=ok, other=float("-inf"))
    idx = tl.load(idx_ptr + row * num_pieces + p, mask=ok, other=2147483647)
    best = tl.max(vals, 0)
    token = tl.min(tl.where(vals == best, idx, 2147483647), 0).to(tl.int64)
    tl.store(out_ptr + row, token)
    if HOST_OUT:        # pinned host memory too, written over PCIe: no copy to the host after the kernel
        tl.store(host_out_ptr + row, token)


def argmax_rows(x: torch.Tensor, out: torch.Tensor | None = None,
                host_out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [B, V] (unit stride along V) -> [B] int64, the first index of each row's maximum (written into `out`, a
    contiguous [B] int64 tensor, when given; and into `host_out`, a contiguous [B] int64 tensor in pinned host
    memory, when given: the host reads it once the launch's work is done, an event later)."""
    require_triton(x)
    assert x.dim() == 2 and x.stride(1) == 1
    rows, n = x.shape
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=x.device)
    assert out.shape == (rows,) and out.dtype == torch.int64 and out.is_contiguous()
    if host_out is not None:
        assert host_out.shape == (rows,) and host_out.dtype == torch.int64 and host_out.is_contiguous() \
            and host_out.is_pinned(), "host_out: a contiguous [rows] int64 tensor in pinned host memory"
    if rows == 0:
        return out
    pieces = cdiv(n, _BLOCK)
    vals = torch.empty(rows, pieces, dtype=torch.float32, device=x.device)
    idx = torch.empty(rows, pieces, dtype=torch.int32, device=x.device)
    _piece_argmax_kernel[(rows, pieces)](x, vals, idx, x.stride(0), n, pieces, BLOCK=_BLOCK, num_warps=8,
                                         **pdl_launch_args(x))
    _row_argmax_kernel[(rows,)](vals, idx, out, pieces, BLOCK_P=max(16, next_pow2(pieces)), num_warps=1,
                                 host_out_ptr=host_out if host_out is not None else out,
                                 HOST_OUT=host_out is not None, **pdl_launch_args(x))
    return out


def argmax_rows_ref(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)


__all__ = ["argmax_rows", "argmax_rows_ref"]
