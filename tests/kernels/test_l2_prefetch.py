"""kernels/l2_prefetch.py without a GPU: the plan (no prefetch programs for a CPU weight, past the row cap, or with
the setting off, the default) and the PTX of the kernels that prefetch, accepted by ptxas for an H100/H200 (sm_90):
the bulk prefetch and the evict-last policy are Hopper instructions that no CPU test can run."""

import pytest
import torch

from deepserve.kernels.l2_prefetch import L2_PREFETCH_MAX_ROWS, L2_PREFETCH_PIECE, L2_PREFETCH_PIECES, SITES, \
    l2_prefetch_plan
from tests.kernels.sm90_compile import compile_for_sm90


def test_no_prefetch_for_a_cpu_weight_or_none():
    like = torch.zeros(4)
    weight = torch.zeros(2048, 2048, dtype=torch.bfloat16)
    for site in SITES:
        for w, rows in ((weight, 8), (None, 8), (weight, L2_PREFETCH_MAX_ROWS + 1)):
            plan = l2_prefetch_plan(w, rows, like, site)
            assert plan.programs == 0 and plan.nbytes == 0 and plan.policy == 0 and plan.tensor is like
    with pytest.raises(AssertionError):
        l2_prefetch_plan(weight, 8, like, "o_proj")


def test_off_by_default(monkeypatch):
    monkeypatch.delenv("DEEPSERVE_L2_PREFETCH", raising=False)
    from deepserve import envs
    assert envs.DEEPSERVE_L2_PREFETCH == "off"
    monkeypatch.setenv("DEEPSERVE_L2_PREFETCH", "everywhere")
    with pytest.raises(ValueError, match="DEEPSERVE_L2_PREFETCH"):
        envs.DEEPSERVE_L2_PREFETCH


PREFETCH_CONSTEXPRS = dict(PF_PIECES=L2_PREFETCH_PIECES, PF_PIECE=L2_PREFETCH_PIECE, USE_PDL=True)


@pytest.mark.parametrize("policy", [0, 1, 2])
def test_prefetching_kernels_compile_for_hopper(policy, monkeypatch):
    """The rotary + KV-write kernel and the split reduce with each prefetch policy (0 none, 1 plain, 2
    evict-last) go through ptxas for sm_90, and their PTX holds the bulk prefetch (with the L2 policy) exactly
    where a policy asks for it."""
    pytest.importorskip("triton")
    from deepserve.kernels.kv_write import _rotary_write_kv_kernel
    from deepserve.kernels.paged_attention import _decode_reduce_kernel
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    rotary = compile_for_sm90(
        _rotary_write_kv_kernel, {"pos_ptr": "*i64", "slot_ptr": "*i64"},
        dict(HEAD_DIM=128, BLOCK_HD=1024, HALF=64, BLOCK_HALF=64, BLOCK_H=32, INTERLEAVED=False, HALF_CACHE=False,
             QK_NORM=True, INPUTS_READY=True, PREFETCH=policy, **PREFETCH_CONSTEXPRS))
    reduce = compile_for_sm90(
        _decode_reduce_kernel, {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "q_rows_ptr": "*i32",
                                "seq_ids_ptr": "*i32", "seq_lens_ptr": "*i32"},
        dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=64, BLOCK_N=64, INPUTS_READY=True, PREFETCH=policy,
             **PREFETCH_CONSTEXPRS))
    for ptx in (rotary, reduce):
        assert ("cp.async.bulk.prefetch.L2.global" in ptx) == (policy > 0)
        assert ("createpolicy.fractional.L2::evict_last" in ptx) == (policy == 2)
