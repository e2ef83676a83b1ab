"""mHC kernels (deepinfer.md §2.4, §16.5): the mixing weights of a sublayer, the read of its input from the m
streams and the write of its output back into them. The GPU twins of `kernels/reference/hyper_connection.py`.

hc_mix
    Per token a [m(m+2), m*H] fp32 GEMV (m = 4, H = 5120: a 24 x 20480 matrix, 2 MB), scaled by rsqrt(mean z^2),
    then sigmoid and 20 Sinkhorn iterations on 4 x 4 values. The matrix is what costs: one program per token would
    stream 2 MB through one SM. So the K axis (m*H) is cut into fixed chunks of HC_CHUNK_K and the tokens into
    tiles of HC_BLOCK_T = 16; each program multiplies its token tile by its chunk of fn with tl.dot (fn is read once
    per 16 tokens, and at one token the 40 chunks keep 40 SMs streaming), with z^2 summed on the side. A second,
    small kernel sums the chunks' partials in chunk order and finishes in registers (scale, sigmoid, Sinkhorn);
    when m*H fits one chunk the first kernel finishes itself (one launch).
    Both tilings are constants, never a function of T: each token's sums run in the same order whatever the batch,
    so a token's pre/post/C are the same bits alone or batched (batch-independence, architecture.md §3).
    The mix columns are laid out so that the finish needs no gathers: column ((g*MP + r)*MP + c) (MP = m rounded up
    to a power of two) holds C[r, c] for g = 0, pre[c] for g*MP + r = MP and post[c] for g*MP + r = MP + 1, so the
    [BLOCK_T, NCOL] products reshape to [BLOCK_T, G, MP, MP] and each part is a masked sum over one axis.
    Numerics: float32 products. "tf32x3" (three TF32 tensor-core products: float32-level error, far faster than
    the FMA path) on CUDA; IEEE float32 in the interpreter.
    H200, CUDA graphs, bf16 R, m = 4, H = 5120: 14.7 us at 1 token (about half of it the finish kernel), 18.9 at
    64, 30.6 at 256, 170 at 2048 (the twin: 198 / 245 / 309 / 601; "ieee" products: 28.5 / 50 / 105 / 747). Chunks
    of 256 or 1024, 32- or 64-token tiles, and a 1-warp finish were all slower.

combine_streams, write_back
    One program per (token, H tile): the m stream rows of the tile are loaded once, accumulated in float32 in the
    twin's order (streams in order, then + post * y) and rounded once to R's dtype. H200, bf16, m = 4, H = 5120:
    combine 1.0 us at 1 token, 3.4 at 256 (3.9 TB/s); write_back 1.1 and 4.4 (5.4 TB/s counted as R read + written
    + y read).
"""

from __future__ import annotations

import torch

from deepserve.kernels import HAS_TRITON, INTERPRET, cdiv, next_pow2, require_triton, tl, triton
from deepserve.kernels.pdl import pdl_launch_args, pdl_launch_dependents, pdl_wait
from deepserve.kernels.reference import hyper_connection as reference

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HC_BLOCK_T = 16            # tokens per GEMV program (tl.dot's M)
HC_CHUNK_K = 512           # K elements per GEMV program: fixed, so the summation order never depends on T
HC_BLOCK_K = 128           # K step inside a chunk
HC_FINISH_WARPS = 4        # H200: 4 warps 7.8 us for the finish at one token, 1 warp 15.7
HC_MAX_STREAMS = 8
STREAM_BLOCK = 1024        # H elements per combine/write-back program


def _on_kernel_device(t: torch.Tensor) -> bool:
    return HAS_TRITON and (t.device.type == "cuda" or INTERPRET)


