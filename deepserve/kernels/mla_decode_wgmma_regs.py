"""MLA decode on Hopper's warpgroup MMAs with both products' keys in registers (DEEPSERVE_MLA_WGMMA_REG_OUT): the
8-bit key tiles stay 8-bit in shared memory, in a ring of two that cp.async fills a whole tile ahead.

Why: mla_decode_wgmma.py's kernel stores every tile widened to fp16 in shared memory (64 KB), because its output
products read their A operand (the keys transposed: latent columns as the MMA's rows) from there. Two programs an SM
then leave room for only part of the next tile in flight (chunks 0-2 in registers, 3-7 by cp.async, the RoPE chunk
loaded at the tile's start), and each tile waits on much of its own loads' latency: at V2-Lite batch 256 (1k
context, one split) a call took ~75 us on an H100 for ~50 us of bytes (session 57).

Here shared memory holds what cp.async brings, 8-bit: 37 KB a tile, two tiles (72 KB) plus the query (18 KB) and the
probabilities (2 KB), so two programs still fit an SM, and a tile's copies go out before the tile ahead of it is
computed. Both products take the keys from those bytes, each in its own register layout:
  scores^T [64 keys, 16 heads] = sum over chunks of C_j q_j^T, as REG_SCORES (mla_decode_wgmma._score_operand):
      a thread loads 16 bytes of two key rows a chunk, the fragment as it stands once the columns are reordered;
  out^T [64 rows, 16 heads] += C^T p^T in 16-key steps, eight products a step: a thread loads 16 bytes of four key
      rows (2q, 2q + 1, 2q + 8, 2q + 9 of the step, q = lane % 4), the 16 latent columns 16g .. 16g + 15 where
      g = 8 * warp + lane / 4; product j takes columns 16g + 2j and 16g + 2j + 1 of them as its rows
      16 * warp + lane / 4 and that + 8, which is where an MMA's A fragment has them. So product j's row m holds
      latent column 16 * (8 * (m // 16) + m % 8) + 2j + (m % 16) // 8 (_out_columns), and the rows are put back
      in place when the output is stored. The conversion from the loaded bytes to the eight fragments moves no
      data between threads (asserted at compile time), and the 16-byte loads of both layouts meet no bank conflicts
      in the swizzled tile (tests/kernels checks the count).
Shared-memory traffic a tile: ~37 KB copied in, ~74 KB read into registers, the query (18 KB) and the probabilities
(16 KB) read by the MMAs: ~145 KB, against ~200 KB in mla_decode_wgmma.py's default path.

Arithmetic as mla_decode_wgmma.py's (the query clamped to fp16's range and rounded to fp16, the cache's codes widened
exactly, probabilities in fp16, float32 accumulation); only the order of the sums inside the products differs.
Same scope (a 512-wide latent, a 64-wide RoPE part, 8-bit caches, sm_90, Gluon as Triton 3.6 and 3.9 spell it),
same grid and split partials; no PDL.
"""

from __future__ import annotations

from deepserve.kernels import mla_decode_wgmma as base, triton

