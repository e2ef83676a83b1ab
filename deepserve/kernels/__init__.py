"""Triton kernels for the GPU fast path. Each lives beside its PyTorch reference (the "slow twin") with the
same signature; tests/gpu compares the two on random inputs.

Importing this package (or any kernel module) never needs Triton or CUDA: without Triton the kernels are
plain undecorated functions that are never launched, and every launcher raises a clear error. The CPU path
of the engine does not use the Triton modules; its own kernels (plain C through ctypes) live in `kernels/cpu`.

    HAS_TRITON       Triton imported
    INTERPRET        TRITON_INTERPRET=1: kernels run on CPU tensors through Triton's interpreter (slow; local checks)
    USE_LIBDEVICE    libdevice's exp (CUDA's accurate expf, what PyTorch uses) is available to kernels
"""

from __future__ import annotations

import os

try:  # pragma: no cover - depends on the machine
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

    class _JitStub:
        """Stands in for `triton`: `@triton.jit` leaves the function as it is (it is never launched)."""

        @staticmethod
        def jit(fn=None, **_kwargs):
            return fn if fn is not None else (lambda f: f)

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()

    class _LangStub:
        constexpr = object   # only used as an annotation

    triton = _JitStub()
    tl = _LangStub()

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

libdevice = None
if HAS_TRITON and not INTERPRET:  # the interpreter has no libdevice
    try:
        from triton.language.extra import libdevice  # noqa: F811  (Triton >= 3.0)
    except ImportError:  # pragma: no cover
        try:
            from triton.language.extra.cuda import libdevice  # noqa: F811
        except ImportError:
            libdevice = None
USE_LIBDEVICE = libdevice is not None


class TritonUnavailableError(RuntimeError):
    pass


def require_triton(tensor=None) -> None:
    """Raise a clear error when a kernel cannot run here (no Triton, or a CPU tensor outside the interpreter)."""
    if not HAS_TRITON:
        raise TritonUnavailableError("Triton is not installed: the GPU kernels cannot run; use the PyTorch reference")
    if tensor is not None and tensor.device.type != "cuda" and not INTERPRET:
        raise TritonUnavailableError(f"Triton kernels need CUDA tensors (got {tensor.device}); "
                                     "set TRITON_INTERPRET=1 to run them on the CPU through the interpreter")


@triton.jit
def and_scalar(mask, flag):
    """`mask & flag` for a scalar boolean `flag` (a row's "writes at all", a loop's "a next row exists"). On a GPU
    the two are the same; Triton 3.9's interpreter broadcasts a scalar boolean to int32 in `&`, a mask tl.load and
    tl.store refuse, where a select keeps the boolean."""
    return tl.where(flag, mask, False)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


_NUM_SMS: dict = {}


def num_sms(device) -> int:
    """Streaming multiprocessors of a torch.device (8 for a CPU one: the interpreter's stand-in), read once."""
    if device.type != "cuda":
        return 8
    import torch
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


__all__ = ["HAS_TRITON", "INTERPRET", "USE_LIBDEVICE", "TritonUnavailableError", "and_scalar", "require_triton",
           "triton", "tl", "libdevice", "next_pow2", "cdiv", "num_sms"]
