"""MLA decode over an 8-bit latent cache on Hopper's warpgroup MMAs (DEEPSERVE_MLA_WGMMA, the default on sm_90): the
work of `mla_decode._mla_decode_kernel` with tokens as the products' rows, written in Gluon (Triton's explicit-layout
dialect) so that every operand's place is chosen here, not by the compiler.

Why: at DeepSeek-V2-Lite's 16 heads the Triton kernel's products have 16 rows, so they run as warp MMAs fed by
ldmatrix, and each of its four warps reads the whole [16, 576] query from shared memory for every 32-key tile. Over
an E4M3 cache it reads HBM at 1.4 TB/s with its shared-memory pipe 75% busy (session 34's Nsight Compute run), and
no Triton rewrite of it ran faster (sessions 34-50, docs/gpu.md). Token-major, a 64-key tile is a warpgroup MMA's
64 rows, and the MMA reads both operands from shared memory itself, once a warpgroup. By operand sizes a 64-key
tile moves ~246 KB through shared memory here (the widened tile's 72 KB stored, 90 KB read by the score products,
80 KB by the output's, the probabilities) against ~432 KB in the Triton kernel (two 32-key tiles of session 50's
count). Session 34's plain-Triton try at this shape (commit 591fe71) left Triton to place the widened keys, which
it held in registers as the MMAs' left operand; here they stay in shared memory.

One program: one sequence, 16 heads (one head tile), one split of its keys, one warpgroup (4 warps). A tile:
  1. the 64 keys' 8-bit rows [64, RANK + 64] load into registers (a [64, 64] chunk at a time: 16 bytes a load),
     widen to fp16 and go to shared memory, C [9 chunks, 64 keys, 64];
  2. scores^T [64 keys, 16 heads] = sum over chunks of C_j q_j^T (the query in shared memory as fp16 [9, 16, 64]);
  3. the online softmax down the key axis (float32 statistics, log2 domain, as the Triton kernel);
  4. the probabilities go to shared memory as fp16 [16 heads, 64 keys] (p, read as p^T);
  5. out_j^T [64 latent columns, 16 heads] += C_j^T p^T for the 8 latent chunks (C_j read transposed: 16-bit
     operands may be).
The next tile's first three chunks load into registers while a tile's products and softmax run (Nsight Compute,
before that prefetch: warps waited mostly on the tiles' global loads, DRAM 43% busy). All nine at once would not fit
the registers (spills), so with ASYNC (DEEPSERVE_MLA_WGMMA_ASYNC, the default) chunks 3-7 travel by cp.async into
shared memory, 8-bit, at the same time (20 KB more a program: two still fit an SM), and only the RoPE chunk loads at
the tile's start; the block table is read a tile ahead of the loads that need it, whose addresses otherwise waited
on it (session 55, H100, V2-Lite batch 256: 91 -> 77 us a call). Without ASYNC chunks 3-8 load into registers at the
tile's start, while the previous tile's out products finish (session 54's kernel).

REG_SCORES (DEEPSERVE_MLA_WGMMA_REG_SCORES): session 56's Nsight Compute had the warps waiting on shared memory most
(short scoreboard), so the score products take the widened keys as their A operand in registers, each chunk as it is
widened, and only the output products read the widened tile back (~166 KB a tile through shared memory, the RoPE
chunk no longer stored). A thread loads 16 contiguous bytes of each of its two rows, which hold other columns than
its MMA fragment does; so the operand's columns are reordered (_score_operand, _score_columns) until the loaded
bytes are the fragment, and the query is staged in the same column order: a sum over columns does not care. On by
default since session 57 (H100, V2-Lite batch 256: 78.3 -> 75.6 us a call, steps 0.5% faster).

Arithmetic as mla_decode.py's kernel with FP8_F16_PRODUCTS: the query clamped to fp16's range and rounded to fp16,
the cache's codes widened exactly, probabilities in fp16, float32 accumulation; summation order differs inside the
products.

Scope: a 512-wide latent (DeepSeek-V2 / V3's; eight chunks, written out) and a 64-wide RoPE part, any head
count (16 a program, padded heads masked), 8-bit caches (E4M3 / E5M2), sm_90 (warpgroup MMAs), Gluon as Triton 3.6
(the device's) and 3.9 spell it. No PDL: the launch waits for the previous kernel as a plain launch.
"""