def _mix_columns(m: int) -> tuple[int, int]:
    """(MP, G): m rounded up to a power of two, and the groups of MP x MP columns that hold C, pre and post (at
    least 16 columns for tl.dot's N)."""
    mp = next_pow2(m)
    g = max(next_pow2(cdiv(mp + 2, mp)), max(1, 16 // (mp * mp)))
    return mp, g


# --- hc_mix ------------------------------------------------------------------------------------------------------

def hc_mix_supported(R: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether `hc_mix` runs the kernels (else the twin): R [T, m, H] float32 / float16 / bfloat16 with m <= 8,
    fn [m(m+2), m*H], base [m(m+2)], scale [3], all on one CUDA device (or the interpreter)."""
    if not _on_kernel_device(R) or R.dim() != 3 or R.dtype not in _DTYPES:
        return False
    T, m, H = R.shape
    n = m * (m + 2)
    if not 1 <= m <= HC_MAX_STREAMS or H < 1 or fn.shape != (n, m * H) or not fn.dtype.is_floating_point:
        return False
    if base.shape != (n,) or scale.numel() != 3:
        return False
    return all(x.device == R.device for x in (fn, base, scale))


@triton.jit
def _mix_layout(M: tl.constexpr, MP: tl.constexpr, NCOL: tl.constexpr):
    """Per mix column: (fn row, valid, which scale: 0 pre, 1 post, 2 C) -- see the module docstring."""
    col = tl.arange(0, NCOL)
    row = col // MP                     # g * MP + r
    c = col % MP
    is_c = (row < M) & (c < M)
    is_pre = (row == MP) & (c < M)
    is_post = (row == MP + 1) & (c < M)
    fn_row = tl.where(is_c, 2 * M + row * M + c, tl.where(is_pre, c, M + c))
    which = tl.where(is_c, 2, tl.where(is_pre, 0, 1))
    return fn_row, is_c | is_pre | is_post, which


@triton.jit
def _hc_finish(mix, sumsq, t, t_ok, base_ptr, scale_ptr, pre_ptr, post_ptr, c_ptr, k_len, norm_eps, hc_eps,
               post_mult, M: tl.constexpr, MP: tl.constexpr, G: tl.constexpr, BLOCK_T: tl.constexpr,
               ITERS: tl.constexpr):
    """mix [BLOCK_T, NCOL] = fn . z, sumsq [BLOCK_T] = sum z^2 of tokens t -> pre, post, C stored (the twin's
    hc_mix after its matrix product, in its order)."""
    NCOL: tl.constexpr = G * MP * MP
    fn_row, valid, which = _mix_layout(M, MP, NCOL)
    scale = tl.load(scale_ptr + which, mask=valid, other=0.0).to(tl.float32)
    base = tl.load(base_ptr + fn_row, mask=valid, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(sumsq / k_len + norm_eps)
    mix = (mix * rstd[:, None]) * scale[None, :] + base[None, :]

    # pre / post: rows MP and MP + 1 of the [G*MP, MP] view.
    rows3 = tl.reshape(mix, [BLOCK_T, G * MP, MP])
    gr = tl.arange(0, G * MP)[None, :, None]
    pre = tl.sum(tl.where(gr == MP, rows3, 0.0), 1)                    # [BLOCK_T, MP]
    post = tl.sum(tl.where(gr == MP + 1, rows3, 0.0), 1)
    cc = tl.arange(0, MP)
    out_ok = t_ok[:, None] & (cc < M)[None, :]
    tl.store(pre_ptr + t[:, None] * M + cc[None, :], tl.sigmoid(pre) + hc_eps, mask=out_ok)
    tl.store(post_ptr + t[:, None] * M + cc[None, :], post_mult * tl.sigmoid(post), mask=out_ok)

    # C: group 0 of the [G, MP, MP] view, then Sinkhorn with the padded rows and columns held at 0.
    logits = tl.sum(tl.where(tl.arange(0, G)[None, :, None, None] == 0,
                             tl.reshape(mix, [BLOCK_T, G, MP, MP]), 0.0), 1)           # [BLOCK_T, MP, MP]
    r_ok = (tl.arange(0, MP) < M)[None, :, None]
    c_ok = (tl.arange(0, MP) < M)[None, None, :]
    logits = tl.where(c_ok, logits, float("-inf"))          # padded rows stay finite (their logits are 0)
    e = tl.exp(logits - tl.max(logits, 2)[:, :, None])
    C = tl.where(r_ok & c_ok, e / tl.sum(e, 2)[:, :, None] + hc_eps, 0.0)
    C = C / (tl.sum(C, 1)[:, None, :] + hc_eps)
    for _ in tl.static_range(ITERS - 1):
        C = C / (tl.sum(C, 2)[:, :, None] + hc_eps)
        C = C / (tl.sum(C, 1)[:, None, :] + hc_eps)
    i3 = tl.arange(0, MP)[None, :, None]
    j3 = tl.arange(0, MP)[None, None, :]
    tl.store(c_ptr + t[:, None, None] * (M * M) + i3 * M + j3, C, mask=t_ok[:, None, None] & r_ok & c_ok)


@triton.jit
def _hc_gemv_kernel(r_ptr, fn_ptr, base_ptr, scale_ptr, part_mix_ptr, part_ss_ptr, pre_ptr, post_ptr, c_ptr,
                    n_tokens, k_len, stride_rt, stride_fn, stride_ps, norm_eps, hc_eps, post_mult,
                    M: tl.constexpr, MP: tl.constexpr, G: tl.constexpr, BLOCK_T: tl.constexpr,
                    CHUNK_K: tl.constexpr, BLOCK_K: tl.constexpr, FINISH: tl.constexpr, ITERS: tl.constexpr,
                    PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    """Chunk `program_id(0)` of K for token tile `program_id(1)`: partial fn . z and sum z^2 (z = the token's m
    streams, stream-major, as the twin flattens them); FINISH (one chunk covers K): the finish too."""
    NCOL: tl.constexpr = G * MP * MP
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    chunk = tl.program_id(0)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < n_tokens
    t64 = t.to(tl.int64)
    fn_row, valid, _ = _mix_layout(M, MP, NCOL)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_T, NCOL], tl.float32)
    ss = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    for k0 in tl.static_range(0, CHUNK_K, BLOCK_K):
        k = chunk * CHUNK_K + k0 + kk
        k_ok = k < k_len
        z = tl.load(r_ptr + t64[:, None] * stride_rt + k[None, :], mask=t_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)                                       # [BLOCK_T, BLOCK_K]
        f = tl.load(fn_ptr + fn_row[None, :].to(tl.int64) * stride_fn + k[:, None],
                    mask=valid[None, :] & k_ok[:, None], other=0.0).to(tl.float32)  # [BLOCK_K, NCOL]
        acc = tl.dot(z, f, acc, input_precision=PRECISION)
        ss += z * z
    sumsq = tl.sum(ss, 1)
    if FINISH:
        _hc_finish(acc, sumsq, t64, t_ok, base_ptr, scale_ptr, pre_ptr, post_ptr, c_ptr, k_len, norm_eps, hc_eps,
                   post_mult, M, MP, G, BLOCK_T, ITERS)
    else:
        col = tl.arange(0, NCOL)
        tl.store(part_mix_ptr + chunk * stride_ps + t64[:, None] * NCOL + col[None, :], acc, mask=t_ok[:, None])
        tl.store(part_ss_ptr + chunk * n_tokens + t64, sumsq, mask=t_ok)


@triton.jit
def _hc_finish_kernel(part_mix_ptr, part_ss_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, c_ptr, n_tokens, k_len,
                      num_chunks, stride_ps, norm_eps, hc_eps, post_mult,
                      M: tl.constexpr, MP: tl.constexpr, G: tl.constexpr, BLOCK_T: tl.constexpr,
                      ITERS: tl.constexpr, USE_PDL: tl.constexpr):
    """The chunks' partials summed in chunk order, then the finish. (Loading 8 chunks a step as one [8, BLOCK_T,
    NCOL] block and summing it was 3x slower on an H200: 49.6 us for hc_mix at one token against 14.7.)"""
    NCOL: tl.constexpr = G * MP * MP
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < n_tokens
    t64 = t.to(tl.int64)
    col = tl.arange(0, NCOL)
    mix = tl.zeros([BLOCK_T, NCOL], tl.float32)
    sumsq = tl.zeros([BLOCK_T], tl.float32)
    for c in range(0, num_chunks):
        mix += tl.load(part_mix_ptr + c * stride_ps + t64[:, None] * NCOL + col[None, :], mask=t_ok[:, None],
                       other=0.0)
        sumsq += tl.load(part_ss_ptr + c * n_tokens + t64, mask=t_ok, other=0.0)
    _hc_finish(mix, sumsq, t64, t_ok, base_ptr, scale_ptr, pre_ptr, post_ptr, c_ptr, k_len, norm_eps, hc_eps,
               post_mult, M, MP, G, BLOCK_T, ITERS)


def hc_mix(R: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
           hc_eps: float, iters: int, post_mult: float,
           precision: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The twin's `hc_mix`: R [T, m, H] -> (pre [T, m], post [T, m], C [T, m, m]) float32, contiguous. Where
    `hc_mix_supported` is False the twin runs. R: any token stride (each token's [m, H] is made contiguous if it
    is not); `precision` overrides tl.dot's input precision ("tf32x3" on CUDA, "ieee" in the interpreter)."""
    if not hc_mix_supported(R, fn, base, scale):
        return reference.hc_mix(R, fn, base, scale, norm_eps, hc_eps, iters, post_mult)
    require_triton(R)
    T, m, H = R.shape
    dev = R.device
    pre = torch.empty(T, m, dtype=torch.float32, device=dev)
    post = torch.empty(T, m, dtype=torch.float32, device=dev)
    C = torch.empty(T, m, m, dtype=torch.float32, device=dev)
    if T == 0:
        return pre, post, C
    if R.stride(2) != 1 or (m > 1 and R.stride(1) != H):
        R = R.contiguous()
    fn = fn.float()
    if fn.stride(-1) != 1:
        fn = fn.contiguous()
    base, scale = base.float().contiguous(), scale.float().reshape(3).contiguous()
    mp, g = _mix_columns(m)
    ncol = g * mp * mp
    k_len = m * H
    chunks = cdiv(k_len, HC_CHUNK_K)
    token_tiles = cdiv(T, HC_BLOCK_T)
    finish = chunks == 1
    if finish:
        part_mix = part_ss = pre                 # unused
    else:
        part_mix = torch.empty(chunks, T, ncol, dtype=torch.float32, device=dev)
        part_ss = torch.empty(chunks, T, dtype=torch.float32, device=dev)
    prec = precision or ("ieee" if INTERPRET else "tf32x3")
    consts = dict(M=m, MP=mp, G=g, BLOCK_T=HC_BLOCK_T, ITERS=int(iters))
    _hc_gemv_kernel[(chunks, token_tiles)](
        R, fn, base, scale, part_mix, part_ss, pre, post, C, T, k_len, R.stride(0), fn.stride(0), T * ncol,
        float(norm_eps), float(hc_eps), float(post_mult), CHUNK_K=HC_CHUNK_K, BLOCK_K=HC_BLOCK_K, FINISH=finish,
        PRECISION=prec, num_warps=4, **consts, **pdl_launch_args(R))
    if not finish:
        _hc_finish_kernel[(token_tiles,)](
            part_mix, part_ss, base, scale, pre, post, C, T, k_len, chunks, T * ncol, float(norm_eps),
            float(hc_eps), float(post_mult), num_warps=HC_FINISH_WARPS, **consts, **pdl_launch_args(R))
    return pre, post, C


def hc_mix_ref(R, fn, base, scale, norm_eps, hc_eps, iters, post_mult):
    """The PyTorch twin."""
    return reference.hc_mix(R, fn, base, scale, norm_eps, hc_eps, iters, post_mult)


# --- combine_streams / write_back --------------------------------------------------------------------------------

def streams_supported(R: torch.Tensor, *per_token: torch.Tensor) -> bool:
    """Whether `combine_streams` / `write_back` run their kernels (else the twin): R [T, m, H] float32 / float16 /
    bfloat16 with m <= 8 on CUDA (or the interpreter), the other operands floating, with T rows, on R's device."""
    if not _on_kernel_device(R) or R.dim() != 3 or R.dtype not in _DTYPES or not 1 <= R.shape[1] <= HC_MAX_STREAMS:
        return False
    return all(x.device == R.device and x.dtype.is_floating_point and x.shape[0] == R.shape[0] for x in per_token)


@triton.jit
def _combine_kernel(r_ptr, w_ptr, out_ptr, hidden, stride_rt, stride_rm, stride_wt, stride_wm, stride_ot,
                    M: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    h_ok = h < hidden
    acc = tl.zeros([BLOCK], tl.float32)
    for i in tl.static_range(M):
        w_i = tl.load(w_ptr + t * stride_wt + i * stride_wm).to(tl.float32)
        acc += w_i * tl.load(r_ptr + t * stride_rt + i * stride_rm + h, mask=h_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + h, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


def combine_streams(R: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The twin's `combine_streams`: sum_i w_i R_i, R [T, m, H], weights [T, m] -> [T, H] in R's dtype (float32
    accumulation, one rounding). Any token/stream strides of R (unit last stride, else copied); the twin runs
    where `streams_supported` is False."""
    if not streams_supported(R, weights) or weights.shape != R.shape[:2]:
        return reference.combine_streams(R, weights)
    require_triton(R)
    T, m, H = R.shape
    out = torch.empty(T, H, dtype=R.dtype, device=R.device)
    if T == 0 or H == 0:
        return out
    if R.stride(2) != 1:
        R = R.contiguous()
    block = min(STREAM_BLOCK, max(16, next_pow2(H)))
    _combine_kernel[(T, cdiv(H, block))](
        R, weights, out, H, R.stride(0), R.stride(1), weights.stride(0), weights.stride(1), out.stride(0),
        M=m, BLOCK=block, num_warps=4, **pdl_launch_args(R))
    return out


@triton.jit
def _write_back_kernel(r_ptr, y_ptr, post_ptr, c_ptr, out_ptr, hidden, stride_rt, stride_rm, stride_yt,
                       stride_pt, stride_pm, stride_ct, stride_ci, stride_cj, stride_ot, stride_om,
                       M: tl.constexpr, MP: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """out[t, j, tile] = sum_i C[t, i, j] R[t, i, tile] + post[t, j] y[t, tile] for all j at once: each stream row
    of the tile is read once (and the tile is written only after all of it is read: `out` may be R)."""
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    h_ok = h < hidden
    j = tl.arange(0, MP)
    j_ok = j < M
    acc = tl.zeros([MP, BLOCK], tl.float32)
    for i in tl.static_range(M):
        c_i = tl.load(c_ptr + t * stride_ct + i * stride_ci + j * stride_cj, mask=j_ok, other=0.0).to(tl.float32)
        r_i = tl.load(r_ptr + t * stride_rt + i * stride_rm + h, mask=h_ok, other=0.0).to(tl.float32)
        acc += c_i[:, None] * r_i[None, :]
    post = tl.load(post_ptr + t * stride_pt + j * stride_pm, mask=j_ok, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + t * stride_yt + h, mask=h_ok, other=0.0).to(tl.float32)
    acc += post[:, None] * y[None, :]
    tl.store(out_ptr + t * stride_ot + j[:, None] * stride_om + h[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=j_ok[:, None] & h_ok[None, :])


def write_back(R: torch.Tensor, y: torch.Tensor, post: torch.Tensor, C: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """The twin's `write_back`: R'_j = post_j y + sum_i C[i, j] R_i; R [T, m, H], y [T, H], post [T, m], C [T, m, m]
    -> [T, m, H] in R's dtype (float32 accumulation, one rounding). `out` (R's shape and dtype, unit last stride)
    receives it if given, R itself included (in place). Any token/stream strides, unit last strides (else copied);
    the twin runs where `streams_supported` is False."""
    T, m = R.shape[:2] if R.dim() == 3 else (0, 0)
    if not streams_supported(R, y, post, C) or y.shape != (T, R.shape[2]) or post.shape != (T, m) \
            or C.shape != (T, m, m):
        result = reference.write_back(R, y, post, C)
        return result if out is None else out.copy_(result)
    require_triton(R)
    H = R.shape[2]
    if out is None:
        out = torch.empty(T, m, H, dtype=R.dtype, device=R.device)
    assert out.shape == R.shape and out.dtype == R.dtype and out.stride(2) == 1
    if T == 0 or H == 0:
        return out
    if R.stride(2) != 1:
        R = R.contiguous()
    if y.stride(1) != 1:
        y = y.contiguous()
    block = min(STREAM_BLOCK, max(16, next_pow2(H)))
    _write_back_kernel[(T, cdiv(H, block))](
        R, y, post, C, out, H, R.stride(0), R.stride(1), y.stride(0), post.stride(0), post.stride(1),
        C.stride(0), C.stride(1), C.stride(2), out.stride(0), out.stride(1),
        M=m, MP=next_pow2(m), BLOCK=block, num_warps=4, **pdl_launch_args(R))
    return out


def combine_streams_ref(R, weights):
    """The PyTorch twin."""
    return reference.combine_streams(R, weights)


def write_back_ref(R, y, post, C):
    """The PyTorch twin."""
    return reference.write_back(R, y, post, C)


__all__ = ["combine_streams", "combine_streams_ref", "hc_mix", "hc_mix_ref", "hc_mix_supported", "streams_supported",
           "write_back", "write_back_ref", "HC_BLOCK_T", "HC_CHUNK_K"]
