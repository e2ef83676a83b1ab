"""Launches beside the current CUDA stream: `fork` to a side stream, `join` back.

Why: some launches of a layer do not depend on the ones before them and leave most SMs idle. A MoE layer's shared
experts need only the layer's input, while its router (the gate GEMM, the routing, the expert alignment: short
launches on few SMs) runs first on the main stream; on a side stream the shared experts' GEMMs fill the idle SMs.

`fork(device)` makes the side stream wait for everything launched so far on the current stream and makes it
current inside the `with`; `join(device)` makes the current stream wait for everything launched on the side stream
so far, and must come before anything reads the side launches' outputs. Inside a CUDA graph capture the two become
the graph's edges (the side stream joins the capture at the fork; the join before the capture ends brings it
back), so a replay runs both branches at once. Off CUDA (the CPU path) there is no side stream: `available` is
False and callers launch in order.

Memory needs no `record_stream`: every side launch comes after a fork (which waits for the main stream's work so
far, the producers of its inputs included) and the main stream reads its outputs only after a join. The caching
allocator hands a freed block only to later allocations on the stream that made it, which come after the next
fork or join: a block is never rewritten while the other stream may still read it.

PDL (kernels/pdl.py) keeps its rules across a fork or join: every kernel waits for all of its predecessors before
it reads what they wrote, and reads only weights and the step's inputs before that.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

_STREAMS: dict[int, torch.cuda.Stream] = {}


def available(device: torch.device) -> bool:
    """Whether `device` is a CUDA device (a side stream exists there)."""
    return device.type == "cuda"


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream of `device` (made on first use, shared by every layer: each forks and joins in turn)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _STREAMS:
        _STREAMS[index] = torch.cuda.Stream(device=index)
    return _STREAMS[index]


@contextlib.contextmanager
def fork(device: torch.device) -> Iterator[torch.cuda.Stream]:
    """Launches inside the `with` go on the side stream, after everything launched so far on the current stream."""
    side = side_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        yield side


def join(device: torch.device) -> None:
    """The current stream's later launches wait for everything launched on the side stream so far."""
    torch.cuda.current_stream(device).wait_stream(side_stream(device))


__all__ = ["available", "fork", "join", "side_stream"]
