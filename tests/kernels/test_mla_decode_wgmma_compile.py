"""The warpgroup-MMA MLA decode kernel (kernels/mla_decode_wgmma.py, Gluon) compiled for an H100/H200 (sm_90)
without a GPU, over E4M3 and E5M2 caches, unsplit and split: both products run as warpgroup MMAs of 64 keys x 16
heads (36 for the scores over 9 column chunks of 4 K-steps, 32 for the output's 8 chunks), the output products read
the widened tile transposed, nothing spills and two programs fit an SM (the reason for its opaque-zero buffer
index; tests/gpu checks the numbers), with the next tile's chunks 3-7 in registers or by cp.async
(DEEPSERVE_MLA_WGMMA_ASYNC), and with the score products' keys from registers (DEEPSERVE_MLA_WGMMA_REG_SCORES)."""

import re
import tempfile

import pytest

from tests.kernels.sm90_compile import aligned, compile_sm90_kernel

wgmma = pytest.importorskip("deepserve.kernels.mla_decode_wgmma")
if not wgmma.HAVE_GLUON:
    pytest.skip("Gluon (Triton 3.5+) is not installed", allow_module_level=True)

@pytest.fixture(autouse=True)
def _fp_fusion(monkeypatch):
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")      # the default today; Triton 3.9 warns when unset


PTRS = {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"}


def _build(cache: str, split: bool, copy_async: bool = False, reg_scores: bool = False):
    kernel = wgmma._mla_decode_wgmma_kernel
    return compile_sm90_kernel(kernel, {**PTRS, "cache_ptr": f"*{cache}"},
                               dict(RANK=512, SPLIT=split, ASYNC=copy_async, REG_SCORES=reg_scores),
                               {"qk_scale": "fp32"}, aligned(kernel), num_warps=4, num_stages=1)


@pytest.mark.parametrize("cache", ["fp8e4nv", "fp8e5"])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("copy_async", [False, True], ids=["registers", "cp_async"])
def test_products_are_warpgroup_mmas(cache, split, copy_async):
    ptx = _build(cache, split, copy_async).asm["ptx"]
    mmas = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n16k16\.f32\.f16\.f16 \{[^}]*\}, %rd\d+, %rd\d+, "
                      r"[^,]+, 1, 1, ([01]), ([01]);", ptx)
    assert len(mmas) == 68
    assert mmas.count(("0", "0")) == 36 and mmas.count(("1", "0")) == 32       # (transposed A, transposed B)
    assert "ldmatrix" not in ptx


@pytest.mark.parametrize("cache", ["fp8e4nv", "fp8e5"])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("copy_async", [False, True], ids=["registers", "cp_async"])
def test_register_scores_take_the_keys_from_registers(cache, split, copy_async):
    """REG_SCORES: the 36 score MMAs read the widened keys from registers (an A operand of four 32-bit registers)
    and only the query from shared memory; the 32 output MMAs are unchanged (both operands in shared memory, A
    transposed). The reorder that makes a thread's loaded bytes its fragment moves nothing between threads (the
    kernel asserts a trivial layout conversion at compile time); the key loads stay 16 bytes wide."""
    ptx = _build(cache, split, copy_async, reg_scores=True).asm["ptx"]
    from_registers = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n16k16\.f32\.f16\.f16 \{[^}]*\}, "
                                r"\{(?:%r\d+, ?){3}%r\d+\}, %rd\d+, [^,]+, 1, 1, ([01]);", ptx)
    from_shared = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n16k16\.f32\.f16\.f16 \{[^}]*\}, %rd\d+, %rd\d+, "
                             r"[^,]+, 1, 1, ([01]), ([01]);", ptx)
    assert len(from_registers) == 36 and set(from_registers) == {"0"}
    assert len(from_shared) == 32 and set(from_shared) == {("1", "0")}
    assert "ldmatrix" not in ptx
    loads = re.findall(r"ld\.global(?:\.\w+)*\.v4\.b32", ptx)
    assert len(loads) >= (4 if copy_async else 9) * 2


@pytest.mark.parametrize("copy_async", [False, True], ids=["registers", "cp_async"])
@pytest.mark.parametrize("reg_scores", [False, True], ids=["smem_scores", "reg_scores"])
def test_two_programs_an_sm_without_spills(copy_async, reg_scores):
    """No local memory; registers (allocated per warp in units of 256) and shared memory (+1 KB reserved a
    program) for two 4-warp programs of an SM's 64K registers and 228 KB."""
    import os
    import subprocess
    import triton
    compiled = _build("fp8e4nv", False, copy_async, reg_scores)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    fields = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", usage))
    assert int(fields["STACK"]) == 0 and int(fields["LOCAL"]) == 0
    regs_a_warp = -(-int(fields["REG"]) * 32 // 256) * 256
    assert 65536 // (regs_a_warp * 4) >= 2 and 228 * 1024 // (compiled.metadata.shared + 1024) >= 2


def test_cp_async_copies_the_next_tiles_five_chunks():
    """ASYNC: 16-byte cp.async copies (two a thread for each of the five 4 KB chunks: 10 before the loop, 10 in
    it) that zero-fill masked keys (a source size operand), two commit groups, and a wait in the loop and at exit;
    without it none."""
    ptx = _build("fp8e4nv", False, True).asm["ptx"]
    copies = re.findall(r"cp\.async\.cg\.shared\.global \[ %r\d+ \+ 0 \], \[ %rd\d+ \+ 0 \], 0x10, %r\d+;", ptx)
    assert len(copies) == 20
    assert ptx.count("cp.async.commit_group") == 2
    assert len(re.findall(r"cp\.async\.wait_group\s+0;", ptx)) == 2
    assert "cp.async" not in _build("fp8e4nv", False, False).asm["ptx"]
