"""The kernels that finish a decode graph's inputs (kernels/graph_inputs.py) compile for sm_90 without a GPU (their
results are checked against their twins in tests/gpu/test_graph_inputs.py, on a GPU or in Triton's interpreter)."""

import pytest

from tests.kernels.sm90_compile import compile_for_sm90


def test_graph_input_kernels_compile_for_hopper(monkeypatch):
    pytest.importorskip("triton")
    from deepserve.kernels.graph_inputs import (UNPACK_BLOCK, _load_inputs_kernel, _patch_tokens_kernel,
                                                _unpack_tables_kernel)
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    i64 = {"ids_ptr": "*i64", "src_ptr": "*i64", "tokens_ptr": "*i64", "packed_ptr": "*i64", "shape_ptr": "*i64",
           "out_ptr": "*i64", "host_ptr": "*i64", "dev_ptr": "*i64", "tables_ptr": "*i64"}
    assert "ld.global" in compile_for_sm90(_patch_tokens_kernel, i64, {"BLOCK": 16})
    ptx = compile_for_sm90(_unpack_tables_kernel, i64, {"BLOCK": UNPACK_BLOCK})
    assert "st.global" in ptx
    ptx = compile_for_sm90(_load_inputs_kernel, i64, {"COLUMNS": 6, "IDS_COLUMN": 0, "SRC_COLUMN": 5,
                                                      "TABLES_PER_ROW": 2, "BLOCK": 256})
    assert "ld.global" in ptx and "st.global" in ptx


def test_row_argmax_writes_host_memory_only_when_asked(monkeypatch):
    """The row argmax's HOST_OUT build stores each token twice (the device buffer and the pinned host one); without
    it the kernel stores once, as before the host pointer was added."""
    pytest.importorskip("triton")
    from deepserve.kernels.argmax import _row_argmax_kernel
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    types = {"val_ptr": "*fp32", "idx_ptr": "*i32", "out_ptr": "*i64", "host_out_ptr": "*i64"}
    stores = {}
    for host_out in (False, True):
        ptx = compile_for_sm90(_row_argmax_kernel, types, {"BLOCK_P": 32, "USE_PDL": True, "HOST_OUT": host_out})
        stores[host_out] = ptx.count("st.global")
    assert stores[False] >= 1 and stores[True] == 2 * stores[False]
