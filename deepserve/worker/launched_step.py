"""A decode step queued on the device (overlapped scheduling, engine/engine.py): its sampled tokens stay on the
device, where the next step's rows read them before the host has seen them (`patch_inflight_tokens`), and reach the
host through an asynchronous copy (`to_host`) that the engine collects a step later."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from deepserve.layers.sampler import SamplerOutput
    from deepserve.spec_decode.dspark import DSparkDraft
    from deepserve.spec_decode.mtp import MTPDraft
    from deepserve.spec_decode.verifier import VerifyResult
    from deepserve.worker.scheduler_output import ScheduledSequence

# (token id, logprob, top-k ids, top-k logprobs): one position's log-probabilities, plain Python.
TokenLogprobs = tuple[int, float, list[int], list[float]]


@dataclass
class LaunchedStep:
    """A step queued on the device. Its sampled tokens stay on the device for the next step's inputs and are
    copied to the host asynchronously; `ready` fires when that copy has landed."""
    seqs: list = field(default_factory=list)                 # sequences that sample, in row order
    row_of: dict[int, int] = field(default_factory=dict)     # seq_id -> row in device_tokens
    device_tokens: torch.Tensor | None = None
    host: SamplerOutput | None = None
    ready: "torch.cuda.Event | None" = None
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    verified: "tuple[list[ScheduledSequence], VerifyResult] | None" = None   # sequences that verified drafts
    mtp_drafts: "dict[int, MTPDraft | DSparkDraft]" = field(default_factory=dict)   # seq_id -> next step's
    # device_tokens are the decode graphs' token buffer (worker/cuda_graph.py, carry_tokens): valid until the next
    # decode replay, which patches them in itself.
    carried: bool = False


def to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    """A device tensor's copy into pinned host memory, started without waiting (a CPU tensor as it is)."""
    if t is None or t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def patch_inflight_tokens(input_ids: torch.Tensor, rows: list[tuple[int, int]], previous: LaunchedStep | None) -> None:
    """input_ids[row] = the token `previous` sampled for that row's sequence, copied on the device."""
    if not rows:
        return
    if previous is None or previous.device_tokens is None:
        raise RuntimeError("a step reads an in-flight token but no launched step holds it")
    row_of = previous.row_of
    n = len(rows)
    if all(r == i and row_of[seq_id] == i for i, (r, seq_id) in enumerate(rows)):
        # A steady decode: row i reads what the previous step sampled in its row i (the same sequences in the same
        # order). One device copy, where the general path below uploads an index and runs two index kernels
        # (before session 26 from pageable memory: about 10 us between two graph replays, step_outside_graph.py).
        input_ids[:n].copy_(previous.device_tokens[:n])
        return
    # Destination rows, then source rows: one host-to-device copy for both, from pinned memory (a pageable source
    # is staged first, a gap of several us on the device).
    index = torch.tensor([r for r, _ in rows] + [row_of[seq_id] for _, seq_id in rows], dtype=torch.int64)
    if input_ids.is_cuda:
        index = index.pin_memory()
    index = index.to(input_ids.device, non_blocking=True)
    dst, src = index[:n], index[n:]
    input_ids.index_copy_(0, dst, previous.device_tokens.index_select(0, src))


__all__ = ["LaunchedStep", "TokenLogprobs", "patch_inflight_tokens", "to_host"]
