"""SwiGLU on a fused gate/up row: the twin of kernels/activation.py and of the GEMV epilogues in kernels/gemv.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(gate_up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """[.., 2I] (gate then up) -> silu(gate) * up; `limit` clamps gate from above and up on both sides
    (DeepSeek-V4.1's swiglu_limit)."""
    gate, up = gate_up.chunk(2, dim=-1)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    if torch.is_grad_enabled():      # autograd forbids writing into chunk() views
        return F.silu(gate) * up
    # In place on the GEMM's output: no [tokens, intermediate] temporaries.
    return F.silu(gate, inplace=True).mul_(up)


__all__ = ["swiglu"]
