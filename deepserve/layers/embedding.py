"""The token embedding: nn.Embedding whose decode steps on the GPU gather through kernels/embedding.py (a
PDL-launched gather, so the first layer's GEMV starts during it); everything else runs F.embedding."""

from __future__ import annotations

import torch
from torch import nn

from deepserve.layers.kernel_dispatch import use_triton

# Up to this many rows (the largest decode CUDA graph) a step gathers with the Triton kernel; prompt steps keep
# torch's.
TRITON_MAX_ROWS = 512


class Embedding(nn.Embedding):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if (use_triton(self.weight) and ids.dim() == 1 and ids.shape[0] <= TRITON_MAX_ROWS
                and not torch.is_grad_enabled() and self.weight.stride(1) == 1):
            from deepserve.kernels.embedding import embedding
            return embedding(ids, self.weight)
        return super().forward(ids)


__all__ = ["Embedding", "TRITON_MAX_ROWS"]
