"""The in-flight token patch inside a decode CUDA graph: input_ids[r] = tokens[token_src[r]] where token_src[r] >= 0.

With overlapped scheduling a decode row's input token may not have reached the host yet: the previous step sampled it
on the device. When that step's tokens are the argmax its own replay left in the graphs' token buffer
(worker/cuda_graph.py, DEEPSERVE_GRAPH_TOKENS), the next replay patches them in as its first launch, reading the
row each token came from in the step's static inputs (token_src, -1: the host's token stands). One launch of one
program, where the patch outside the graph is a device copy (or an index upload and two index kernels) queued
between two replays.
"""

from __future__ import annotations

import torch

from deepserve.kernels import next_pow2, require_triton, tl, triton


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


__all__ = ["patch_tokens", "patch_tokens_ref"]
