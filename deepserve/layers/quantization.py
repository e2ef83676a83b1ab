"""Int8 linear layers for CPU speed (opt-in), weight scales per output channel, symmetric.

- `quantization="int8"`: int8 weights, activations untouched. Batch-1 decode on a CPU is bound by reading
  the weights, a quarter of fp32's bytes here. Few rows run torch's int8-weight GEMM on bf16 activations
  (measured, 2-core AVX-512 Xeon, 3072x576 weight, 1 row: 165 us vs 355 us fp32); many rows are
  compute-bound and run in fp32 on the dequantized weight.
- `quantization="w8a8"`: as above for few rows; for many rows the activations are quantized too, one scale
  per token, and the product runs as an int8 x int8 -> int32 GEMM (`torch._int_mm`, VNNI): measured 4-5x
  faster than fp32 from 64 to 2048 rows. It costs accuracy: on the default model the mean negative
  log-likelihood of a 600-token text rose from 3.532 to 3.591 nats (int8 weight-only: 3.532). Accuracy
  tests run in fp32; benchmarks say which mode they measured.
Per-tensor activation scales (torch's dynamic-quantized Linear) were measured too and rejected: the top
logprob of a simple prompt moved from -0.56 to -2.3.

Where a kernel is missing (a GPU, an old torch) the weight is dequantized and run through an ordinary GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

QUANTIZATIONS = (None, "int8", "w8a8")

# Up to this many rows a GEMM is bound by weight bytes, and the int8-weight kernel wins.
_WEIGHT_BOUND_MAX_ROWS = 16


def _cpu_kernel_works(fn) -> bool:
    try:
        fn()
        return True
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


class Int8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, quantize_activations: bool = False) -> None:
        super().__init__()
        w = weight.detach().float()
        scales = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
        self.register_buffer("qweight", torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales)
        self.register_buffer("scales_bf16", scales.to(torch.bfloat16))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.out_features, self.in_features = weight.shape
        on_cpu = weight.device.type == "cpu"
        probe = torch.ones(17, 8, dtype=torch.int8)
        self._weight_kernel = on_cpu and _cpu_kernel_works(lambda: torch.ops.aten._weight_int8pack_mm(
            probe[:1].bfloat16(), probe[:8], torch.ones(8, dtype=torch.bfloat16)))
        self._int_mm = quantize_activations and on_cpu and _cpu_kernel_works(lambda: torch._int_mm(probe, probe[:8].t()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        flat = x.reshape(rows, self.in_features)
        if self._weight_kernel and rows <= _WEIGHT_BOUND_MAX_ROWS:
            out = torch.ops.aten._weight_int8pack_mm(flat.to(torch.bfloat16), self.qweight, self.scales_bf16)
        elif self._int_mm:
            out = self._int8_activations_matmul(flat.float())
        else:
            out = F.linear(flat, self.qweight.to(x.dtype) * self.scales.to(x.dtype)[:, None])
        out = out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def _int8_activations_matmul(self, x: torch.Tensor) -> torch.Tensor:
        # One pass each way in C (kernels/cpu/int8_quant.c, bit-identical to the PyTorch version it falls back to).
        from deepserve.kernels.cpu.int8_quant import dequantize, quantize_per_token
        xq, token_scales = quantize_per_token(x.contiguous())
        return dequantize(torch._int_mm(xq, self.qweight.t()), token_scales, self.scales)


def quantize_model(model: nn.Module, method: str | None) -> nn.Module:
    """Replace every nn.Linear (and a tied LM head) with its quantized form. Embedding lookups stay exact."""
    if method is None:
        return model
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {method!r}")
    activations = method == "w8a8"
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8Linear(child.weight, child.bias, activations))
    if getattr(model, "lm_head", "absent") is None and hasattr(model, "embed_tokens"):
        model.lm_head = Int8Linear(model.embed_tokens.weight, None, activations)
    return model
