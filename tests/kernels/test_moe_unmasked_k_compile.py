"""DEEPSERVE_MOE_UNMASKED_K (kernels/fused_moe.py), checked on the sm_90 build without a GPU: the grouped down GEMM's
loads become cp.async copies into shared memory only without their K mask, which is what the switch is for."""

import pytest

from tests.kernels.sm90_compile import aligned, compile_for_sm90


@pytest.fixture(autouse=True)
def _triton(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")      # the default today; Triton 3.9 warns when unset


def _down_ptx(even_k: bool) -> str:
    from deepserve.kernels.fused_moe import _down_kernel
    return compile_for_sm90(_down_kernel, {"sorted_pairs_ptr": "*i32", "block_expert_ptr": "*i32",
                                           "weights_ptr": "*fp32"},
                            dict(HAS_SHARED=False, PRECISION="tf32", BLOCK_M=32, BLOCK_N=128, BLOCK_K=128,
                                 EVEN_K=even_k, USE_PDL=True), divisible_by_16=aligned(_down_kernel))


def test_unmasked_k_loads_become_async_copies():
    assert "cp.async" not in _down_ptx(False)       # the K mask: loads through registers
    unmasked = _down_ptx(True)
    assert "cp.async.cg.shared.global" in unmasked or "cp.async.ca.shared.global" in unmasked
