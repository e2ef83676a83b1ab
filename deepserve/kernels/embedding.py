"""Embedding rows gathered on the GPU for a decode step: out[r] = weight[ids[r]].

torch's index_select is not launched with programmatic dependent launch (kernels/pdl.py), so the first layer's
fused qkv GEMV, which loads its weight tile before its PDL wait, could only start once the gather had ended. This
gather is PDL-launched: it waits for the kernel that wrote the ids (a CUDA graph patches in-flight tokens), lets
the next kernel in at once, and copies each row in a few programs. An id outside the table gives a row of zeros
(the engine checks prompt ids against the vocabulary before they reach a step).
"""

from __future__ import annotations

import torch

from deepserve.kernels import cdiv, require_triton, tl, triton
from deepserve.kernels.pdl import pdl_launch_args, pdl_launch_dependents, pdl_wait

_BLOCK = 1024      # elements of a row per program: a 2048-wide bf16 row is two programs of 2 KB


@triton.jit
def _embedding_kernel(ids_ptr, weight_ptr, out_ptr, vocab, hidden, stride_w, stride_o, BLOCK: tl.constexpr,
                      USE_PDL: tl.constexpr):
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    token = tl.load(ids_ptr + row).to(tl.int64)
    valid = (token >= 0) & (token < vocab)
    values = tl.load(weight_ptr + tl.where(valid, token, 0) * stride_w + cols, mask=cols < hidden, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, tl.where(valid, values, 0.0).to(values.dtype), mask=cols < hidden)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """ids [T] (integers) and weight [V, H] (rows contiguous) -> [T, H] = weight[ids] (zeros for ids outside
    [0, V))."""
    require_triton(weight)
    assert ids.dim() == 1 and weight.dim() == 2 and weight.stride(1) == 1
    vocab, hidden = weight.shape
    out = torch.empty(ids.shape[0], hidden, dtype=weight.dtype, device=weight.device)
    if ids.shape[0] == 0:
        return out
    _embedding_kernel[(ids.shape[0], cdiv(hidden, _BLOCK))](
        ids, weight, out, vocab, hidden, weight.stride(0), out.stride(0), BLOCK=_BLOCK, **pdl_launch_args(weight))
    return out


def embedding_ref(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    valid = (ids >= 0) & (ids < weight.shape[0])
    return torch.where(valid[:, None], weight[ids.clamp(0, weight.shape[0] - 1)], 0)


__all__ = ["embedding", "embedding_ref"]
