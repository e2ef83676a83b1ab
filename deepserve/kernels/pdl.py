"""Programmatic dependent launch (PDL; Hopper and later): a kernel launched with it may start while the kernel
before it in the stream is still finishing. It waits (`pdl_wait`) before it touches anything that kernel wrote.

Why: a batch-1 decode step is 150-500 short kernels, and each one pays its launch and its first loads' latency
while the SMs drain the previous kernel's last wave. With PDL the next kernel's programs are already resident:
a GEMV loads its first weight tile (weights are never written by a kernel) during that drain, then waits.

The rules every kernel launched with PDL keeps, or it races:
1. Every program calls `pdl_wait` before it reads anything the previous kernel may have written, and before it
   writes anything. Before it, a program may read constant data (weights, norm weights, cos/sin tables) and data
   that was in place before the previous kernel started: every kernel waits before it lets its dependents start
   (rule 3), so when this one starts, the kernel before the previous one has finished and its writes are visible.
   The step's inputs (positions, slots, sequence lengths, block tables: copied in before the step's first kernel)
   are such data; launchers read them early only when their caller says so (`inputs_ready=True`, the attention
   backends), since a direct caller may have just computed them with a kernel.
2. The wait is unconditional and comes first: a program that returns early waits before returning. (A grid that
   finished without waiting could let the kernel after it overtake the kernel before it.)
3. `pdl_launch_dependents` may come anywhere after the wait; it only lets the next kernel start its own
   pre-wait part sooner. The next kernel's wait still waits for this whole grid to finish and flush.
A kernel launched without PDL (cuBLAS, torch ops) starts after the previous one finished, as always, so the
chain is safe with any mix of launches.

Launchers pass `**pdl_launch_args(tensor)`: `USE_PDL=True, launch_pdl=True` on an SM90+ GPU with a Triton that has
the option (unless DEEPSERVE_PDL=0), else `USE_PDL=False`. Kernels take `USE_PDL: tl.constexpr`.
"""

from __future__ import annotations

import functools

import torch

from deepserve import envs
from deepserve.kernels import HAS_TRITON, INTERPRET, tl, triton


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait until the previous kernel in the stream has finished and its writes are visible (no-op without PDL)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_launch_dependents(USE_PDL: tl.constexpr):
    """Let the next kernel's programs start (their pre-wait part) once every program of this grid got here."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_wait_for_inputs(INPUTS_READY: tl.constexpr, USE_PDL: tl.constexpr, EARLY_TRIGGER: tl.constexpr = True):
    """Where a kernel reads the step's inputs: the wait, unless INPUTS_READY (rule 1: the caller vouches that the
    previous kernel does not write them), in which case `pdl_wait_after_inputs` waits once they are loaded. Then
    the next kernel may start, unless not EARLY_TRIGGER: then it starts as this grid's programs exit."""
    if not INPUTS_READY:
        pdl_wait(USE_PDL)
        if EARLY_TRIGGER:
            pdl_launch_dependents(USE_PDL)


@triton.jit
def pdl_wait_after_inputs(INPUTS_READY: tl.constexpr, USE_PDL: tl.constexpr, EARLY_TRIGGER: tl.constexpr = True):
    """The deferred wait of `pdl_wait_for_inputs` (a no-op when that one waited)."""
    if INPUTS_READY:
        pdl_wait(USE_PDL)
        if EARLY_TRIGGER:
            pdl_launch_dependents(USE_PDL)


@functools.cache
def _pdl_supported(device_index: int) -> bool:
    if not HAS_TRITON or INTERPRET or not envs.DEEPSERVE_PDL:
        return False
    if torch.version.hip is not None or torch.cuda.get_device_capability(device_index)[0] < 9:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        import triton.language.extra.cuda as cuda_extra
    except ImportError:
        return False
    return "launch_pdl" in CUDAOptions.__dataclass_fields__ and hasattr(cuda_extra, "gdc_wait")   # Triton >= 3.4


def pdl_enabled(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    return _pdl_supported(device.index if device.index is not None else torch.cuda.current_device())


def pdl_launch_args(tensor: torch.Tensor) -> dict:
    """The launch keywords for a kernel taking `USE_PDL: tl.constexpr`, on `tensor`'s device."""
    return {"USE_PDL": True, "launch_pdl": True} if pdl_enabled(tensor.device) else {"USE_PDL": False}


# DEEPSERVE_EARLY_INPUTS=0: decode, reduce and rotary-write programs load the step's inputs after the PDL wait
# (an A/B switch, see benchmarks/ab_env.py; the launchers' inputs_ready arguments say where early loads are allowed
# at all, and pass `inputs_ready and EARLY_INPUTS` as INPUTS_READY).
EARLY_INPUTS = envs.DEEPSERVE_EARLY_INPUTS

__all__ = ["EARLY_INPUTS", "pdl_enabled", "pdl_launch_args", "pdl_launch_dependents", "pdl_wait",
           "pdl_wait_after_inputs", "pdl_wait_for_inputs"]
