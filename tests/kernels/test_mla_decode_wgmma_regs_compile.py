"""The MLA decode kernel whose products both take the keys from registers (kernels/mla_decode_wgmma_regs.py,
DEEPSERVE_MLA_WGMMA_REG_OUT), compiled for an H100/H200 (sm_90) without a GPU, over E4M3 and E5M2 caches, unsplit
and split: all 68 warpgroup MMAs (36 score, 32 output) take their A operand from registers, shared memory holds the
8-bit tiles cp.async brings, the query and the probabilities and nothing widened, the 16-byte loads of both
register layouts and the copies meet no bank conflicts in the swizzled ring, nothing spills and two programs fit an
SM. tests/gpu/test_mla_decode_wgmma.py checks the numbers on a GPU."""

import os
import re
import subprocess
import tempfile

import pytest

from tests.kernels.sm90_compile import aligned, compile_sm90_kernel

regs = pytest.importorskip("deepserve.kernels.mla_decode_wgmma_regs")
if not regs.HAVE_GLUON:
    pytest.skip("Gluon (Triton 3.6+) is not installed", allow_module_level=True)

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402


@pytest.fixture(autouse=True)
def _fp_fusion(monkeypatch):
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")      # the default today; Triton 3.9 warns when unset


PTRS = {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"}
MMA = r"wgmma\.mma_async\.sync\.aligned\.m64n16k16\.f32\.f16\.f16 \{[^}]*\}, "


def _build(cache: str, split: bool):
    kernel = regs._mla_decode_regs_kernel
    return compile_sm90_kernel(kernel, {**PTRS, "cache_ptr": f"*{cache}"}, dict(SPLIT=split), {"qk_scale": "fp32"},
                               aligned(kernel), num_warps=4, num_stages=1)


@pytest.mark.parametrize("cache, split", [("fp8e4nv", False), ("fp8e5", True)])     # two builds cover both flags
def test_both_products_take_the_keys_from_registers(cache, split):
    """68 MMAs with a register A operand (four 32-bit registers) and B in shared memory (the query's chunks, the
    probabilities' 16-key steps), none with A in shared memory; the keys reach registers by 16-byte shared loads
    (16 score + 2 RoPE + 16 output a tile; Triton 3.9 adds two of its softmax reductions) and no widened tile goes
    to shared memory (a thread's 16-byte stores: the query's nine chunks and, in Triton 3.9, two of the
    reductions; a widened tile would add 32)."""
    ptx = _build(cache, split).asm["ptx"]
    from_registers = re.findall(MMA + r"\{(?:%r\d+, ?){3}%r\d+\}, %rd\d+, [^,]+, 1, 1, ([01]);", ptx)
    assert len(from_registers) == 68 and set(from_registers) == {"0"}
    assert len(re.findall(MMA + r"%rd\d+, %rd\d+", ptx)) == 0
    assert "ldmatrix" not in ptx
    assert len(re.findall(r"ld\.shared\.v4\.b32", ptx)) in (34, 36)
    assert len(re.findall(r"st\.shared\.v4\.b32", ptx)) in (9, 11)


def test_cp_async_copies_a_whole_tile_ahead():
    """18 16-byte copies a thread a tile (the 37 KB tile over 128 threads) before the loop and 18 in it, each
    zero-filling masked keys (a source size operand), one commit group each, and a wait in the loop and at exit."""
    ptx = _build("fp8e4nv", False).asm["ptx"]
    copies = re.findall(r"cp\.async\.cg\.shared\.global \[ %r\d+ \+ 0 \], \[ %rd\d+ \+ 0 \], 0x10, %r\d+;", ptx)
    assert len(copies) == 36
    assert ptx.count("cp.async.commit_group") == 2
    assert len(re.findall(r"cp\.async\.wait_group\s+0;", ptx)) == 2


def test_two_programs_an_sm_without_spills():
    """No local memory; registers (allocated per warp in units of 256) and shared memory (+1 KB reserved a
    program) for two 4-warp programs of an SM's 64K registers and 228 KB."""
    import triton
    compiled = _build("fp8e4nv", False)
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


BLOCK_SHARED = gl.constexpr(regs.lat_shared_layout(64))      # one [64, 128] block of the ring's layout
STEP_SHARED = gl.constexpr(gl.SharedLinearLayout(          # a 16-key step of four blocks, [4, 16, 128]
    offset_bases=[[0] + b for b in regs.lat_shared_layout(16).offset_bases] + [[1, 0, 0], [2, 0, 0]]))


@gluon.jit
def _bank_conflicts_probe(x_ptr, SWIZZLED: gl.constexpr):
    """Compile-time only: Triton's count of the excess shared-memory wavefronts of the kernel's accesses (the
    copies, the score loads of a [64, 128] block, the output loads of a 16-key step), asserted 0 in the ring's
    layout (SWIZZLED) and, for the score loads, not 0 without its swizzle (the count can fail)."""
    if SWIZZLED:
        block = gl.allocate_shared_memory(gl.float8e4nv, [64, 128], BLOCK_SHARED)
        step = gl.allocate_shared_memory(gl.float8e4nv, [4, 16, 128], STEP_SHARED)
        gl.static_assert(gl.bank_conflicts(gl.distributed_type(gl.float8e4nv, [64, 128], regs.COPY_LAYOUT),
                                           block.type) == 0)
        gl.static_assert(gl.bank_conflicts(gl.distributed_type(gl.float8e4nv, [64, 128], regs.SCORE_LAYOUT),
                                           block.type) == 0)
        gl.static_assert(gl.bank_conflicts(gl.distributed_type(gl.float8e4nv, [4, 16, 128], regs.OUT_LAYOUT),
                                           step.type) == 0)
    else:
        block = gl.allocate_shared_memory(gl.float8e4nv, [64, 128], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        gl.static_assert(gl.bank_conflicts(gl.distributed_type(gl.float8e4nv, [64, 128], regs.SCORE_LAYOUT),
                                           block.type) > 0)
    pe = gl.allocate_shared_memory(gl.float8e4nv, [64, 64], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    gl.static_assert(gl.bank_conflicts(gl.distributed_type(gl.float8e4nv, [64, 64], regs.PE_LAYOUT), pe.type) == 0)
    gl.static_assert(gl.bank_conflicts(gl.distributed_type(gl.float8e4nv, [64, 64], regs.COPY_LAYOUT), pe.type) == 0)


@pytest.mark.parametrize("swizzled", [True, False])
def test_shared_accesses_meet_no_bank_conflicts(swizzled):
    compile_sm90_kernel(_bank_conflicts_probe, {"x_ptr": "*fp8e4nv"}, dict(SWIZZLED=swizzled), {}, (), num_warps=4,
                        num_stages=1)
