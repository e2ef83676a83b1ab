"""Paged KV-cache writes: a step's keys and values into their cache slots (`write_kv`), or, in one launch, the
rotary embedding of q and k with the write of the rotated k and of v (`rotary_write_kv`, with Qwen3's per-head q/k
norms when asked). The attention kernels that read the cache are kernels/paged_attention.py (decode) and
kernels/paged_prefill.py.

KV cache of one layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (0 = keys, 1 = values); a token's
slot is block_id * block_size + offset; a negative slot marks a padding row, which writes nothing. An 8-bit float
cache is written saturated and rounded to nearest (kernels/kv_rounding.py). Each launcher has a PyTorch twin
(`*_ref`) built from the reference backend.
"""

from typing import Optional

import torch

from deepserve.kernels import and_scalar, next_pow2, require_triton, tl, triton
from deepserve.kernels.kv_rounding import store_rounded
from deepserve.kernels.l2_prefetch import (L2_PREFETCH_PIECE, L2_PREFETCH_PIECES, l2_prefetch_plan,
                                          prefetch_bytes_to_l2)
from deepserve.kernels.pdl import (EARLY_INPUTS, pdl_launch_args, pdl_launch_dependents, pdl_wait,
                                  pdl_wait_after_inputs, pdl_wait_for_inputs)
from deepserve.kernels.reference import attention as reference
from deepserve.kernels.reference.norm import rms_norm
from deepserve.kernels.rotary import cos_sin_row, rotary_constexprs, rotate_normed_heads


@triton.jit
def copy_heads(src_row, stride_sh, dst_row, stride_dh, num_heads, keep,
               HEAD_DIM: tl.constexpr, BLOCK_HD: tl.constexpr):
    """dst[h, :] = src[h, :] for the num_heads heads of one token (rows given by their first head), if `keep`; rounded
    into dst's dtype (an fp8 cache's: kernels/kv_rounding.py)."""
    offs = tl.arange(0, BLOCK_HD)
    h = offs // HEAD_DIM
    d = offs % HEAD_DIM
    mask = and_scalar(offs < num_heads * HEAD_DIM, keep)
    x = tl.load(src_row + h * stride_sh + d, mask=mask)
    store_rounded(dst_row + h * stride_dh + d, x, mask)


