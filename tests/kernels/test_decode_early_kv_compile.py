"""DEEPSERVE_DECODE_EARLY_KV, compiled for sm_90 without a GPU: the paged decode kernel's first key and value tiles
load before the PDL wait, predicated on the step's count of fresh keys (those were written by the kernel just
before, so they must wait); without it only the step's inputs (scalars) load before the wait. Whether the two
parts add up to the right tile is tests/gpu/test_paged_attention.py's."""

import re

import pytest

from tests.kernels.sm90_compile import aligned, compile_for_sm90

POINTERS = {**{name: "*i32" for name in ("block_tables_ptr", "seq_lens_ptr", "q_rows_ptr", "seq_ids_ptr",
                                         "count_ptr")},
            "cache_ptr": "*bf16", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"}


def decode_ptx(early_kv: bool, cache: str = "bf16") -> tuple[list[str], str]:
    """The PTX lines of Llama-3.2-1B's split launch at batch 1 and 1k context (64-wide heads, group 4, the merge in
    the kernel), and the PTX name of its fresh_keys parameter."""
    from deepserve.kernels.paged_attention import _decode_kernel
    constexprs = dict(HEAD_DIM=64, BLOCK_D=64, BLOCK_G=16, BLOCK_N=64, SPLIT=True, EARLY_V=False, HEADS_FIRST=True,
                      VALUES_T=False, KV_HEADS=1, INPUTS_READY=True, USE_PDL=True, MERGE_LAST=True, MERGE_G=4,
                      MERGE_S=16, LATE_TRIGGER=False, EARLY_KV=early_kv)
    runtime = [p.name for p in _decode_kernel.params if not p.is_constexpr]
    ptx = compile_for_sm90(_decode_kernel, {**POINTERS, "cache_ptr": f"*{cache}"}, constexprs, {"qk_scale": "fp32"},
                           aligned(_decode_kernel))
    return ptx.splitlines(), f"_decode_kernel_param_{runtime.index('fresh_keys')}"


@pytest.fixture(autouse=True)
def _triton(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")


def _before_wait(lines: list[str]) -> list[str]:
    waits = [j for j, line in enumerate(lines) if "griddepcontrol.wait" in line]
    assert len(waits) == 1, waits
    return lines[:waits[0]]


@pytest.mark.parametrize("cache", ["bf16", "fp8e4nv"])
def test_the_first_tile_loads_before_the_wait_past_the_fresh_keys(cache):
    lines, fresh = decode_ptx(True, cache)
    before = _before_wait(lines)
    tiles = [line for line in before if re.search(r"\bld\.global\.v[24]\.", line)]
    assert len(tiles) >= 2 and all(line.strip().startswith("@%p") for line in tiles)     # predicated: masked rows
    assert any(f"[{fresh}]" in line for line in before if "ld.param" in line)


def test_without_it_only_the_inputs_load_before_the_wait():
    lines, fresh = decode_ptx(False)
    before = [line for line in _before_wait(lines) if "ld.global" in line]
    assert before and all(re.search(r"\bld\.global\.b32\b", line) for line in before)
    assert not any(f"[{fresh}]" in line for line in lines)
