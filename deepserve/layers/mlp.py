"""The dense gated MLP (SwiGLU): down(silu(gate(x)) * up(x)), gate and up fused into one GEMM."""

from __future__ import annotations

import torch
from torch import nn

from deepserve.kernels.reference.activation import swiglu
from deepserve.layers.kernel_dispatch import use_triton
from deepserve.layers.linear import Linear, fused_swiglu_linear, linear_residual
from deepserve.layers.norm import RMSNorm
from deepserve.layers.rank_group import SINGLE, RankGroup
from deepserve.layers.tensor_parallel import even_pieces, shard_column, shard_row


def copy_checked(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor)


def swiglu_activation(gate_up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """[.., 2I] (gate then up) -> silu(gate) * up; `limit` clamps gate from above and up on both sides
    (DeepSeek-V4.1's swiglu_limit). The Triton kernel on CUDA, else the PyTorch twin."""
    if limit is None and use_triton(gate_up) and not torch.is_grad_enabled():
        from deepserve.kernels.activation import silu_and_mul
        return silu_and_mul(gate_up)
    return swiglu(gate_up, limit)


class GatedMLP(nn.Module):
    """A dense SwiGLU MLP (Llama/Qwen layers, DeepSeek's dense layers and shared experts), gate and up fused."""

    def __init__(self, hidden_size: int, intermediate_size: int, swiglu_limit: float | None = None) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.swiglu_limit = swiglu_limit
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        # Tensor parallelism (shard_tensor_parallel): this rank's partial output is summed over `tp` after down_proj.
        self.tp: RankGroup = SINGLE

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(self.activation(x)))

    def forward_residual(self, h: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """h + self(norm(h)) for the residual stream h (DecoderLayer's fused GPU path): the norm runs in the
        gate/up projection's prologue, the add in down_proj's epilogue, where the kernels allow."""
        if self.tp.size > 1:            # the add comes after the all-reduce, not in down_proj's epilogue
            return h + self.forward(norm(h))
        return linear_residual(self.activation(h, norm), self.down_proj, h)

    def shard_tensor_parallel(self, tp: RankGroup, reduce: bool = True, field: str = "intermediate_size") -> None:
        """Keep this rank's 1 / tp.size of the intermediate dim: gate_up column-parallel by segments [gate | up],
        down_proj row-parallel. `reduce`: all-reduce the output here (False for the shared experts inside a FusedMoE,
        whose one all-reduce sums them with the routed experts)."""
        inter = self.intermediate_size
        pieces = even_pieces([inter, inter], tp, field)
        local = pieces[0][1]
        shard_column(self.gate_up_proj, pieces)
        shard_row(self.down_proj, (tp.rank * local, local), tp)
        self.intermediate_size = local
        self.tp = tp if reduce else SINGLE

    def activation(self, x: torch.Tensor, norm: RMSNorm | None = None) -> torch.Tensor:
        """swiglu(gate_up(x)) (of norm(x) given an RMSNorm): the down projection's input."""
        act = fused_swiglu_linear(x, self.gate_up_proj, self.swiglu_limit, norm)   # batch-1 decode on a GPU: one launch
        if act is not None:
            return act
        if norm is not None:
            x = norm(x)
        # Module calls, not F.linear on .weight: a quantized Linear may stand in for either projection.
        return swiglu_activation(self.gate_up_proj(x), self.swiglu_limit)

    def load_weight(self, name: str, tensor: torch.Tensor) -> str:
        """HF name relative to this MLP (`gate_proj.weight`, ...) -> the parameter it filled."""
        proj = name.split(".")[0]
        if proj == "down_proj":
            copy_checked(self.down_proj.weight, tensor, name)
            return "down_proj.weight"
        if proj not in ("gate_proj", "up_proj"):
            raise KeyError(f"MLP weight {name!r} has no place in {type(self).__name__}")
        shard = 0 if proj == "gate_proj" else 1
        copy_checked(self.gate_up_proj.weight.narrow(0, shard * self.intermediate_size, self.intermediate_size),
                     tensor, name)
        return "gate_up_proj.weight"
