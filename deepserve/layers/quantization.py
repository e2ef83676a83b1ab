"""Int8 linear layers for CPU speed (opt-in), weight scales per output channel, symmetric.

- `quantization="int8"`: int8 weights, activations untouched. Batch-1 decode on a CPU is bound by reading
  the weights, a quarter of fp32's bytes here. Few rows run torch's int8-weight GEMM on bf16 activations
  (measured, 2-core AVX-512 Xeon, 3072x576 weight, 1 row: 165 us vs 355 us fp32); many rows are
  compute-bound and run in fp32 on the dequantized weight (kept beside the int8 one: dequantizing per call
  made large batches slower than fp32).
- `quantization="w8a8"`: as above for few rows; for many rows the activations are quantized too, one scale
  per token, and the product runs as an int8 x int8 -> int32 GEMM (`torch._int_mm`, oneDNN): measured 4-5x
  faster than fp32 from 64 to 2048 rows (earlier host, ISA not recorded); on an AMX Xeon the whole path
  (quantize, GEMM, dequantize) 1.8x at 32 rows and 3.6x at 256 rows of a 576 -> 1536 layer
  (benchmarks/cpu_isa.json). It costs accuracy: on the default
  model the mean negative log-likelihood of a 600-token text rose from 3.532 to 3.591 nats (int8 weight-only:
  3.532). Accuracy tests run in fp32; benchmarks say which mode they measured.
Per-tensor activation scales (torch's dynamic-quantized Linear) were measured too and rejected: the top
logprob of a simple prompt moved from -0.56 to -2.3.

Which path runs is an `Int8Plan`, chosen once per model by `choose_plan` from the CPU's features
(kernels/cpu/isa.py): the int8 GEMM only with an int8 dot-product instruction (VNNI, AMX) and oneDNN.
Without one, torch._int_mm was measured 2.7-20x slower than fp32 (AVX2-only Zen 3: 32 rows 43 vs 16 ms,
256 rows 333 vs 17 ms); there w8a8's many rows run as int8 does, in fp32 with exact activations (logged).
That gives up a little on Intel AVX2 cores: with torch's libraries capped to AVX2 on an AMX Xeon, oneDNN's
int8 path was still 1.4-1.5x faster than fp32 (benchmarks/cpu_isa.json); the features cannot tell the two.
Timings (`time_many_row_paths`, `quantize_model(measure=True)`) can also veto the int8 GEMM, but are not
taken by default: on this shared 2-core VM under load they timed it 2-2.8x slower than fp32 on an AMX host
where it is 1.8-3.6x faster, and w8a8's numerics would then change with the machine's load at start-up.

Where a kernel is missing (a GPU, an old torch) the weight is dequantized and run through an ordinary GEMM.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from deepserve.kernels.cpu import isa

logger = logging.getLogger(__name__)

QUANTIZATIONS = (None, "int8", "w8a8")

# Up to this many rows a GEMM is bound by weight bytes, and the int8-weight kernel wins.
_WEIGHT_BOUND_MAX_ROWS = 16
# torch 2.13's _weight_int8pack_mm crashes or returns wrong sums when in_features is not a multiple of 16
# (AVX-512 build; 8 with AVX2): such layers run their few rows in fp32 instead.
_WEIGHT_KERNEL_K_MULTIPLE = 16
# Row counts the start-up timing measures: the smallest many-row step, a decode batch, a prefill chunk.
TIMED_ROWS = (17, 32, 256)

# Paths: "int8_weight" = torch's int8-weight kernel on bf16 activations; "int_mm" = per-token int8
# activations x int8 weights -> int32, dequantized; "fp32" = fp32 GEMM on the dequantized weight.
FEW_ROW_PATHS = ("int8_weight", "fp32")
MANY_ROW_PATHS = ("int_mm", "fp32")


@dataclass(frozen=True)
class Int8Plan:
    few_rows: str          # up to _WEIGHT_BOUND_MAX_ROWS rows
    many_rows: str
    reason: str            # why many_rows is what it is (logged once per model)

    def __post_init__(self) -> None:
        if self.few_rows not in FEW_ROW_PATHS or self.many_rows not in MANY_ROW_PATHS:
            raise ValueError(f"unknown int8 path in {self}")


FP32_PLAN = Int8Plan("fp32", "fp32", "no int8 kernels (not a CPU)")


def choose_plan(method: str, features: isa.CpuFeatures, timings: dict[str, dict[int, float]] | None = None, *,
                weight_kernel: bool = True, int_mm: bool = True) -> Int8Plan:
    """The paths for `method` ("int8" | "w8a8") on a CPU with `features`: a pure function, so tests can pass
    any feature set. `timings`: seconds per many-row path per row count (`time_many_row_paths`), measured on
    the model's shapes; `weight_kernel` / `int_mm`: whether torch has those kernels at all."""
    few = "int8_weight" if weight_kernel else "fp32"
    if method == "int8":
        return Int8Plan(few, "fp32", "int8 keeps activations exact: many rows run fp32 on the dequantized weight")
    if method != "w8a8":
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {method!r}")
    fallback = "many rows run as int8 does, fp32 on the dequantized weight with exact activations"
    if not int_mm:
        return Int8Plan(few, "fp32", f"torch._int_mm is missing: {fallback}")
    if not features.int8_dot:
        return Int8Plan(few, "fp32", f"{features.model} ({features.source}) has no int8 dot-product instruction "
                                     f"(VNNI/AMX), where torch._int_mm ran 2.7-20x slower than fp32: {fallback}")
    if timings:
        ratios = {rows: timings["int_mm"][rows] / timings["fp32"][rows] for rows in sorted(timings["fp32"])}
        shown = ", ".join(f"{rows} rows {r:.2f}x" for rows, r in ratios.items())
        if any(r >= 1.0 for r in ratios.values()):
            return Int8Plan(few, "fp32", f"int8 GEMM time / fp32 time measured at start-up: {shown}: {fallback}")
        return Int8Plan(few, "int_mm", f"int8 GEMM time / fp32 time measured at start-up: {shown}")
    return Int8Plan(few, "int_mm", f"{features.model} ({features.source}) has an int8 dot-product instruction")