from __future__ import annotations

from deepserve.kernels import triton

try:        # Gluon ships with Triton 3.5+, but its API moved between releases: this kernel was built and run with 3.6
    # (and builds with 3.9), so older ones keep mla_decode.py's kernel (wgmma_supported says so)
    if tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 6):
        raise ImportError(f"Triton {triton.__version__}: the kernel needs 3.6+")
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    HAVE_GLUON = True
    cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier      # Triton 3.6's name, then 3.9's
    # cp.async of a pointer tensor into shared memory: Triton 3.9's name, then 3.6's (3.9 keeps the old one to raise)
    copy_to_shared = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
except (ImportError, AttributeError, ValueError):       # pragma: no cover - no Triton, or an older one
    HAVE_GLUON = False

TOKENS = 64         # keys a tile: a warpgroup MMA's rows
HEADS = 16          # heads a program: the products' N
COLS = 64           # latent columns a chunk (128 bytes of fp16: one swizzled shared-memory row)
ROPE = 64
RANK = 512          # latent columns: the eight chunks the kernel writes out (k0..k7, o0..o7)
if HAVE_GLUON:      # the same, as values a Gluon function may read
    TOKENS_C, HEADS_C, COLS_C = gl.constexpr(TOKENS), gl.constexpr(HEADS), gl.constexpr(COLS)


def wgmma_supported(q_lat, kv_cache) -> bool:
    """Whether this kernel can take the launch: Gluon, an sm_90 device, an 8-bit cache, a 512-wide latent and a
    64-wide RoPE part."""
    import torch
    if not HAVE_GLUON or not q_lat.is_cuda or torch.cuda.get_device_capability(q_lat.device)[0] != 9:
        return False
    rank = q_lat.shape[-1]
    return (kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and rank == RANK
            and kv_cache.shape[-1] == rank + ROPE)


