"""The Triton kernels that write or read a paged KV cache (standard attention's, and MLA's latent cache), compiled for
an H100/H200 (sm_90) without a GPU, with fp8 caches (kv_cache_dtype "fp8" / "fp8_e5m2") and with a bf16 one: the fp8
builds hold the saturating clamp and Hopper's round-to-nearest fp8 conversion where they write, the bf16 builds
neither (kernels/kv_rounding.py's branch is taken at compile time). Triton's interpreter cannot check the rounding
itself (it drops a rounding's carry into the exponent), so the bitwise checks are tests/gpu's."""

import re

import pytest

from tests.kernels.sm90_compile import aligned, compile_for_sm90

CACHES = {"fp8e4nv": "e4m3x2", "fp8e5": "e5m2x2", "bf16": None}
INDEX = {"pos_ptr": "*i64", "slot_ptr": "*i64"}


def writers(cache: str) -> dict:
    from deepserve.kernels.mla_decode import _rotary_write_latent_kernel, _write_latent_kernel
    from deepserve.kernels.kv_write import _rotary_write_kv_kernel, _write_kv_kernel
    from deepserve.kernels.qkv_rotary import _qkv_rotary_write_kernel
    c = {"cache_ptr": f"*{cache}"}
    return {
        "write_latents": compile_for_sm90(_write_latent_kernel, {**INDEX, **c},
                                          dict(RANK=512, ROPE=64, BLOCK=1024, USE_PDL=True)),
        "rotary_write_latents": compile_for_sm90(
            _rotary_write_latent_kernel, {**INDEX, **c, "norm_w_ptr": "*fp32"},
            dict(RANK=512, BLOCK_R=512, HALF=32, BLOCK_HALF=32, BLOCK_H=16, INTERLEAVED=True, HALF_CACHE=True,
                 HAS_NORM=True, NORM_OUT_FP32=True, INPUTS_READY=True, USE_PDL=True), {"eps": "fp32"}),
        "write_kv": compile_for_sm90(_write_kv_kernel, {**INDEX, **c}, dict(HEAD_DIM=128, BLOCK_HD=1024, USE_PDL=True)),
        "rotary_write_kv": compile_for_sm90(
            _rotary_write_kv_kernel, {**INDEX, **c},
            dict(HEAD_DIM=128, BLOCK_HD=1024, HALF=64, BLOCK_HALF=64, BLOCK_H=32, INTERLEAVED=False,
                 HALF_CACHE=False, QK_NORM=True, INPUTS_READY=True, PREFETCH=0, PF_PIECES=64, PF_PIECE=4096,
                 USE_PDL=True)),
        "qkv_rotary_write": compile_for_sm90(
            _qkv_rotary_write_kernel, {**INDEX, **c},
            dict(HEAD_DIM=64, HALF_CACHE=False, HAS_BIAS=False, NORM=True, BLOCK_K=2048, ONE_STEP=True,
                 USE_PDL=True), {"eps": "fp32"}),
    }


def readers(cache: str, activations: str = "bf16") -> dict:
    from deepserve.kernels.mla_decode import _mla_decode_kernel
    from deepserve.kernels.paged_attention import _decode_kernel
    from deepserve.kernels.paged_prefill import _prefill_kernel
    i32 = {name: "*i32" for name in ("block_tables_ptr", "seq_lens_ptr", "q_rows_ptr", "seq_ids_ptr",
                                      "query_start_ptr", "tile_seq_ptr", "tile_m0_ptr", "count_ptr")}
    ptrs = {**i32, "cache_ptr": f"*{cache}", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
            **{name: f"*{activations}" for name in ("q_ptr", "out_ptr", "q_lat_ptr", "q_pe_ptr")}}
    return {
        "decode": compile_for_sm90(_decode_kernel, ptrs,
                                   dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_G=16, BLOCK_N=64, SPLIT=True, EARLY_V=False,
                                        HEADS_FIRST=False, VALUES_T=False, KV_HEADS=1,
                                        INPUTS_READY=True, USE_PDL=True, MERGE_LAST=False, MERGE_G=1,
                                        MERGE_S=1, LATE_TRIGGER=False), {"qk_scale": "fp32"},
                                   aligned(_decode_kernel)),
        "prefill": compile_for_sm90(_prefill_kernel, ptrs, dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_M=64, BLOCK_N=64),
                                    {"qk_scale": "fp32"}, aligned(_prefill_kernel)),
        "mla_decode": compile_for_sm90(_mla_decode_kernel, ptrs,
                                       dict(RANK=512, ROPE=64, CHUNK=128, BLOCK_P=64, BLOCK_H=16, BLOCK_N=32,
                                            SPLIT=True, PRECISION="tf32", INPUTS_READY=True, USE_PDL=True),
                                       {"qk_scale": "fp32"}, aligned(_mla_decode_kernel)),
    }


