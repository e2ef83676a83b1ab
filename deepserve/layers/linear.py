"""Linear layers: `F.linear`, except for one activation row on the GPU (batch-1 decode), where a Triton GEMV reads
the weight faster than cuBLAS does (deepserve/kernels/gemv.py has the measurements).

Models build `Linear` (an nn.Linear: loading, quantization and `isinstance` checks see no difference) and call
`linear()` where they multiply by a weight they do not own as a module (a tied LM head).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepserve.layers.kernel_dispatch import use_triton

_GEMV_DTYPES = (torch.bfloat16, torch.float16)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if (x.dim() == 2 and x.shape[0] == 1 and x.dtype == weight.dtype and weight.dtype in _GEMV_DTYPES
            and (bias is None or bias.dtype == weight.dtype) and use_triton(x) and not torch.is_grad_enabled()):
        from deepserve.kernels.gemv import gemv
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