HAVE_GLUON = base.HAVE_GLUON
if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    from deepserve.kernels.mla_decode_wgmma import (COLS_C, HEADS_C, TOKENS_C, block_rows, copy_to_shared,
                                                    cta_barrier, key_range, output_rows, score_chunk, softmax_step,
                                                    stage_queries, tile_blocks)

    def lat_shared_layout(rows: int):
        """The latent ring's shared layout for `rows` rows of 128 bytes (a power of two >= 8): a row's 16-byte
        group g lies at group g ^ f(row), f linear in the row's bits 0-2 (f(1) = 4, f(2) = 2, f(4) = 6), so that
        every quarter warp's 16-byte accesses (copies and score loads: two neighbouring rows, four groups each;
        output loads: four rows 2 apart, two groups each) meet eight different groups of banks."""
        row_bases = [[1, 64], [2, 32], [4, 96]] + [[1 << i, 0] for i in range(3, rows.bit_length() - 1)]
        return gl.SharedLinearLayout(offset_bases=[[0, 1 << i] for i in range(7)] + row_bases)

    # cp.async: 16 bytes a thread, 4 threads a 64-byte row piece, 8 rows a warp.
    COPY_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0]))
    # Score loads of a [64 keys, 128 columns] block, two chunks at once: REG_SCORES' layout (a warp's rows are the
    # 16 of its MMA fragment) for each 64-column half; PE_LAYOUT the same for the [64, 64] RoPE chunk.
    SCORE_LAYOUT = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [8, 0], [0, 64]],
        lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]], warp_bases=[[16, 0], [32, 0]], block_bases=[],
        shape=[64, 128]))
    PE_LAYOUT = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [8, 0]],
        lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]], warp_bases=[[16, 0], [32, 0]], block_bases=[],
        shape=[64, 64]))
    # Output loads of a 16-key step ([4 blocks, 16 keys, 128 columns]): warp w reads block w, lane l the 16
    # columns from 16 * (l / 4) of key 2 * (l % 4) and keys +1, +8, +9 (registers).
    OUT_LAYOUT = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 1, 0], [0, 8, 0]],
        lane_bases=[[0, 2, 0], [0, 4, 0], [0, 0, 16], [0, 0, 32], [0, 0, 64]], warp_bases=[[1, 0, 0], [2, 0, 0]],
        block_bases=[], shape=[4, 16, 128]))
    LAT_RING_LAYOUT = gl.constexpr(lat_shared_layout(256))

    @gluon.jit
    def _copy_tile(lat, pe, rows, cols, pe_cols, t_ok):
        """cp.async of one tile's key rows (pointers [64, 1]), 8-bit, masked keys filled with 0: the latent columns
        into lat [256, 128] (rows 64c + key hold columns 128c .. 128c + 127) and the RoPE part into pe [64, 64]; one
        commit group. cols / pe_cols: 0 .. 127 / 0 .. 63 in the pointers' layout."""
        for c in gl.static_range(4):
            copy_to_shared(lat.slice(64 * c, 64, dim=0), rows + 128 * c + cols[None, :], mask=t_ok[:, None])
        copy_to_shared(pe, rows + 512 + pe_cols[None, :], mask=t_ok[:, None])
        async_copy.commit_group()

    @gluon.jit
    def _split_halves(w):
        """[64, 128] -> its columns 0 .. 63 and 64 .. 127, each [64, 64] (the halves are a thread's registers)."""
        return gl.split(gl.permute(gl.reshape(w, [64, 2, 64]), (0, 2, 1)))

    @gluon.jit
    def _out_operands(t, a_layout: gl.constexpr):
        """A 16-key step of the tile's latent columns ([4, 16 keys, 128 columns] fp16: lat's four 128-column
        blocks, in the output load layout) -> the eight output products' A operands [64 rows, 16 keys], product j's
        row m holding latent column _out_columns(m, j). Column 128c + 16g + 2j + e (g = lane / 4) goes to product j,
        row 16c + 8e + g: the columns a thread loaded are its fragments' rows, so no data moves between threads
        (asserted)."""
        y = gl.permute(gl.reshape(t, [4, 16, 8, 8, 2]), (0, 4, 2, 1, 3))      # (c, e, g, key, j)
        y = gl.reshape(y, [64, 16, 2, 2, 2])                                   # rows 16c + 8e + g; j = 4a + 2b + d
        even, odd = gl.split(y)
        even0, even1 = gl.split(even)
        odd0, odd1 = gl.split(odd)
        j0, j4 = gl.split(even0)
        j2, j6 = gl.split(even1)
        j1, j5 = gl.split(odd0)
        j3, j7 = gl.split(odd1)
        return (_in_place(j0, a_layout), _in_place(j1, a_layout), _in_place(j2, a_layout), _in_place(j3, a_layout),
                _in_place(j4, a_layout), _in_place(j5, a_layout), _in_place(j6, a_layout), _in_place(j7, a_layout))

    @gluon.jit
    def _in_place(x, layout: gl.constexpr):
        """x in `layout`, asserted (at compile time) to move no data between threads."""
        return gl.convert_layout(x, layout, assert_trivial=True)

    @gluon.jit
    def _out_columns(m, j: gl.constexpr):
        """The latent column that row m of output product j holds (_out_operands)."""
        return 16 * (8 * (m // 16) + m % 8) + 2 * j + (m % 16) // 8

    @gluon.jit
    def _store_out(rows, m, j: gl.constexpr, h_ok, acc, l_i):
        """out^T of product j ([64 rows, 16 heads] float32) / l into the heads' rows (pointers [1, 16])."""
        gl.store(rows + _out_columns(m, j)[:, None], (acc / l_i[None, :]).to(rows.dtype.element_ty),
                 mask=h_ok[None, :])

    @gluon.jit
    def _mla_decode_regs_kernel(q_lat_ptr, q_pe_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr,
                                out_ptr, part_out_ptr, part_lse_ptr, qk_scale,
                                stride_qlb, stride_qlh, stride_qpb, stride_qph,
                                stride_c_block, stride_c_slot, stride_bt, stride_ob, stride_oh,
                                stride_po_b, stride_po_h, stride_po_s, stride_pl_b, stride_pl_h,
                                num_heads, block_size, SPLIT: gl.constexpr):
        TOKENS: gl.constexpr = TOKENS_C
        HEADS: gl.constexpr = HEADS_C
        COLS: gl.constexpr = COLS_C
        copy_layout: gl.constexpr = COPY_LAYOUT
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, HEADS, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
        q_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEADS, COLS], gl.float16)
        p_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEADS, TOKENS], gl.float16)
        q_smem = gl.allocate_shared_memory(gl.float16, [9, HEADS, COLS], q_shared)
        p_smem = gl.allocate_shared_memory(gl.float16, [HEADS, TOKENS], p_shared)
        # Two tiles of 8-bit rows: the latent part swizzled (lat_shared_layout), the RoPE part's 64-byte rows need
        # no swizzle.
        lat_ring = gl.allocate_shared_memory(cache_ptr.dtype.element_ty, [2, 4 * TOKENS, 128], LAT_RING_LAYOUT)
        pe_ring = gl.allocate_shared_memory(cache_ptr.dtype.element_ty, [2, TOKENS, COLS],
                                            gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))

        b = gl.program_id(0).to(gl.int64)
        head_tile = gl.program_id(1)
        split = gl.program_id(2)
        table = block_tables_ptr + b * stride_bt
        start, end = key_range(gl.load(seq_lens_ptr + b).to(gl.int32), split, SPLIT)
        if start < end:
            # The first tile's copies go out before anything else, then the query is staged.
            keys = gl.arange(0, TOKENS, layout=gl.SliceLayout(1, copy_layout))
            cols = gl.arange(0, 128, layout=gl.SliceLayout(0, copy_layout))
            pe_cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, copy_layout))
            blk = tile_blocks(table, start, keys, end, block_size)
            rows, t_ok = block_rows(blk, cache_ptr, start, keys, end, block_size, stride_c_block, stride_c_slot)
            _copy_tile(lat_ring.index(0), pe_ring.index(0), rows, cols, pe_cols, t_ok)
            blk_next = tile_blocks(table, start + TOKENS, keys, end, block_size)
            stage_queries(q_smem, q_lat_ptr + b * stride_qlb, q_pe_ptr + b * stride_qpb, head_tile, stride_qlh,
                           stride_qph, num_heads, True)
            fence_async_shared()

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
            stage = 0
            for n0 in range(start, end, TOKENS):
                # This tile's copies have landed, for every thread (and every thread is done with the other
                # buffer, the tile before's): the next tile's copies go out into it (masked off past the end).
                async_copy.wait_group(0)
                cta_barrier()
                rows, t_ok = block_rows(blk_next, cache_ptr, n0 + TOKENS, keys, end, block_size, stride_c_block,
                                         stride_c_slot)
                blk_next = tile_blocks(table, n0 + 2 * TOKENS, keys, end, block_size)
                _copy_tile(lat_ring.index(1 - stage), pe_ring.index(1 - stage), rows, cols, pe_cols, t_ok)
                lat = lat_ring.index(stage)
                # z is 0, but not to the compiler: the query chunks' descriptors are computed in the loop, not held
                # in registers across it (mla_decode_wgmma.py).
                z = (n0 < 0).to(gl.int32)

                # Scores: chunk j is lat's block j // 2, half j % 2; the RoPE chunk last.
                w = lat.slice(0, TOKENS, dim=0).load(SCORE_LAYOUT).to(gl.float16)
                lo, hi = _split_halves(w)
                s, a = score_chunk(lo, q_smem.index(0 + z), zero, zero, a_layout, True)
                s, a = score_chunk(hi, q_smem.index(1 + z), s, a, a_layout, False)
                for c in gl.static_range(1, 4):
                    w = lat.slice(c * TOKENS, TOKENS, dim=0).load(SCORE_LAYOUT).to(gl.float16)
                    lo, hi = _split_halves(w)
                    s, a = score_chunk(lo, q_smem.index(2 * c + z), s, a, a_layout, False)
                    s, a = score_chunk(hi, q_smem.index(2 * c + 1 + z), s, a, a_layout, False)
                w = pe_ring.index(stage).load(PE_LAYOUT).to(gl.float16)
                s, a = score_chunk(w, q_smem.index(8 + z), s, a, a_layout, False)
                s, a = warpgroup_mma_wait(0, deps=(s, a))

                p, alpha, m_i, l_i = softmax_step(s, (n0 + s_keys) < end, m_i, l_i, qk_scale)
                p_smem.store(gl.permute(p.to(gl.float16), (1, 0)))
                fence_async_shared()
                cta_barrier()

                # Output: four 16-key steps of eight products each; a step's operands stay live until the next
                # step's products are in flight (the wait leaves those 8 alone).
                lat_steps = lat.reshape([4, TOKENS, 128])
                pt = p_smem.permute((1, 0))
                t = lat_steps.slice(0, 16, dim=1).load(OUT_LAYOUT).to(gl.float16)
                a0, a1, a2, a3, a4, a5, a6, a7 = _out_operands(t, a_layout)
                b0 = pt.slice(0, 16, dim=0)
                o0 = warpgroup_mma(a0, b0, o0 * alpha[None, :], is_async=True)
                o1 = warpgroup_mma(a1, b0, o1 * alpha[None, :], is_async=True)
                o2 = warpgroup_mma(a2, b0, o2 * alpha[None, :], is_async=True)
                o3 = warpgroup_mma(a3, b0, o3 * alpha[None, :], is_async=True)
                o4 = warpgroup_mma(a4, b0, o4 * alpha[None, :], is_async=True)
                o5 = warpgroup_mma(a5, b0, o5 * alpha[None, :], is_async=True)
                o6 = warpgroup_mma(a6, b0, o6 * alpha[None, :], is_async=True)
                o7 = warpgroup_mma(a7, b0, o7 * alpha[None, :], is_async=True)
                for kb in gl.static_range(1, 4):
                    t = lat_steps.slice(16 * kb, 16, dim=1).load(OUT_LAYOUT).to(gl.float16)
                    c0, c1, c2, c3, c4, c5, c6, c7 = _out_operands(t, a_layout)
                    bk = pt.slice(16 * kb, 16, dim=0)
                    o0 = warpgroup_mma(c0, bk, o0, is_async=True)
                    o1 = warpgroup_mma(c1, bk, o1, is_async=True)
                    o2 = warpgroup_mma(c2, bk, o2, is_async=True)
                    o3 = warpgroup_mma(c3, bk, o3, is_async=True)
                    o4 = warpgroup_mma(c4, bk, o4, is_async=True)
                    o5 = warpgroup_mma(c5, bk, o5, is_async=True)
                    o6 = warpgroup_mma(c6, bk, o6, is_async=True)
                    o7 = warpgroup_mma(c7, bk, o7, is_async=True)
                    (o0, o1, o2, o3, o4, o5, o6, o7, a0, a1, a2, a3, a4, a5, a6, a7,
                     c0, c1, c2, c3, c4, c5, c6, c7) = warpgroup_mma_wait(
                        8, deps=(o0, o1, o2, o3, o4, o5, o6, o7, a0, a1, a2, a3, a4, a5, a6, a7,
                                 c0, c1, c2, c3, c4, c5, c6, c7))
                    a0, a1, a2, a3, a4, a5, a6, a7 = c0, c1, c2, c3, c4, c5, c6, c7
                # Done before the next tile writes p and before these operands' registers are reused.
                o0, o1, o2, o3, o4, o5, o6, o7, a0, a1, a2, a3, a4, a5, a6, a7 = warpgroup_mma_wait(
                    0, deps=(o0, o1, o2, o3, o4, o5, o6, o7, a0, a1, a2, a3, a4, a5, a6, a7))
                stage = 1 - stage
            async_copy.wait_group(0)        # the last (masked, empty) group: none in flight at exit

            oh = head_tile * HEADS + gl.arange(0, HEADS, layout=gl.SliceLayout(0, mma_layout))
            m = gl.arange(0, TOKENS, layout=gl.SliceLayout(1, mma_layout))
            oh_ok = oh < num_heads
            o_rows = output_rows(out_ptr, part_out_ptr, part_lse_ptr, b, split, oh, oh_ok, m_i, l_i, stride_ob,
                                 stride_oh, stride_po_b, stride_po_h, stride_po_s, stride_pl_b, stride_pl_h, SPLIT)
            _store_out(o_rows, m, 0, oh_ok, o0, l_i)
            _store_out(o_rows, m, 1, oh_ok, o1, l_i)
            _store_out(o_rows, m, 2, oh_ok, o2, l_i)
            _store_out(o_rows, m, 3, oh_ok, o3, l_i)
            _store_out(o_rows, m, 4, oh_ok, o4, l_i)
            _store_out(o_rows, m, 5, oh_ok, o5, l_i)
            _store_out(o_rows, m, 6, oh_ok, o6, l_i)
            _store_out(o_rows, m, 7, oh_ok, o7, l_i)


def launch_mla_decode_wgmma_regs(q_lat, q_pe, kv_cache, block_tables, seq_lens, out, part_out, part_lse,
                                 qk_scale: float, num_splits: int) -> None:
    """mla_decode_wgmma.launch_mla_decode_wgmma's contract (the same grid, split partials and merge), this
    kernel."""
    bsz, heads, _ = q_lat.shape
    split = num_splits > 1
    po = (part_out.stride(0), part_out.stride(1), part_out.stride(2)) if split else (0, 0, 0)
    pl = (part_lse.stride(0), part_lse.stride(1)) if split else (0, 0)
    _mla_decode_regs_kernel[(bsz, triton.cdiv(heads, base.HEADS), num_splits)](
        q_lat, q_pe, kv_cache, block_tables, seq_lens, out, part_out, part_lse, qk_scale,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        *po, *pl, heads, kv_cache.shape[1], SPLIT=split, num_warps=4)


__all__ = ["HAVE_GLUON", "launch_mla_decode_wgmma_regs"]
