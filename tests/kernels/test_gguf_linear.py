"""GGUF's packed Q4_1 / Q8_0 GEMM (kernels/cpu/gguf_linear.c) against dequantize-then-F.linear, on every vector path
this CPU runs plus plain C; the dequantization bit for bit the gguf package's."""

import gguf
import pytest
import torch

from deepserve.kernels.cpu import gguf_linear as g
from deepserve.kernels.cpu import isa
from gguf_blocks import random_blocks

needs_kernels = pytest.mark.skipif(g.library() is None, reason="no C compiler or DEEPSERVE_CPU_KERNELS=0")

# The paths the C library runs on this CPU (a level the CPU lacks would drop to the one below: not tested twice).
HOST_ISAS = [name for name in g.ISAS if g.library() is not None and g.resolved_isa(name) == name]


@pytest.mark.parametrize("qtype", [g.Q4_1, g.Q8_0])
def test_dequantize_ref_matches_gguf_package(qtype):
    blocks = random_blocks(40, 96, qtype)
    expected = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), qtype))
    assert torch.equal(g.dequantize_ref(blocks, qtype, 96), expected)


@needs_kernels
@pytest.mark.parametrize("qtype", [g.Q4_1, g.Q8_0])
def test_dequantize_rows_bit_for_bit(qtype):
    blocks = random_blocks(300, 576, qtype)            # 300 x 576: threaded
    ref = g.dequantize_ref(blocks, qtype, 576)
    assert torch.equal(g.dequantize(blocks, qtype, 576), ref)
    rows = torch.tensor([[5, 0], [299, 5]])
    assert torch.equal(g.dequantize(blocks, qtype, 576, rows=rows), ref[rows.reshape(-1)])
    with pytest.raises(IndexError):
        g.dequantize(blocks, qtype, 576, rows=torch.tensor([300]))


@needs_kernels
@pytest.mark.parametrize("isa_name", HOST_ISAS)
@pytest.mark.parametrize("qtype", [g.Q4_1, g.Q8_0])
@pytest.mark.parametrize("m,n,k", [(1, 96, 64), (3, 200, 576), (5, 33, 1536), (1, 1024, 576), (15, 64, 96),
                                   (32, 130, 192)])
def test_kernel_matches_dequantized_linear(isa_name, qtype, m, n, k):
    blocks = random_blocks(n, k, qtype, seed=m + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    out = g.gguf_linear(x, blocks, qtype, k, isa_name, many_rows=1 << 30)     # the packed kernel at every row count
    ref = F_linear64(x, g.dequantize_ref(blocks, qtype, k))
    assert out.shape == (m, n) and out.dtype == torch.float32
    # fp32 sums in another order: a few ulps of the row's magnitude
    tol = 1e-5 * (x.abs() @ g.dequantize_ref(blocks, qtype, k).abs().T).max().item() + 1e-6
    assert (out.double() - ref).abs().max().item() <= tol


def F_linear64(x, w):
    return x.double() @ w.double().T


@needs_kernels
@pytest.mark.parametrize("m", [1, 3, 32])
def test_rows_and_strides(m):
    """Every row count (tiles of 4, the many-row sgemm path from MANY_ROWS on), a strided x, a row view."""
    blocks = random_blocks(80, 128, g.Q4_1)
    x = torch.randn(m, 256)[:, ::2]                   # column stride 2: copied first
    ref = F_linear64(x, g.dequantize_ref(blocks, g.Q4_1, 128))
    out = g.gguf_linear(x, blocks, g.Q4_1, 128)
    assert torch.allclose(out.double(), ref, atol=1e-4, rtol=1e-5)
    wide = torch.randn(m, 200)[:, 8:136]               # row stride 200, unit column stride: taken as it is
    out = g.gguf_linear(wide, blocks, g.Q4_1, 128)
    assert torch.allclose(out.double(), F_linear64(wide, g.dequantize_ref(blocks, g.Q4_1, 128)), atol=1e-4, rtol=1e-5)


def test_choose_isa_from_features():
    assert g.choose_isa(isa.preset("avx512_vnni")) == "avx512"
    assert g.choose_isa(isa.preset("avx2")) == "avx2"
    assert g.choose_isa(isa.preset("avx_vnni")) == "avx2"
    assert g.choose_isa(isa.CpuFeatures("arm", frozenset({"neon"}), "test")) == "scalar"


def test_check_blocks_rejects_bad_shapes():
    with pytest.raises(ValueError, match="multiple of 32"):
        g.check_blocks(torch.zeros(4, 20, dtype=torch.uint8), g.Q4_1, 48)
    with pytest.raises(ValueError, match="uint8"):
        g.check_blocks(torch.zeros(4, 21, dtype=torch.uint8), g.Q4_1, 32)
    with pytest.raises(ValueError, match="not packed"):
        g.check_blocks(torch.zeros(4, 18, dtype=torch.uint8), 2, 32)


def test_fallback_without_kernels(monkeypatch):
    monkeypatch.setenv("DEEPSERVE_CPU_KERNELS", "0")
    blocks = random_blocks(16, 64, g.Q8_0)
    x = torch.randn(2, 64)
    assert g.library() is None
    assert torch.equal(g.gguf_linear(x, blocks, g.Q8_0, 64), g.gguf_linear_ref(x, blocks, g.Q8_0, 64))
    assert torch.equal(g.dequantize(blocks, g.Q8_0, 64, rows=torch.tensor([3])), g.dequantize_ref(blocks[3:4], g.Q8_0, 64))
