"""The skinny GEMM (kernels/skinny_gemm.py, small-batch decode's GEMMs) on the sm_90 build, without a GPU: it
compiles at the tiles the engine gives Llama-3.2-1B's weights (split-K, the SwiGLU epilogue, 64 rows) within an
sm_90 program's shared memory, and its weight and activation tiles stream through cp.async copies into shared
memory, the pipeline its speed rests on."""

import pytest

from tests.kernels.sm90_compile import aligned, compile_sm90_kernel


@pytest.fixture(autouse=True)
def _triton(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")      # the default today; Triton 3.9 warns when unset


@pytest.mark.parametrize("n,k,swiglu,rows", [(3072, 2048, False, 8), (2048, 8192, False, 8),
                                             (16384, 2048, True, 8), (16384, 2048, True, 64),
                                             (2048, 8192, False, 64)])
def test_engine_tiles_compile_with_async_copies(n, k, swiglu, rows):
    from deepserve.kernels.skinny_gemm import _skinny_kernel, rows_tiles, skinny_tiles, skinny_wide_tiles
    block_m, tiles = rows_tiles(rows, (skinny_wide_tiles(n, k, swiglu) if rows > 32 else None) or skinny_tiles(n, k))
    assert (tiles.split_k > 1) == (k == 8192)
    constexprs = dict(HAS_BIAS=False, SWIGLU=swiglu, HAS_LIMIT=False, TWO=False, ACCURATE_EXP=True,
                      EVEN_K=k % tiles.block_k == 0, BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                      PREFETCH=tiles.prefetch, SPLIT_K=tiles.split_k, USE_PDL=True)
    compiled = compile_sm90_kernel(_skinny_kernel, {"part_ptr": "*fp32", "counter_ptr": "*i32"}, constexprs,
                                   {"limit": "fp32"}, aligned(_skinny_kernel) + ("n_out", "k_len", "k_per_split"),
                                   tiles.warps, tiles.stages)
    assert compiled.metadata.shared <= 227 * 1024, "more shared memory than an sm_90 program may take"
    ptx = compiled.asm["ptx"]
    assert ptx.count("cp.async.cg.shared.global") + ptx.count("cp.async.ca.shared.global") > 0
    assert ("atom.global" in ptx) == (tiles.split_k > 1)        # the split's tile counter (`_split_k_sum`)
