"""DEEPSERVE_MLA_REGISTER_PREFETCH, compiled for sm_90 without a GPU: over an E4M3 cache the MLA decode kernel's
codes load into registers a tile ahead on one pipeline stage, with no cp.async copy into shared memory, and still
widen in registers into 16-bit tiles that ldmatrix transposes for the value products (no 8-bit shared-memory
reads); the default build stages them through cp.async. Whether the results are right is
tests/gpu/test_mla_decode.py's."""

import pytest

from tests.kernels.sm90_compile import aligned, compile_sm90_kernel

POINTERS = {"cache_ptr": "*fp8e4nv", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "block_tables_ptr": "*i32",
            "seq_lens_ptr": "*i32"}


def mla_ptx(register_prefetch: bool, block_n: int, warps: int, stages: int) -> str:
    from deepserve.kernels.mla_decode import _mla_decode_kernel
    constexprs = dict(RANK=512, ROPE=64, CHUNK=128, BLOCK_P=64, BLOCK_H=16, BLOCK_N=block_n, SPLIT=False,
                      PRECISION="tf32", INPUTS_READY=True, USE_PDL=True, REGISTER_PREFETCH=register_prefetch)
    return compile_sm90_kernel(_mla_decode_kernel, POINTERS, constexprs, {"qk_scale": "fp32"},
                               aligned(_mla_decode_kernel), warps, stages).asm["ptx"]


@pytest.fixture(autouse=True)
def _triton(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")


def test_register_prefetch_build_has_no_shared_memory_staging_of_the_codes():
    from deepserve.kernels.kv_rounding import FP8_WIDEN
    if FP8_WIDEN != 1:
        pytest.skip("DEEPSERVE_FP8_WIDEN is set to another value")
    default = mla_ptx(False, 32, 4, 3)
    assert "cp.async" in default
    for block_n, warps in ((16, 4), (32, 8)):       # the builds without spills (kernel_resources.py)
        ptx = mla_ptx(True, block_n, warps, 1)
        assert "cp.async" not in ptx
        assert "ld.global" in ptx and "cvt.rn.f16x2.e4m3x2" in ptx
        assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx
        assert "ld.shared.b8" not in ptx and "ld.shared.v2.b8" not in ptx and "ld.shared.v4.b8" not in ptx