@pytest.fixture(autouse=True)
def _triton(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")      # the default today; Triton 3.9 warns when unset


@pytest.mark.parametrize("cache", list(CACHES))
def test_cache_writers_clamp_and_round_into_fp8_only(cache):
    fmt = CACHES[cache]
    for name, ptx in writers(cache).items():
        if fmt is None:
            assert "satfinite" not in ptx and "e4m3" not in ptx and "e5m2" not in ptx, name
        else:
            assert f"cvt.rn.satfinite.{fmt}.f32" in ptx, name              # round to nearest even, saturating
            # The clamp of kv_rounding.store_rounded (in bf16 where LLVM narrows it: 448 and 57344 are bf16 values).
            assert re.search(r"\bmin\.(f32|bf16)", ptx) and re.search(r"\bmax\.(f32|bf16)", ptx), name


@pytest.mark.parametrize("cache", list(CACHES))
def test_cache_readers_widen_fp8_codes(cache):
    fmt = CACHES[cache]
    for name, ptx in readers(cache).items():
        if fmt is None:
            assert "e4m3" not in ptx and "e5m2" not in ptx, name
        elif cache == "fp8e4nv":
            assert "cvt.rn.f16x2.e4m3x2" in ptx, name          # pairs of codes widened by Hopper's conversion
        else:
            # E5M2 is fp16's high byte: widened by byte moves (bf16 products: prefill) or Hopper's pair conversion.
            assert "prmt.b32" in ptx or "cvt.rn.f16x2.e5m2x2" in ptx, name


@pytest.mark.parametrize("cache", ["fp8e4nv", "fp8e5"])
def test_fp8_value_tiles_reach_the_products_through_ldmatrix(cache):
    """kv_rounding.widen_values (DEEPSERVE_FP8_WIDEN's default, "values"): a value tile widens in registers, so the
    decode kernels (mma.sync) lay it out for p @ v as 16-bit elements that ldmatrix transposes, and no reader takes
    an 8-bit tile from shared memory a byte at a time (how Triton reads an 8-bit operand it must transpose; on an
    H200 that made fp8 decode steps up to 1.4x slower than bf16 ones at 4k context, kv_fp8_sweep_h200.json). The
    prefill kernel (wgmma, Hopper's operands from shared memory) widens in registers either way."""
    from deepserve.kernels.kv_rounding import FP8_WIDEN
    if FP8_WIDEN != 1:
        pytest.skip("DEEPSERVE_FP8_WIDEN is set to another value")
    for name, ptx in readers(cache).items():
        assert not re.search(r"ld\.shared(\.v\d)?\.b8", ptx), name
        if "wgmma" not in ptx:
            assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx, name


@pytest.mark.parametrize("cache", ["fp8e4nv", "fp8e5"])
def test_fp8_readers_compile_for_float32_activations(cache):
    """A float32 model (the GPU tests' engines) widens fp8 codes to float32: one element a register move, which
    compiles (two to a 32-bit register aborted LLVM)."""
    for name, ptx in readers(cache, "fp32").items():
        # E4M3 through Hopper's pair conversion to fp16, E5M2 (fp16's high byte) moved into place; then to float32.
        assert ("cvt.rn.f16x2.e4m3x2" in ptx if cache == "fp8e4nv" else "prmt.b32" in ptx) or "cvt.f32.f16" in ptx, name


@pytest.mark.parametrize("products", ["f16", "activations"])
def test_fp8_products_switch_picks_the_decode_kernels_mmas(products):
    """DEEPSERVE_FP8_PRODUCTS (read at import, hence a fresh interpreter): with f16 (the default) the decode kernels
    over an fp8 cache run their products on fp16 tensor-core MMAs (one widening instruction per pair of E4M3 codes),
    with activations on bf16 ones; over a bf16 cache they keep bf16 ones either way."""
    import os
    import subprocess
    import sys
    script = ("import re, sys; from tests.kernels.test_kv_rounding_compile import readers\n"
              "for cache in ('fp8e4nv', 'bf16'):\n"
              "    for name, ptx in readers(cache).items():\n"
              "        if name != 'prefill':\n"
              "            print(cache, name, sorted(set(re.findall(r'mma\\.sync\\.aligned\\.[\\w.]+', ptx))))\n")
    env = dict(os.environ, DEEPSERVE_FP8_PRODUCTS=products)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))).stdout
    lines = out.splitlines()
    assert len(lines) == 4, out
    for line in lines:
        want = "f16.f16" if line.startswith("fp8e4nv") and products == "f16" else "bf16.bf16"
        other = "bf16.bf16" if want == "f16.f16" else ".f16.f16"
        assert want in line and other not in line, line
