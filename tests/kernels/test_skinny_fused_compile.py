"""The skinny GEMM's fused modes (kernels/skinny_gemm.py NORM, RESIDUAL: the few-row decode path of
DEEPSERVE_FUSED_NORMS_MAX_ROWS) on the sm_90 build, without a GPU: each compiles at the tiles the engine gives
Llama-3.2-1B's weights, and with the norm in the K loop the weight tiles still stream through cp.async copies into
shared memory (the pipeline the kernel's speed rests on), the x tile too."""

import pytest

from tests.kernels.sm90_compile import aligned, compile_for_sm90, compile_sm90_kernel


@pytest.fixture(autouse=True)
def _triton(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")      # the default today; Triton 3.9 warns when unset


def _ptx(n: int, k: int, swiglu: bool, norm: bool, residual: bool, rows: int = 8) -> str:
    from deepserve.kernels.skinny_gemm import _skinny_kernel, rows_tiles, skinny_tiles, skinny_wide_tiles
    block_m, tiles = rows_tiles(rows, (skinny_wide_tiles(n, k, swiglu) if rows > 32 else None) or skinny_tiles(n, k))
    constexprs = dict(HAS_BIAS=False, SWIGLU=swiglu, HAS_LIMIT=False, TWO=False, ACCURATE_EXP=True,
                      EVEN_K=k % tiles.block_k == 0, BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                      PREFETCH=tiles.prefetch, SPLIT_K=tiles.split_k, NORM=norm, RESIDUAL=residual, USE_PDL=True)
    compiled = compile_sm90_kernel(_skinny_kernel, {"part_ptr": "*fp32", "counter_ptr": "*i32"}, constexprs,
                                   {"limit": "fp32", "eps": "fp32"},
                                   aligned(_skinny_kernel) + ("n_out", "k_len", "k_per_split"),
                                   tiles.warps, tiles.stages)
    assert compiled.metadata.shared <= 227 * 1024, "more shared memory than an sm_90 program may take"
    return compiled.asm["ptx"]


@pytest.mark.parametrize("n,k,swiglu,rows", [(3072, 2048, False, 8), (16384, 2048, True, 8), (3072, 2048, False, 64),
                                             (16384, 2048, True, 64)])
def test_norm_in_the_k_loop_keeps_the_async_copies(n, k, swiglu, rows):
    ptx = _ptx(n, k, swiglu, norm=True, residual=False, rows=rows)
    copies = ptx.count("cp.async.cg.shared.global") + ptx.count("cp.async.ca.shared.global")
    plain = _ptx(n, k, swiglu, norm=False, residual=False, rows=rows)
    assert copies >= plain.count("cp.async.cg.shared.global") + plain.count("cp.async.ca.shared.global") > 0
    assert "sqrt" in ptx and "sqrt" not in plain        # rstd, once the loop has seen every column


@pytest.mark.parametrize("n,k", [(2048, 2048), (2048, 8192)])      # o_proj; down, split in 4 along K
def test_residual_epilogue_compiles(n, k):
    assert "cp.async" in _ptx(n, k, False, norm=False, residual=True)


@pytest.mark.parametrize("n,k,head_dim,norm", [(3072, 2048, 64, True), (6144, 4096, 128, False)])
def test_qkv_rotary_few_rows_compiles(n, k, head_dim, norm):
    """kernels/qkv_rotary.py's skinny version (DEEPSERVE_QKV_ROTARY_MAX_ROWS) at Llama-3.2-1B's qkv (with the norm
    in the K loop) and Llama-3-8B's, into an E4M3 cache: its weight tiles through cp.async copies too."""
    from deepserve.kernels.qkv_rotary import _skinny_qkv_rotary_write_kernel as kernel
    from deepserve.kernels.skinny_gemm import skinny_tiles
    tiles = skinny_tiles(n, k)
    ptx = compile_for_sm90(kernel, {"pos_ptr": "*i64", "slot_ptr": "*i64", "cache_ptr": "*fp8e4nv",
                                    "cos_ptr": "*fp32", "sin_ptr": "*fp32"},
                           dict(HEAD_DIM=head_dim, HALF_CACHE=False, HAS_BIAS=False, NORM=norm,
                                EVEN_K=k % tiles.block_k == 0, BLOCK_M=16, BLOCK_N=tiles.block_n,
                                BLOCK_K=tiles.block_k, PREFETCH=tiles.prefetch, USE_PDL=True),
                           {"eps": "fp32"}, divisible_by_16=aligned(kernel) + ("k_len",))
    assert "cp.async.cg.shared.global" in ptx or "cp.async.ca.shared.global" in ptx
