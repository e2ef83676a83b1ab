"""Batch-invariant mode: switch a built model's layers to computations whose per-row results do not depend on the
batch (`EngineArgs(batch_invariant=True)` or DEEPSERVE_BATCH_INVARIANT=1; deepinfer.md section 9).

What varies with the batch on the CPU by default (measured; tests/engine/test_batch_invariant_mode.py): the BLAS GEMM
(MKL runs a GEMV for one row and picks other kernels, and K splits, by the row count and the thread count), and
attention (prefill rows go through SDPA, decode rows through the C decode kernel: two summation orders). Row-wise
reductions (RMSNorm's mean, log-softmax, softmax) were measured invariant on their own (tests/kernels/
test_cpu_invariant_linear.py checks them), as are the
elementwise ops (rotary, SwiGLU, residual adds) and the sampler (a pure function of a row, its seed and position).

The switch, made once at load (`make_batch_invariant`) and read by the layers, not a global:
  - every `Linear` and the tied LM head: `layers/linear.invariant_linear` (one summation order fixed by K);
  - MoE layers: the gate and every expert GEMM through it too (an expert's row count is how many tokens of the
    batch chose it); the combine sums each token's k outputs in slot order, already batch-independent. On the GPU
    the reference expert backend is kept (the fused MoE kernel picks its tiles by tokens per expert);
  - attention: the model runner builds `TorchPagedAttention(rows_as_decodes=True)`, which runs every query row,
    prefill or decode, through the decode path over its own keys (ModelRunner reads `rows_as_decodes` below);
  - on the GPU (run on an H200: tests/gpu/test_batch_invariant_gpu.py): every Linear through the fixed-tiling
    Triton matmul (kernels/invariant_matmul.py), the batch-1 GEMV fusions off (`DecoderLayer.fuses_norms`, the
    fused GEMVs of layers/linear.py), and `TritonPagedAttention(rows_as_decodes=True)` (every row through the
    unsplit decode kernel). Cost on the H200: benchmarks/batch_invariant_h200.json.
Supported: dense and MoE models with standard attention, unquantized; anything else (MLA, DeepSeek-V4.1's paged
states, int8 / w8a8) is refused with a reason.
"""

from __future__ import annotations

import torch
from torch import nn

from deepserve.layers.attention import Attention, TorchPagedAttention
from deepserve.layers.linear import Linear
from deepserve.layers.moe import FusedMoE, TorchMoE


def unsupported_reason(model: nn.Module, device: torch.device) -> str | None:
    """Why this model cannot run batch-invariant yet on `device` (None: it can)."""
    layers = model.attention_layers() if hasattr(model, "attention_layers") else []
    if not layers or not all(type(a) is Attention and type(a.backend) is TorchPagedAttention for a in layers):
        return "only standard paged attention layers are batch-invariant so far (not MLA, sliding or sparse state)"
    moe = model.moe_layers() if hasattr(model, "moe_layers") else []
    if not all(type(m) is FusedMoE and type(m.backend) is TorchMoE for m in moe):
        return "a mixture-of-experts layer without the reference expert backend"
    for name, module in model.named_modules():
        if (isinstance(module, nn.Linear) and type(module) is not Linear) or "Int8" in type(module).__name__:
            return f"{name} ({type(module).__name__}) has no batch-invariant path (quantized or foreign linear layer)"
    return None


def make_batch_invariant(model: nn.Module, device: torch.device) -> nn.Module:
    """Switch every Linear (and the tied LM head), MoE gate and expert GEMM of `model` to the batch-invariant GEMM;
    returns the model. Raises ValueError when the model has a layer without a batch-invariant path on `device`
    (`unsupported_reason`)."""
    reason = unsupported_reason(model, device)
    if reason is not None:
        raise ValueError(f"batch_invariant: {type(model).__name__}: {reason}")
    for module in model.modules():
        if type(module) is Linear:
            module.batch_invariant = True
        if type(module) is FusedMoE:
            module.gate.batch_invariant = True
            module.backend = TorchMoE(batch_invariant=True)
        if getattr(module, "fuses_norms", False):
            module.fuses_norms = False      # DecoderLayer's batch-1 GPU path (norms and adds inside GEMVs)
    model.batch_invariant = True        # CausalLM.compute_logits: the tied LM head
    return model


__all__ = ["make_batch_invariant", "unsupported_reason"]