if HAVE_GLUON:
    @gluon.jit
    def _load_chunk(rows, first: gl.constexpr, cols, t_ok):
        """Columns first + cols of the tile's key rows (pointers [64, 1]): 8-bit codes, 0 on masked keys."""
        return gl.load(rows + first + cols[None, :], mask=t_ok[:, None], other=0.0)

    @gluon.jit
    def tile_blocks(table, n0, keys, end, block_size):
        """The cache blocks of the 64 keys from n0 on (0 past end), from the block table."""
        tok = n0 + keys
        return gl.load(table + tok // block_size, mask=tok < end, other=0)

    @gluon.jit
    def block_rows(blk, cache_ptr, n0, keys, end, block_size, stride_c_block, stride_c_slot):
        """The row pointers ([64, 1]) of the 64 keys from n0 on, in their cache blocks blk, and which are < end."""
        tok = n0 + keys
        rows = cache_ptr + blk.to(gl.int64) * stride_c_block + (tok % block_size).to(gl.int64) * stride_c_slot
        return rows[:, None], tok < end

    @gluon.jit
    def _tile_rows(table, cache_ptr, n0, keys, end, block_size, stride_c_block, stride_c_slot):
        """The row pointers ([64, 1]) of the 64 keys from n0 on, through the block table, and which are < end."""
        blk = tile_blocks(table, n0, keys, end, block_size)
        return block_rows(blk, cache_ptr, n0, keys, end, block_size, stride_c_block, stride_c_slot)

    @gluon.jit
    def _stage_chunk(c_smem, j: gl.constexpr, codes):
        """Chunk j of the tile, widened to fp16 (exact for E4M3 / E5M2 codes), into shared memory."""
        c_smem.index(j).store(codes.to(gl.float16))

    @gluon.jit
    def _copy_chunks(raw4, raw1, rows, cols, t_ok):
        """cp.async of chunks 3-7 of the tile's key rows into raw4 [4, 64, 64] and raw1 [64, 64] (8-bit codes;
        masked keys read nothing and fill 0), one commit group."""
        for j in gl.static_range(4):
            copy_to_shared(raw4.index(j), rows + (3 + j) * COLS_C + cols[None, :], mask=t_ok[:, None])
        copy_to_shared(raw1, rows + 7 * COLS_C + cols[None, :], mask=t_ok[:, None])
        async_copy.commit_group()

    @gluon.jit
    def _stage_copied_chunks(c_smem, raw4, raw1, layout: gl.constexpr):
        """The cp.async'd chunks 3-7 (every thread's copies landed: wait, then barrier) widened into c_smem."""
        async_copy.wait_group(0)
        cta_barrier()
        for j in gl.static_range(4):
            c_smem.index(3 + j).store(raw4.index(j).load(layout).to(gl.float16))
        c_smem.index(7).store(raw1.load(layout).to(gl.float16))

    @gluon.jit
    def _stage_query(q_smem, j: gl.constexpr, rows, cols, h_ok):
        """Columns cols of the program's query heads from rows (pointers [16, 1]) into chunk j of q_smem as fp16,
        clamped to its range."""
        x = gl.load(rows + cols[None, :], mask=h_ok[:, None], other=0.0).to(gl.float32)
        q_smem.index(j).store(gl.minimum(gl.maximum(x, -65504.0), 65504.0).to(gl.float16))

    @gluon.jit
    def stage_queries(q_smem, q_lat_ptr, q_pe_ptr, head_tile, stride_qlh, stride_qph, num_heads,
                       REG_SCORES: gl.constexpr):
        """The program's query heads (one sequence's rows at q_lat_ptr / q_pe_ptr) into q_smem [9, 16, 64] as fp16:
        the eight latent chunks, then the RoPE part; with REG_SCORES each chunk's columns in the score operand's
        order (_score_columns)."""
        q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        qh = head_tile * HEADS_C + gl.arange(0, HEADS_C, layout=gl.SliceLayout(1, q_layout))
        qc = gl.arange(0, COLS_C, layout=gl.SliceLayout(0, q_layout))
        if REG_SCORES:
            qc = _score_columns(qc)
        qh_ok = qh < num_heads
        for j in gl.static_range(8):
            _stage_query(q_smem, j, q_lat_ptr + qh[:, None] * stride_qlh + j * COLS_C, qc, qh_ok)
        _stage_query(q_smem, 8, q_pe_ptr + qh[:, None] * stride_qph, qc, qh_ok)

    @gluon.jit
    def _score_columns(k):
        """REG_SCORES: the cache column (of a 64-wide chunk) that the score operand's column k holds, 16c + 4s + 2p + e
        for k = 16s + 8p + 2c + e (_score_operand's reorder; the query is staged in the same order)."""
        return ((k // 2) % 4) * 16 + (k // 16) * 4 + ((k // 8) % 2) * 2 + k % 2

    @gluon.jit
    def _score_operand(w, a_layout: gl.constexpr):
        """REG_SCORES: a widened chunk ([64 keys, 64 columns] fp16, in REG_SCORES' load layout) as the score
        product's A operand in registers. Its columns are reordered (_score_columns) so that the 16 bytes a thread
        loaded are, as they stand, the fragment the MMA wants of it: no data moves between threads (asserted)."""
        y = gl.permute(gl.reshape(w, [TOKENS_C, 4, 4, 2, 2]), (0, 2, 3, 1, 4))
        return gl.convert_layout(gl.reshape(y, [TOKENS_C, COLS_C]), a_layout, assert_trivial=True)

    @gluon.jit
    def _widen_and_score(c_smem, j: gl.constexpr, q_smem, z, codes, s, a_prev, a_layout: gl.constexpr,
                         first: gl.constexpr, stage: gl.constexpr):
        """REG_SCORES: chunk j's 8-bit codes widened, into shared memory for the output products (stage: latent
        chunks, not the RoPE part), and from registers into the scores: s += C_j q_j^T, in flight (score_chunk)."""
        w = codes.to(gl.float16)
        if stage:
            c_smem.index(j).store(w)
        return score_chunk(w, q_smem.index(j + z), s, a_prev, a_layout, first)

    @gluon.jit
    def score_chunk(w, q_chunk, s, a_prev, a_layout: gl.constexpr, first: gl.constexpr):
        """REG_SCORES: s += w q^T in flight, w a widened chunk ([64 keys, 64 columns] fp16 in the load layout) from
        registers, q_chunk the query's [16 heads, 64 columns] in shared memory. The wait leaves this product alone
        in flight: the one before it is done, and so are its operand's registers (a_prev); this one's are kept
        (returned) until the next wait."""
        a = _score_operand(w, a_layout)
        s = warpgroup_mma(a, q_chunk.permute((1, 0)), s, use_acc=not first, is_async=True)
        if first:
            s, a = warpgroup_mma_wait(1, deps=(s, a))
        else:
            s, a_prev, a = warpgroup_mma_wait(1, deps=(s, a_prev, a))
        return s, a

    @gluon.jit
    def key_range(seq_len, split, SPLIT: gl.constexpr):
        """[start, end) of the keys a program takes: with SPLIT, its split's partition (whole 64-key tiles) of the
        sequence's seq_len keys, else all of them."""
        if SPLIT:
            partition = gl.cdiv(gl.cdiv(seq_len, gl.num_programs(2)), TOKENS_C) * TOKENS_C
            start = split * partition
            return start, gl.minimum(start + partition, seq_len)
        return 0, seq_len

    @gluon.jit
    def softmax_step(s, s_ok, m_i, l_i, qk_scale):
        """One tile of the online softmax down the key axis (scores^T [64 keys, 16 heads], keys s_ok valid; float32
        statistics in the log2 domain): (probabilities, the rescale of what came before, new max, new sum)."""
        s = gl.where(s_ok[:, None], s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 0))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[None, :])
        return p, alpha, m_new, l_i * alpha + gl.sum(p, 0)

    @gluon.jit
    def output_rows(out_ptr, part_out_ptr, part_lse_ptr, b, split, oh, oh_ok, m_i, l_i, stride_ob, stride_oh,
                    stride_po_b, stride_po_h, stride_po_s, stride_pl_b, stride_pl_h, SPLIT: gl.constexpr):
        """Pointers [1, 16] to the output rows of heads oh: with SPLIT the split's partial rows, whose log-sum-exp
        (m_i + log2 l_i) is stored here, else the final ones."""
        if SPLIT:       # (a constexpr branch: one of the two pointer types is built)
            gl.store(part_lse_ptr + b * stride_pl_b + oh * stride_pl_h + split, m_i + gl.log2(l_i), mask=oh_ok)
            rows = part_out_ptr + b * stride_po_b + oh[None, :] * stride_po_h + split * stride_po_s
        else:
            rows = out_ptr + b * stride_ob + oh[None, :] * stride_oh
        return rows

    @gluon.jit
    def _store_out(rows, j: gl.constexpr, r, h_ok, acc, l_i):
        """out^T chunk j ([64 columns, 16 heads] float32) / l into the heads' rows (pointers [1, 16])."""
        gl.store(rows + j * COLS_C + r[:, None], (acc / l_i[None, :]).to(rows.dtype.element_ty), mask=h_ok[None, :])

    @gluon.jit
    def _mla_decode_wgmma_kernel(q_lat_ptr, q_pe_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr,
                                 out_ptr, part_out_ptr, part_lse_ptr, qk_scale,
                                 stride_qlb, stride_qlh, stride_qpb, stride_qph,
                                 stride_c_block, stride_c_slot, stride_bt, stride_ob, stride_oh,
                                 stride_po_b, stride_po_h, stride_po_s, stride_pl_b, stride_pl_h,
                                 num_heads, block_size,
                                 RANK: gl.constexpr, SPLIT: gl.constexpr, ASYNC: gl.constexpr = False,
                                 REG_SCORES: gl.constexpr = False):
        TOKENS: gl.constexpr = TOKENS_C
        HEADS: gl.constexpr = HEADS_C
        COLS: gl.constexpr = COLS_C
        CHUNKS: gl.constexpr = RANK // COLS
        gl.static_assert(CHUNKS == 8, "eight latent chunks (k0..k7, o0..o7 below)")
        # Loads: 16 bytes a thread a row, 4 threads a 64-byte chunk row, 8 rows a warp. REG_SCORES: the same, but
        # a warp's rows are the 16 of its MMA fragment (rows l and l + 8 of them a thread, l = lane / 4).
        if REG_SCORES:
            load_layout: gl.constexpr = gl.DistributedLinearLayout(
                reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [8, 0]],
                lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]],
                warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[TOKENS, COLS])
        else:
            load_layout: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, HEADS, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
        c_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TOKENS, COLS], gl.float16)
        q_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEADS, COLS], gl.float16)
        p_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEADS, TOKENS], gl.float16)
        # The widened chunks the products read from shared memory: with REG_SCORES only the output's 8.
        C_SLOTS: gl.constexpr = CHUNKS if REG_SCORES else CHUNKS + 1
        c_smem = gl.allocate_shared_memory(gl.float16, [C_SLOTS, TOKENS, COLS], c_shared)
        q_smem = gl.allocate_shared_memory(gl.float16, [CHUNKS + 1, HEADS, COLS], q_shared)
        p_smem = gl.allocate_shared_memory(gl.float16, [HEADS, TOKENS], p_shared)
        if ASYNC:
            # The next tile's chunks 3-7 as cp.async carries them, 8-bit (20 KB: two programs still fit an SM,
            # 2 x (94.5 + 20 + 1 reserved) of 228 KB). Rows of 64 bytes: a warp's 16-byte copies and loads cover 512
            # contiguous bytes, no swizzle needed. Two buffers: shapes are powers of 2.
            raw4 = gl.allocate_shared_memory(cache_ptr.dtype.element_ty, [4, TOKENS, COLS],
                                             gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
            raw1 = gl.allocate_shared_memory(cache_ptr.dtype.element_ty, [TOKENS, COLS],
                                             gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))

        b = gl.program_id(0).to(gl.int64)
        head_tile = gl.program_id(1)
        split = gl.program_id(2)
        table = block_tables_ptr + b * stride_bt
        start, end = key_range(gl.load(seq_lens_ptr + b).to(gl.int32), split, SPLIT)
        if start < end:
            stage_queries(q_smem, q_lat_ptr + b * stride_qlb, q_pe_ptr + b * stride_qpb, head_tile, stride_qlh,
                           stride_qph, num_heads, REG_SCORES)
            if REG_SCORES:      # the first tile's score products read it before the loop's first barrier
                fence_async_shared()
                cta_barrier()

            cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, load_layout))
            keys = gl.arange(0, TOKENS, layout=gl.SliceLayout(1, load_layout))
            s_keys = gl.arange(0, TOKENS, layout=gl.SliceLayout(1, mma_layout))
            m_i = gl.full([HEADS], float("-inf"), gl.float32, layout=gl.SliceLayout(0, mma_layout))
            l_i = gl.zeros([HEADS], gl.float32, layout=gl.SliceLayout(0, mma_layout))
            zero = gl.zeros([TOKENS, HEADS], gl.float32, layout=mma_layout)
            o0 = zero
            o1 = zero
            o2 = zero
            o3 = zero
            o4 = zero
            o5 = zero
            o6 = zero
            o7 = zero
            # The first tile's keys: its first chunks here (with ASYNC chunks 3-7 too), the rest in the loop. Each
            # later tile's first chunks load while the tile before it is computed (below).
            rows, t_ok = _tile_rows(table, cache_ptr, start, keys, end, block_size, stride_c_block, stride_c_slot)
            if ASYNC:     # the block table a tile ahead of the loads that use it
                blk_next = tile_blocks(table, start + TOKENS, keys, end, block_size)
            k0 = _load_chunk(rows, 0 * COLS, cols, t_ok)
            k1 = _load_chunk(rows, 1 * COLS, cols, t_ok)
            k2 = _load_chunk(rows, 2 * COLS, cols, t_ok)
            if ASYNC:
                _copy_chunks(raw4, raw1, rows, cols, t_ok)
            for n0 in range(start, end, TOKENS):
                if ASYNC:
                    k8 = _load_chunk(rows, RANK, cols, t_ok)
                else:
                    k3 = _load_chunk(rows, 3 * COLS, cols, t_ok)
                    k4 = _load_chunk(rows, 4 * COLS, cols, t_ok)
                    k5 = _load_chunk(rows, 5 * COLS, cols, t_ok)
                    k6 = _load_chunk(rows, 6 * COLS, cols, t_ok)
                    k7 = _load_chunk(rows, 7 * COLS, cols, t_ok)
                    k8 = _load_chunk(rows, RANK, cols, t_ok)
                # The previous tile's out products read C and p: done before they are overwritten.
                o0, o1, o2, o3, o4, o5, o6, o7 = warpgroup_mma_wait(0, deps=(o0, o1, o2, o3, o4, o5, o6, o7))
                # z is 0, but not to the compiler: the products' shared-memory descriptors are then computed in
                # the loop (uniform registers, cheap) instead of hoisted out of it, where 68 of them held 255
                # registers with spills (sm_90 builds with Triton 3.6 / 3.9: 250 / 240 registers with the prefetched
                # chunks, no spills; commit 121d439: 255 and spills).
                z = (n0 < 0).to(gl.int32)
                if REG_SCORES:
                    # Each chunk goes into the scores as it is widened (ASYNC: chunks 3-7 from the cp.async copies).
                    s, a = _widen_and_score(c_smem, 0, q_smem, z, k0, zero, zero, a_layout, True, True)
                    s, a = _widen_and_score(c_smem, 1, q_smem, z, k1, s, a, a_layout, False, True)
                    s, a = _widen_and_score(c_smem, 2, q_smem, z, k2, s, a, a_layout, False, True)
                    if ASYNC:
                        async_copy.wait_group(0)
                        cta_barrier()
                        for j in gl.static_range(4):
                            s, a = _widen_and_score(c_smem, 3 + j, q_smem, z, raw4.index(j).load(load_layout), s, a,
                                                    a_layout, False, True)
                        s, a = _widen_and_score(c_smem, 7, q_smem, z, raw1.load(load_layout), s, a, a_layout, False,
                                                True)
                    else:
                        s, a = _widen_and_score(c_smem, 3, q_smem, z, k3, s, a, a_layout, False, True)
                        s, a = _widen_and_score(c_smem, 4, q_smem, z, k4, s, a, a_layout, False, True)
                        s, a = _widen_and_score(c_smem, 5, q_smem, z, k5, s, a, a_layout, False, True)
                        s, a = _widen_and_score(c_smem, 6, q_smem, z, k6, s, a, a_layout, False, True)
                        s, a = _widen_and_score(c_smem, 7, q_smem, z, k7, s, a, a_layout, False, True)
                    s, a = _widen_and_score(c_smem, 8, q_smem, z, k8, s, a, a_layout, False, False)
                else:
                    _stage_chunk(c_smem, 0, k0)
                    _stage_chunk(c_smem, 1, k1)
                    _stage_chunk(c_smem, 2, k2)
                    if ASYNC:
                        _stage_copied_chunks(c_smem, raw4, raw1, load_layout)
                    else:
                        _stage_chunk(c_smem, 3, k3)
                        _stage_chunk(c_smem, 4, k4)
                        _stage_chunk(c_smem, 5, k5)
                        _stage_chunk(c_smem, 6, k6)
                        _stage_chunk(c_smem, 7, k7)
                    _stage_chunk(c_smem, 8, k8)
                fence_async_shared()
                cta_barrier()
                # The next tile's first chunks go in flight now, to arrive while this tile's products and softmax
                # run (all masked off after the last tile: no memory is read). With ASYNC its chunks 3-7 too, into
                # shared memory (every thread has read this tile's copies there: the barrier above).
                if ASYNC:
                    rows, t_ok = block_rows(blk_next, cache_ptr, n0 + TOKENS, keys, end, block_size, stride_c_block,
                                             stride_c_slot)
                    blk_next = tile_blocks(table, n0 + 2 * TOKENS, keys, end, block_size)
                else:
                    rows, t_ok = _tile_rows(table, cache_ptr, n0 + TOKENS, keys, end, block_size, stride_c_block,
                                            stride_c_slot)
                k0 = _load_chunk(rows, 0 * COLS, cols, t_ok)
                k1 = _load_chunk(rows, 1 * COLS, cols, t_ok)
                k2 = _load_chunk(rows, 2 * COLS, cols, t_ok)
                if ASYNC:
                    _copy_chunks(raw4, raw1, rows, cols, t_ok)

                if REG_SCORES:
                    s, a = warpgroup_mma_wait(0, deps=(s, a))
                else:
                    s = warpgroup_mma(c_smem.index(z), q_smem.index(z).permute((1, 0)), zero, use_acc=False,
                                      is_async=True)
                    for j in gl.static_range(1, CHUNKS + 1):
                        s = warpgroup_mma(c_smem.index(j + z), q_smem.index(j + z).permute((1, 0)), s, is_async=True)
                    s = warpgroup_mma_wait(0, deps=(s,))

                p, alpha, m_i, l_i = softmax_step(s, (n0 + s_keys) < end, m_i, l_i, qk_scale)
                p_smem.store(gl.permute(p.to(gl.float16), (1, 0)))
                fence_async_shared()
                cta_barrier()

                pt = p_smem.permute((1, 0))
                o0 = warpgroup_mma(c_smem.index(0 + z).permute((1, 0)), pt, o0 * alpha[None, :], is_async=True)
                o1 = warpgroup_mma(c_smem.index(1 + z).permute((1, 0)), pt, o1 * alpha[None, :], is_async=True)
                o2 = warpgroup_mma(c_smem.index(2 + z).permute((1, 0)), pt, o2 * alpha[None, :], is_async=True)
                o3 = warpgroup_mma(c_smem.index(3 + z).permute((1, 0)), pt, o3 * alpha[None, :], is_async=True)
                o4 = warpgroup_mma(c_smem.index(4 + z).permute((1, 0)), pt, o4 * alpha[None, :], is_async=True)
                o5 = warpgroup_mma(c_smem.index(5 + z).permute((1, 0)), pt, o5 * alpha[None, :], is_async=True)
                o6 = warpgroup_mma(c_smem.index(6 + z).permute((1, 0)), pt, o6 * alpha[None, :], is_async=True)
                o7 = warpgroup_mma(c_smem.index(7 + z).permute((1, 0)), pt, o7 * alpha[None, :], is_async=True)
                # Back to tensors for the loop (no wait yet: the next tile's keys load first).
                o0, o1, o2, o3, o4, o5, o6, o7 = warpgroup_mma_wait(8, deps=(o0, o1, o2, o3, o4, o5, o6, o7))
            o0, o1, o2, o3, o4, o5, o6, o7 = warpgroup_mma_wait(0, deps=(o0, o1, o2, o3, o4, o5, o6, o7))
            if ASYNC:
                async_copy.wait_group(0)        # the last (masked, empty) group: none in flight at exit

            oh = head_tile * HEADS + gl.arange(0, HEADS, layout=gl.SliceLayout(0, mma_layout))
            r = gl.arange(0, COLS, layout=gl.SliceLayout(1, mma_layout))
            oh_ok = oh < num_heads
            o_rows = output_rows(out_ptr, part_out_ptr, part_lse_ptr, b, split, oh, oh_ok, m_i, l_i, stride_ob,
                                 stride_oh, stride_po_b, stride_po_h, stride_po_s, stride_pl_b, stride_pl_h, SPLIT)
            _store_out(o_rows, 0, r, oh_ok, o0, l_i)
            _store_out(o_rows, 1, r, oh_ok, o1, l_i)
            _store_out(o_rows, 2, r, oh_ok, o2, l_i)
            _store_out(o_rows, 3, r, oh_ok, o3, l_i)
            _store_out(o_rows, 4, r, oh_ok, o4, l_i)
            _store_out(o_rows, 5, r, oh_ok, o5, l_i)
            _store_out(o_rows, 6, r, oh_ok, o6, l_i)
            _store_out(o_rows, 7, r, oh_ok, o7, l_i)