@triton.jit
def cache_slot(cache_ptr, slot_ptr, t, stride_c_block, stride_c_slot, block_size):
    """(address of the slot row t writes, whether it writes): a negative slot marks a padding row (e.g. a CUDA-graph
    batch padded to its captured size), which writes nothing."""
    slot = tl.load(slot_ptr + t).to(tl.int64)
    return cache_ptr + (slot // block_size) * stride_c_block + (slot % block_size) * stride_c_slot, slot >= 0


@triton.jit
def rotary_write_prologue(pos_ptr, slot_ptr, cache_ptr, cos_ptr, sin_ptr, stride_c_block, stride_c_slot, stride_cos,
                          block_size, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, HALF_CACHE: tl.constexpr,
                          INPUTS_READY: tl.constexpr, USE_PDL: tl.constexpr):
    """What a one-token rotate-and-write program (this file's and the MLA latent one) starts with: the PDL wait,
    its token t, the cache slot it writes (`cache_slot`) and the cos/sin row of its position (`cos_sin_row`).
    INPUTS_READY: positions and slots were in place before the previous kernel (kernels/pdl.py, rule 1), so their
    loads and the cos/sin loads they lead to come before the wait."""
    pdl_wait_for_inputs(INPUTS_READY, USE_PDL)    # first (kernels/pdl.py), or after the inputs if they are ready
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    dst, keep = cache_slot(cache_ptr, slot_ptr, t, stride_c_block, stride_c_slot, block_size)
    cos1, sin1, cos2, sin2, j, jmask = cos_sin_row(cos_ptr, sin_ptr, pos, stride_cos, HALF, BLOCK_HALF, HALF_CACHE)
    pdl_wait_after_inputs(INPUTS_READY, USE_PDL)
    return t, dst, keep, cos1, sin1, cos2, sin2, j, jmask


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_c_kv, stride_c_block, stride_c_slot, stride_c_head,
                     block_size, num_kv_heads,
                     HEAD_DIM: tl.constexpr, BLOCK_HD: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_wait(USE_PDL)              # first (kernels/pdl.py): reads this step's data, writes the cache/outputs
    pdl_launch_dependents(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    dst, keep = cache_slot(cache_ptr, slot_ptr, t, stride_c_block, stride_c_slot, block_size)
    copy_heads(k_ptr + t * stride_kt, stride_kh, dst, stride_c_head, num_kv_heads, keep, HEAD_DIM, BLOCK_HD)
    copy_heads(v_ptr + t * stride_vt, stride_vh, dst + stride_c_kv, stride_c_head, num_kv_heads, keep, HEAD_DIM,
               BLOCK_HD)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_cache[:, slot] = k, v for every row; k, v: [T, Hkv, D] (any row/head strides, unit last stride)."""
    require_triton(k)
    t, hkv, d = k.shape
    if t == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    assert kv_cache.stride(-1) == 1 and kv_cache.shape[0] == 2
    bs = kv_cache.shape[2]
    _write_kv_kernel[(t,)](
        k, v, kv_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        bs, hkv, HEAD_DIM=d, BLOCK_HD=next_pow2(hkv * d), num_warps=4, **pdl_launch_args(k))


# positions and slot_mapping are views into the step's packed index buffer: not specialised on (see rotary.py); nor
# is the batch size (num_tokens).
@triton.jit(do_not_specialize=["pos_ptr", "slot_ptr", "pf_bytes", "num_tokens"])
def _rotary_write_kv_kernel(pos_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, q_out_ptr, cache_ptr, cos_ptr, sin_ptr,
                            q_norm_ptr, k_norm_ptr, norm_eps,
                            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_qot, stride_qoh,
                            stride_c_kv, stride_c_block, stride_c_slot, stride_c_head, stride_cos,
                            block_size, num_q_heads, num_kv_heads,
                            HEAD_DIM: tl.constexpr, BLOCK_HD: tl.constexpr, HALF: tl.constexpr,
                            BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr,
                            HALF_CACHE: tl.constexpr, QK_NORM: tl.constexpr, INPUTS_READY: tl.constexpr,
                            pf_ptr, pf_bytes, num_tokens, PREFETCH: tl.constexpr, PF_PIECES: tl.constexpr,
                            PF_PIECE: tl.constexpr, USE_PDL: tl.constexpr):
    """One token: q rotated into q_out (padding rows too: harmless, and the decode kernel reads them), k rotated
    and v copied straight into the cache slot; with QK_NORM, q and k RMS-normalised per head first.
    PREFETCH (an L2Prefetch policy, 0 none): the programs past the tokens ask L2 for pf_bytes of pf_ptr
    (kernels/l2_prefetch.py), then wait."""
    if PREFETCH:
        pid = tl.program_id(0)
        if pid >= num_tokens:
            prefetch_bytes_to_l2(pf_ptr, pid - num_tokens, pf_bytes, PREFETCH, PF_PIECES, PF_PIECE)
            pdl_wait(USE_PDL)           # kernels/pdl.py, rule 2
            pdl_launch_dependents(USE_PDL)
            return
    t, dst, keep, cos1, sin1, cos2, sin2, j, jmask = rotary_write_prologue(
        pos_ptr, slot_ptr, cache_ptr, cos_ptr, sin_ptr, stride_c_block, stride_c_slot, stride_cos, block_size,
        HALF, BLOCK_HALF, HALF_CACHE, INPUTS_READY, USE_PDL)
    rotate_normed_heads(q_ptr + t * stride_qt, q_out_ptr + t * stride_qot, stride_qh, stride_qoh, num_q_heads, True,
                        cos1, sin1, cos2, sin2, j, jmask, q_norm_ptr, norm_eps, HALF, BLOCK_H, INTERLEAVED, QK_NORM)
    rotate_normed_heads(k_ptr + t * stride_kt, dst, stride_kh, stride_c_head, num_kv_heads, keep,
                        cos1, sin1, cos2, sin2, j, jmask, k_norm_ptr, norm_eps, HALF, BLOCK_H, INTERLEAVED, QK_NORM)
    copy_heads(v_ptr + t * stride_vt, stride_vh, dst + stride_c_kv, stride_c_head, num_kv_heads, keep, HEAD_DIM,
               BLOCK_HD)


def rotary_write_kv(kv_cache: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    slot_mapping: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
                    sin_cache: torch.Tensor, inputs_ready: bool = False,
                    qk_norm: Optional[tuple[torch.Tensor, torch.Tensor, float]] = None,
                    l2_prefetch: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rotary embedding of q and k at `positions` and the cache write of the rotated k and of v, in one launch:
    `q_rot, k_rot = apply_rotary(positions, q, k, cos_cache, sin_cache)` (NeoX halves; full- or half-width caches)
    then `write_kv(kv_cache, k_rot, v, slot_mapping)`, rows with a negative slot writing nothing.
    q: [T, H, D], k, v: [T, Hkv, D] (any row/head strides, unit last stride). Returns q_rot, a new contiguous
    tensor; the rotated k lives only in the cache. `inputs_ready`: positions and slot_mapping were in place before
    the kernel launched just before this call (the step's input buffers): read before the PDL wait.
    `qk_norm` = (q weight [D], k weight [D], eps), in q's dtype: q and k are first `rms_norm`ed per head (Qwen3's
    q_norm / k_norm), which saves their two launches and the copies their strided views would need.
    `l2_prefetch`: a weight the kernel after the attention reads (o_proj's), asked into L2 by extra programs in a
    small decode step (kernels/l2_prefetch.py); it changes no result."""
    require_triton(q)
    t, h, d = q.shape
    hkv = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if t == 0:
        return q_out
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    assert kv_cache.stride(-1) == 1 and kv_cache.shape[0] == 2 and kv_cache.shape[3:] == k.shape[1:]
    q_norm, k_norm, eps = qk_norm if qk_norm is not None else (q, q, 0.0)
    if qk_norm is not None:
        assert q_norm.shape == k_norm.shape == (d,) and q_norm.dtype == k_norm.dtype == q.dtype
        assert q_norm.is_contiguous() and k_norm.is_contiguous()
    prefetch = l2_prefetch_plan(l2_prefetch, t, q, "rotary")
    _rotary_write_kv_kernel[(t + prefetch.programs,)](
        positions, slot_mapping, q, k, v, q_out, kv_cache, cos_cache, sin_cache, q_norm, k_norm, float(eps),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), q_out.stride(0),
        q_out.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        cos_cache.stride(0), kv_cache.shape[2], h, hkv,
        HEAD_DIM=d, BLOCK_HD=next_pow2(hkv * d), **rotary_constexprs(d, h, cos_cache, sin_cache, False),
        QK_NORM=qk_norm is not None, INPUTS_READY=inputs_ready and EARLY_INPUTS,
        pf_ptr=prefetch.tensor, pf_bytes=prefetch.nbytes, num_tokens=t, PREFETCH=prefetch.policy,
        PF_PIECES=L2_PREFETCH_PIECES, PF_PIECE=L2_PREFETCH_PIECE, num_warps=4, **pdl_launch_args(q))
    return q_out


def rotary_write_kv_ref(kv_cache, q, k, v, slot_mapping, positions, cos_cache, sin_cache, qk_norm=None):
    """The PyTorch twin: (the reference per-head norms,) the reference rotation (RotaryEmbedding's), then the
    reference backend's write; rows with a negative slot are skipped (the reference's write needs valid slots)."""
    from deepserve.kernels.rotary import apply_rotary_ref
    if qk_norm is not None:
        q, k = rms_norm(q, qk_norm[0], qk_norm[2]), rms_norm(k, qk_norm[1], qk_norm[2])
    q_rot, k_rot = apply_rotary_ref(positions, q, k, cos_cache, sin_cache)
    keep = slot_mapping >= 0
    write_kv_ref(kv_cache, k_rot[keep], v[keep], slot_mapping[keep])
    return q_rot


def write_kv_ref(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    reference.write_kv(kv_cache, k, v, slot_mapping)


__all__ = ["cache_slot", "copy_heads", "rotary_write_kv", "rotary_write_kv_ref", "rotary_write_prologue",
           "write_kv", "write_kv_ref"]
