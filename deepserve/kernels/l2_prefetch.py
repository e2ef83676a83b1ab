"""L2 prefetch of a weight that the next bandwidth-bound kernel reads, issued by extra programs of a latency-bound
kernel before it.

Why: in a decode step of a few sequences the attention chain of a layer (rotary + KV write, the paged decode, its
split reduce) takes 12-15 us on an H200 while reading a few MB of keys and values: its time is latency, and HBM is
mostly idle. The o_proj after it then streams its 8-17 MB weight from HBM at a fraction of the bandwidth (6-8 us
for what takes 2-4 us at 4.24 TB/s: benchmarks/h200_b8_kernel_sequences_s25.json). Extra programs of a kernel of
the chain ask L2 for that weight with `cp.async.bulk.prefetch.L2` (Hopper's bulk prefetch: one instruction per
PIECE bytes, no registers, no wait), so the bytes move while the attention runs and o_proj reads them from L2.

Where (`DEEPSERVE_L2_PREFETCH`, a site and a policy):
  rotary   the GQA rotary + KV-write kernel (kv_write.rotary_write_kv): its programs start under PDL while
           the qkv projection drains, some 12-15 us before o_proj; steps of 2-64 rows (batch 1 fuses that kernel
           into its qkv GEMV and has none)
  reduce   the split decode's reduce (paged_attention.decode_reduce): its programs start under PDL while the decode
           runs, a few us before o_proj; batch 1 too
  _evict_last  the prefetched lines are tagged evict-last, so that the keys and values streaming through L2
           meanwhile evict them last
  off      none (the default)

The prefetch programs follow kernels/pdl.py's rules: a weight is constant, so it may be touched before the PDL
wait; the programs then wait (rule 2) and exit. Only Hopper and later (the bulk prefetch is sm_90 PTX), never in
Triton's interpreter; tests/kernels/test_l2_prefetch.py has ptxas accept the instructions without a GPU.

Status: written in session 27 while no GPU was lent. Its GPU test (tests/gpu/test_paged_attention.py) and the A/B
(its command in docs/gpu.md) have not run yet, so it is off by default; the A/B decides which
site, if any, stays.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch

from deepserve import envs
from deepserve.kernels import HAS_TRITON, INTERPRET, cdiv, tl, triton

L2_PREFETCH_PIECE = 4096          # bytes per bulk prefetch instruction (a multiple of 16)
L2_PREFETCH_PIECES = 64           # instructions per program: 256 KB a program
L2_PREFETCH_MAX_ROWS = 64         # past this many rows the attention reads enough keys to need the bandwidth itself
SITES = ("rotary", "reduce")


class L2Prefetch(NamedTuple):
    """What a launcher passes its kernel: the tensor (a pointer), its bytes (a multiple of 16), the extra programs
    that prefetch them (0: no prefetch) and the policy (a constexpr of the kernel: 0 none, 1 plain, 2 evict-last)."""
    tensor: torch.Tensor
    nbytes: int
    programs: int
    policy: int = 0


@functools.cache
def _setting(device_index: int) -> tuple[str | None, int]:
    """(site, policy) of DEEPSERVE_L2_PREFETCH where the GPU has the bulk prefetch, else (None, 0); read once per
    device."""
    value = envs.DEEPSERVE_L2_PREFETCH
    if value == "off" or not HAS_TRITON or INTERPRET or torch.version.hip is not None \
            or torch.cuda.get_device_capability(device_index)[0] < 9:
        return None, 0
    site, _, policy = value.partition("_")
    return site, 2 if policy == "evict_last" else 1


def l2_prefetch_plan(weight: Optional[torch.Tensor], rows: int, like: torch.Tensor, site: str) -> L2Prefetch:
    """The prefetch of `weight` by the kernel at `site` (SITES) for a launch of `rows` decode rows, whose other
    tensors are like `like` (the pointer passed when there is nothing to prefetch): none unless the setting names
    this site, for a weight that is not a contiguous 16-byte-aligned CUDA tensor, or past L2_PREFETCH_MAX_ROWS."""
    assert site in SITES, site
    none = L2Prefetch(like, 0, 0)
    if weight is None or not weight.is_cuda or rows > L2_PREFETCH_MAX_ROWS or not weight.is_contiguous() \
            or weight.data_ptr() % 16:
        return none
    chosen, policy = _setting(weight.device.index if weight.device.index is not None else torch.cuda.current_device())
    if chosen != site:
        return none
    nbytes = weight.numel() * weight.element_size() // 16 * 16
    return L2Prefetch(weight, nbytes, cdiv(nbytes, L2_PREFETCH_PIECE * L2_PREFETCH_PIECES), policy)


@triton.jit
def prefetch_bytes_to_l2(base_ptr, program, nbytes, POLICY: tl.constexpr, PIECES: tl.constexpr,
                         PIECE: tl.constexpr):
    """Ask L2 for prefetch program `program`'s PIECES * PIECE bytes of [0, nbytes) from base_ptr, one bulk
    prefetch of up to PIECE bytes per lane, and move on (nothing waits for the data). POLICY 2 tags the lines
    evict-last. A program past the end does nothing."""
    offs = (program * PIECES + tl.arange(0, PIECES)).to(tl.int64) * PIECE
    size = tl.minimum(nbytes - offs, PIECE).to(tl.int32)        # <= 0 past the end: the lane does nothing
    addr = base_ptr.to(tl.pointer_type(tl.int8)) + offs
    if POLICY == 2:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b64 pol; setp.gt.s32 p, $2, 0; "
            "createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
            "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; mov.u32 $0, 0; }",
            "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)


__all__ = ["L2Prefetch", "L2_PREFETCH_MAX_ROWS", "L2_PREFETCH_PIECE", "L2_PREFETCH_PIECES", "SITES",
           "l2_prefetch_plan", "prefetch_bytes_to_l2"]