def launch_mla_decode_wgmma(q_lat, q_pe, kv_cache, block_tables, seq_lens, out, part_out, part_lse, qk_scale: float,
                            num_splits: int, copy_async: bool = False, reg_scores: bool = False) -> None:
    """One launch of the kernel over a (bsz, head tiles, num_splits) grid; the caller sized the split partials
    (part_out [B, H, S, R] float32, part_lse [B, H, S]) where num_splits > 1 and merges them (mla_reduce, 64-key
    partitions). qk_scale: the softmax scale times log2(e). copy_async: the next tile's chunks 3-7 by cp.async
    and the block table a tile ahead (DEEPSERVE_MLA_WGMMA_ASYNC). reg_scores: the score products' keys from
    registers (DEEPSERVE_MLA_WGMMA_REG_SCORES)."""
    bsz, heads, rank = q_lat.shape
    split = num_splits > 1
    po = (part_out.stride(0), part_out.stride(1), part_out.stride(2)) if split else (0, 0, 0)
    pl = (part_lse.stride(0), part_lse.stride(1)) if split else (0, 0)
    _mla_decode_wgmma_kernel[(bsz, triton.cdiv(heads, HEADS), num_splits)](
        q_lat, q_pe, kv_cache, block_tables, seq_lens, out, part_out, part_lse, qk_scale,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        *po, *pl, heads, kv_cache.shape[1], RANK=rank, SPLIT=split, ASYNC=copy_async,
        REG_SCORES=reg_scores, num_warps=4)


__all__ = ["HAVE_GLUON", "TOKENS", "launch_mla_decode_wgmma", "wgmma_supported"]
