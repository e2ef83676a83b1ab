"""DEEPSERVE_MLA_FP8_KEYS=late (kernels/mla_decode.py), checked on the sm_90 build without a GPU: over an E4M3 cache
the score products widen the staged 8-bit codes themselves, so the 16-bit tile the values widened in registers is
read by ldmatrix for the value products only (fewer ldmatrix, less shared memory); over a bf16 cache the switch
builds the same kernel."""

import re

import pytest

from tests.kernels.sm90_compile import aligned, compile_sm90_kernel


@pytest.fixture(autouse=True)
def _triton(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")      # the default today; Triton 3.9 warns when unset


def _build(cache: str, keys_late: bool):
    from deepserve.kernels.mla_decode import _mla_decode_kernel
    ptrs = {"cache_ptr": f"*{cache}", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "block_tables_ptr": "*i32",
            "seq_lens_ptr": "*i32"}
    constexprs = dict(RANK=512, ROPE=64, CHUNK=128, BLOCK_P=64, BLOCK_H=16, BLOCK_N=32, SPLIT=False,
                      PRECISION="tf32", KEYS_LATE=keys_late, INPUTS_READY=True, USE_PDL=True)
    return compile_sm90_kernel(_mla_decode_kernel, ptrs, constexprs, {"qk_scale": "fp32"},
                               aligned(_mla_decode_kernel), num_warps=4, num_stages=3)


def _ldmatrix(ptx: str) -> int:
    return len(re.findall(r"\bldmatrix\.", ptx))


def test_keys_late_reads_fewer_16bit_tiles_over_fp8():
    plain, late = _build("fp8e4nv", False), _build("fp8e4nv", True)
    assert _ldmatrix(late.asm["ptx"]) < _ldmatrix(plain.asm["ptx"])
    assert late.metadata.shared < plain.metadata.shared
    assert "cvt.rn.f16x2.e4m3x2" in late.asm["ptx"]       # the keys' codes still widen on Hopper's conversion


def test_keys_late_changes_nothing_over_bf16():
    assert _build("bf16", True).asm["ptx"] == _build("bf16", False).asm["ptx"]
