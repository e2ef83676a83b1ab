"""The warpgroup-MMA MLA decode kernel (kernels/mla_decode_wgmma.py, DEEPSERVE_MLA_WGMMA=1) against the float32
reference, over E4M3 and E5M2 caches: partial head tiles, block sizes, contexts inside one tile and across many,
split launches merged by the reduce, strided output, a CUDA graph; each with the next tile's chunks by registers and
by cp.async (DEEPSERVE_MLA_WGMMA_ASYNC), and the score products' keys from shared memory or from registers
(DEEPSERVE_MLA_WGMMA_REG_SCORES). It needs an sm_90 GPU (Gluon has no interpreter); elsewhere only
`wgmma_supported`'s refusal is checked."""

import math

import pytest
import torch

from deepserve.kernels import mla_decode_wgmma
from deepserve.kernels.mla_decode import mla_decode, mla_decode_ref
from kernel_testing import assert_close_rel, make_batch
from test_mla_decode import KERNEL_TOL

pytestmark = pytest.mark.gpu

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
LENS = [1, 15, 63, 64, 65, 100, 300, 1030]


def _hopper(device) -> bool:
    return (torch.device(device).type == "cuda" and mla_decode_wgmma.HAVE_GLUON
            and torch.cuda.get_device_capability()[0] == 9)


@pytest.fixture(params=[("0", "0"), ("1", "0"), ("0", "1"), ("1", "1")],
                ids=["registers", "cp_async", "registers-reg_scores", "cp_async-reg_scores"])
def wgmma(device, monkeypatch, request):
    """The kernel, with the next tile's chunks 3-7 loaded into registers or carried by cp.async
    (DEEPSERVE_MLA_WGMMA_ASYNC), the score products' keys from shared memory or registers
    (DEEPSERVE_MLA_WGMMA_REG_SCORES)."""
    if not _hopper(device):
        pytest.skip("the warpgroup-MMA kernel needs an sm_90 GPU and Gluon")
    copy_async, reg_scores = request.param
    monkeypatch.setenv("DEEPSERVE_MLA_WGMMA", "1")
    monkeypatch.setenv("DEEPSERVE_MLA_WGMMA_ASYNC", copy_async)
    monkeypatch.setenv("DEEPSERVE_MLA_WGMMA_REG_SCORES", reg_scores)


def _case(device, heads, lens, block_size, cache_dtype, rank=512, rope=64):
    num_blocks = sum(-(-n // block_size) for n in lens) + 8
    batch = make_batch([(n - 1, 1) for n in lens], block_size, num_blocks, device)
    cache = (torch.randn(num_blocks, block_size, rank + rope, device=device) * 2).to(cache_dtype)
    q_lat = torch.randn(len(lens), heads, rank, device=device).to(torch.bfloat16)
    q_pe = torch.randn(len(lens), heads, rope, device=device).to(torch.bfloat16)
    return batch, cache, q_lat, q_pe


def test_supported_only_on_hopper_fp8(device):
    """Refused for a 16-bit cache, a latent other than 512 wide, a RoPE part other than 64 wide, and off sm_90 (or
    on the CPU); taken for V2-Lite's shape over E4M3 on an H100 / H200."""
    q = torch.zeros(1, 16, 512, device=device, dtype=torch.bfloat16)
    fp8 = torch.zeros(4, 16, 576, device=device, dtype=torch.float8_e4m3fn)
    assert not mla_decode_wgmma.wgmma_supported(q, fp8.to(torch.bfloat16))
    assert not mla_decode_wgmma.wgmma_supported(q[..., :500], fp8[..., :564])
    assert not mla_decode_wgmma.wgmma_supported(q[..., :256], fp8[..., :320])
    assert not mla_decode_wgmma.wgmma_supported(q, fp8[..., :560])
    assert mla_decode_wgmma.wgmma_supported(q, fp8) == _hopper(device)


@pytest.mark.parametrize("cache_dtype", FP8, ids=str)
@pytest.mark.parametrize("heads", [16, 20, 128])
@pytest.mark.parametrize("block_size", [16, 64])
def test_matches_reference(device, wgmma, cache_dtype, heads, block_size):
    batch, cache, q_lat, q_pe = _case(device, heads, LENS, block_size, cache_dtype)
    scale = 1 / math.sqrt(576)
    ref = mla_decode_ref(q_lat, q_pe, cache, batch.block_tables, batch.seq_lens, scale)
    for splits in (None, 1, 3, 7):
        out = mla_decode(q_lat, q_pe, cache, batch.block_tables, batch.seq_lens, scale, max_seq_len=max(LENS),
                         num_splits=splits)
        assert_close_rel(out, ref, KERNEL_TOL[torch.bfloat16])


def test_strided_output_and_large_batch(device, wgmma):
    """Batch 256 at ~1k context (V2-Lite's one-split launch) into a strided output."""
    lens = [1000 + (7 * i) % 90 for i in range(256)]
    batch, cache, q_lat, q_pe = _case(device, 16, lens, 16, torch.float8_e4m3fn)
    out = torch.full((16, 256, 512), float("nan"), device=device, dtype=torch.bfloat16)
    mla_decode(q_lat, q_pe, cache, batch.block_tables, batch.seq_lens, 0.05, out=out.transpose(0, 1),
               max_seq_len=max(lens))
    ref = mla_decode_ref(q_lat, q_pe, cache, batch.block_tables, batch.seq_lens, 0.05)
    assert_close_rel(out.transpose(0, 1), ref, KERNEL_TOL[torch.bfloat16])


def test_in_cuda_graph(device, wgmma):
    """Captured once, replayed after the sequences grew: the same as an eager launch on the new lengths."""
    lens = [5, 70, 200]
    batch, cache, q_lat, q_pe = _case(device, 16, [n + 64 for n in lens], 16, torch.float8_e4m3fn)
    seq_lens = torch.tensor(lens, device=device, dtype=batch.seq_lens.dtype)
    out = torch.empty(3, 16, 512, device=device, dtype=torch.bfloat16)
    mla_decode(q_lat, q_pe, cache, batch.block_tables, seq_lens, 0.05, out=out, max_seq_len=512, num_splits=4)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_decode(q_lat, q_pe, cache, batch.block_tables, seq_lens, 0.05, out=out, max_seq_len=512, num_splits=4)
    seq_lens += 64
    graph.replay()
    torch.cuda.synchronize()
    ref = mla_decode_ref(q_lat, q_pe, cache, batch.block_tables, seq_lens, 0.05)
    assert_close_rel(out, ref, KERNEL_TOL[torch.bfloat16])
