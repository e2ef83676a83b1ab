"""DEEPSERVE_DECODE_SPLIT_MERGE=last, compiled for sm_90 without a GPU: the paged decode kernel's in-kernel split
merge keeps CUTLASS's semaphore order (every thread's partial stores, a CTA barrier, one release-acquire atomic at
GPU scope, the merge's loads from L2 after it, the counter zeroed by the merging program), over 2+ rows with the next
kernel let in only as its programs exit; a launch without it holds no atomic at all. Whether the merge is right is
tests/gpu/test_paged_attention.py's."""

import re

import pytest

from tests.kernels.sm90_compile import aligned, compile_for_sm90

POINTERS = {**{name: "*i32" for name in ("block_tables_ptr", "seq_lens_ptr", "q_rows_ptr", "seq_ids_ptr",
                                         "count_ptr")},
            "cache_ptr": "*bf16", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"}


def decode_ptx(merge_last: bool, late_trigger: bool = False) -> list[str]:
    from deepserve.kernels.paged_attention import _decode_kernel
    # Llama-3.2-1B's split launch at batch 1-8 and 1k context: 64-wide heads, group 4, 8 splits.
    constexprs = dict(HEAD_DIM=64, BLOCK_D=64, BLOCK_G=16, BLOCK_N=64, SPLIT=True, EARLY_V=False, HEADS_FIRST=True,
                      VALUES_T=False, KV_HEADS=1, INPUTS_READY=True, USE_PDL=True, MERGE_LAST=merge_last,
                      MERGE_G=4, MERGE_S=8, LATE_TRIGGER=late_trigger)
    return compile_for_sm90(_decode_kernel, POINTERS, constexprs, {"qk_scale": "fp32"},
                            aligned(_decode_kernel)).splitlines()


@pytest.fixture(autouse=True)
def _triton(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")


def test_the_count_follows_every_partial_store_and_precedes_the_merge():
    lines = decode_ptx(True)
    atoms = [j for j, line in enumerate(lines) if re.search(r"\batom\.global\.gpu\.acq_rel\.add\b", line)]
    assert len(atoms) == 1, atoms
    a = atoms[0]
    stores = [j for j in range(a) if "st.global" in lines[j]]
    assert stores and any("bar.sync" in line for line in lines[stores[-1]:a])
    assert any("ld.global.cg" in line for line in lines[a:])
    assert not any("ld.global.cg" in line for line in lines[:a])
    counter = re.search(r"\[\s*(%rd\d+)", lines[a]).group(1)
    assert any("st.global" in line and f"[ {counter} " in line for line in lines[a:])


def test_a_launch_without_the_merge_has_no_atomic():
    assert not any("atom." in line for line in decode_ptx(False))


def test_a_late_trigger_lets_the_next_kernel_start_as_the_programs_exit():
    """LATE_TRIGGER (the merge over 2+ rows: the next kernel is o_proj's skinny GEMM, whose programs let in early
    slowed the 1B's batch-2 steps): no early PDL trigger. Otherwise the trigger follows the wait, as in every
    decode-path kernel."""
    assert any("griddepcontrol.launch_dependents" in line for line in decode_ptx(True))
    assert any("griddepcontrol.launch_dependents" in line for line in decode_ptx(False))
    late = decode_ptx(True, late_trigger=True)
    assert not any("griddepcontrol.launch_dependents" in line for line in late)
    assert any("griddepcontrol.wait" in line for line in late)