def _cpu_kernel_works(fn) -> bool:
    try:
        fn()
        return True
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


@functools.lru_cache(maxsize=None)
def torch_kernels() -> tuple[bool, bool]:
    """(int8-weight kernel, a fast torch._int_mm) in this torch's CPU build; probed once on shapes they take.
    Without oneDNN, torch._int_mm runs a plain C++ loop: present, but no candidate."""
    probe = torch.ones(17, 16, dtype=torch.int8)
    weight = _cpu_kernel_works(lambda: torch.ops.aten._weight_int8pack_mm(
        probe[:1].bfloat16(), probe[:16], torch.ones(16, dtype=torch.bfloat16)))
    onednn = torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
    return weight, onednn and _cpu_kernel_works(lambda: torch._int_mm(probe, probe[:16].t()))


class Int8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, quantize_activations: bool = False,
                 plan: Int8Plan | None = None) -> None:
        super().__init__()
        w = weight.detach().float()
        scales = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
        self.register_buffer("qweight", torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales)
        self.register_buffer("scales_bf16", scales.to(torch.bfloat16))
        self.register_buffer("weight_fp32", None)    # the dequantized weight, held only when a path needs it
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.out_features, self.in_features = weight.shape
        self.on_cpu = weight.device.type == "cpu"
        if plan is None:
            plan = default_plan("w8a8" if quantize_activations else "int8", self.on_cpu)
        self.set_plan(plan)

    def set_plan(self, plan: Int8Plan) -> None:
        """Run `plan`'s paths from now on; a path this layer cannot take (not a CPU, a shape the int8-weight
        kernel gets wrong) becomes fp32."""
        weight_kernel = self.on_cpu and self.in_features % _WEIGHT_KERNEL_K_MULTIPLE == 0
        few = plan.few_rows if weight_kernel else "fp32"
        many = plan.many_rows if self.on_cpu else "fp32"
        self.plan, self.few_rows, self.many_rows = plan, few, many
        if "fp32" in (few, many):
            if self.weight_fp32 is None:
                self.weight_fp32 = self.qweight.float() * self.scales[:, None]
        else:
            self.weight_fp32 = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        path = self.few_rows if rows <= _WEIGHT_BOUND_MAX_ROWS else self.many_rows
        out = self.run(path, x.reshape(rows, self.in_features))
        out = out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def run(self, path: str, flat: torch.Tensor) -> torch.Tensor:
        """flat [rows, in_features] @ the weight through `path` (no bias); its dtype is the path's own."""
        if path == "int8_weight":
            return torch.ops.aten._weight_int8pack_mm(flat.to(torch.bfloat16), self.qweight, self.scales_bf16)
        if path == "int_mm":
            return self._int8_activations_matmul(flat.float())
        w = self.weight_fp32
        if w is None:
            raise RuntimeError("this layer's plan holds no fp32 weight (see set_plan)")
        return F.linear(flat, w if w.dtype == flat.dtype else w.to(flat.dtype))

    def _int8_activations_matmul(self, x: torch.Tensor) -> torch.Tensor:
        # One pass each way in C (kernels/cpu/int8_quant.c, bit-identical to the PyTorch version it falls back to).
        from deepserve.kernels.cpu.int8_quant import dequantize, quantize_per_token
        xq, token_scales = quantize_per_token(x.contiguous())
        return dequantize(torch._int_mm(xq, self.qweight.t()), token_scales, self.scales)


def default_plan(method: str, on_cpu: bool = True, features: isa.CpuFeatures | None = None,
                 timings: dict[str, dict[int, float]] | None = None) -> Int8Plan:
    if not on_cpu:
        return FP32_PLAN
    weight_kernel, int_mm = torch_kernels()
    return choose_plan(method, isa.current() if features is None else features, timings,
                       weight_kernel=weight_kernel, int_mm=int_mm)


def time_many_row_paths(shapes: list[tuple[int, int]], rows: tuple[int, ...] = TIMED_ROWS,
                        repeats: int = 3) -> dict[str, dict[int, float]]:
    """Seconds of one pass over `shapes` ((out, in) per weight) for each many-row path at each row count, best
    of `repeats` after a warm-up (other processes only ever add time), the paths taking turns so that a burst
    of load hits both: what `choose_plan` takes as timings. Random values: a GEMM's speed does not depend on
    them."""
    gen = torch.Generator().manual_seed(0)
    layers = [Int8Linear(torch.randn(n, k, generator=gen), None, plan=Int8Plan("fp32", "fp32", "timing"))
              for n, k in shapes]
    timings: dict[str, dict[int, float]] = {path: {} for path in MANY_ROW_PATHS}
    with torch.inference_mode():
        for m in rows:
            inputs = [torch.randn(m, layer.in_features, generator=gen) for layer in layers]
            best = dict.fromkeys(MANY_ROW_PATHS, float("inf"))
            for rep in range(repeats + 1):
                for path in MANY_ROW_PATHS:
                    start = time.perf_counter()
                    for layer, x in zip(layers, inputs):
                        layer.run(path, x)
                    if rep:                                  # the first turn is the warm-up
                        best[path] = min(best[path], time.perf_counter() - start)
            for path in MANY_ROW_PATHS:
                timings[path][m] = best[path]
    return timings


def quantize_model(model: nn.Module, method: str | None, features: isa.CpuFeatures | None = None,
                   measure: bool = False) -> nn.Module:
    """Replace every nn.Linear (and a tied LM head) with its quantized form. Embedding lookups stay exact.

    One plan for the whole model, from `features` (default: this CPU's, `isa.current()`). `measure`: when w8a8
    would run the int8 GEMM, first time it against fp32 on the model's layer shapes and keep it only if it won
    at every timed size (tens of ms; off by default: see the module docstring)."""
    if method is None:
        return model
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {method!r}")
    activations = method == "w8a8"
    linears = [(parent, name, child) for parent in list(model.modules())
               for name, child in list(parent.named_children()) if isinstance(child, nn.Linear)]
    on_cpu = all(child.weight.device.type == "cpu" for _, _, child in linears)
    features = isa.current() if features is None else features
    plan = default_plan(method, on_cpu, features)
    if measure and plan.many_rows == "int_mm" and linears:
        # The LM head is left out: it only sees one row per sequence, never a prefill chunk.
        shapes = sorted({tuple(child.weight.shape) for _, name, child in linears if name != "lm_head"})
        plan = default_plan(method, on_cpu, features, time_many_row_paths(shapes or [(64, 64)]))
    # A w8a8 that runs no int8 GEMM is not what was asked for: say so where default logging shows it.
    level = logging.WARNING if activations and plan.many_rows != "int_mm" else logging.INFO
    logger.log(level, "%s: few rows run %s, many rows run %s (%s)", method, plan.few_rows, plan.many_rows, plan.reason)
    for parent, name, child in linears:
        setattr(parent, name, Int8Linear(child.weight, child.bias, activations, plan))
    if getattr(model, "lm_head", "absent") is None and hasattr(model, "embed_tokens"):
        model.lm_head = Int8Linear(model.embed_tokens.weight, None, activations, plan)
    return model
