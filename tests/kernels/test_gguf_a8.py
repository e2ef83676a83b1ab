"""GGUF Q4_1 / Q8_0 weights times int8 activations (kernels/cpu/gguf_a8.c, quantization="gguf_a8"): the repacked
layout against its PyTorch twin and back, the activations' quantization bit for bit against quantize_ref on every
vector path this CPU runs, and the product against an exact float64 reference of the same quantized x."""

import pytest
import torch
import torch.nn.functional as F

from deepserve.kernels.cpu import gguf_a8 as a8
from deepserve.kernels.cpu import gguf_linear as g
from deepserve.kernels.cpu import isa
from gguf_blocks import random_blocks

needs_kernels = pytest.mark.skipif(a8.library() is None, reason="no C compiler or DEEPSERVE_CPU_KERNELS=0")

# The paths the library runs on this CPU (a level the CPU lacks drops to one below: not tested twice), plain C always.
HOST_ISAS = [name for name in a8.ISAS if a8.library() is not None and a8.resolved_isa(name) == name]
# Block counts: 18 (the default model's hidden size), 17 and 3 (odd: a last block without a partner), 1, 48 (a
# chunk of 16 blocks three times), 21 (a partial chunk).
WIDTHS = [576, 544, 96, 32, 1536, 672]


@pytest.mark.parametrize("qtype", [g.Q4_1, g.Q8_0])
@pytest.mark.parametrize("k", WIDTHS)
def test_repack_layout_round_trip(qtype, k):
    blocks = random_blocks(37, k, qtype, seed=k)
    packed = a8.repack(blocks, qtype, k)
    assert packed.shape == blocks.shape and packed.dtype == torch.uint8
    assert torch.equal(packed, a8.repack_ref(blocks, qtype, k))
    assert torch.equal(a8.unpack_ref(packed, qtype, k), blocks)
    assert not torch.equal(packed, blocks)                       # the layout is not the file's
    assert torch.equal(a8.dequantize(packed, qtype, k), g.dequantize_ref(blocks, qtype, k))


def test_repack_ref_puts_a_pair_in_nibble_order():
    """A Q8_0 pair's 64 bytes: [block 0 elements 0-15 | block 1 0-15 | block 0 16-31 | block 1 16-31], the order a
    Q4_1 pair's nibbles come out of one 32-byte load (& 15, then >> 4)."""
    blocks = torch.zeros(1, 2, 34, dtype=torch.uint8)
    blocks[0, :, 2:] = torch.arange(64, dtype=torch.uint8).reshape(2, 32)
    packed = a8.repack_ref(blocks.reshape(1, -1), g.Q8_0, 64)[0, :64]
    expected = torch.cat([torch.arange(0, 16), torch.arange(32, 48), torch.arange(16, 32), torch.arange(48, 64)])
    assert torch.equal(packed, expected.to(torch.uint8))


@needs_kernels
@pytest.mark.parametrize("isa_name", HOST_ISAS)
@pytest.mark.parametrize("k", WIDTHS)
def test_quantization_bit_for_bit(isa_name, k):
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(5, k, generator=gen) * torch.logspace(-3, 2, 5)[:, None]
    x[1, :32] = 0.0                                              # an all-zero block: scale 0, integers 0
    x[2, 5] = 1e4                                                # one large element dominating its block
    q, d, s = a8.split_quantized(a8.quantize(x, isa_name), k)
    q_ref, d_ref, s_ref = a8.quantize_ref(x)
    assert torch.equal(q, q_ref) and torch.equal(d, d_ref) and torch.equal(s, s_ref)
    assert q.abs().max().item() == 127


def test_quantize_ref_rounds_half_to_even():
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1], x[0, 2] = 127.0, 0.5, 2.5                 # scale 1: 0.5 -> 0, 2.5 -> 2
    q, d, s = a8.quantize_ref(x)
    assert d.item() == 1.0 and q[0, :3].tolist() == [127, 0, 2] and s.item() == 129.0


def product_tolerance(x, blocks, qtype, k):
    """fp32 sums of |terms| up to ~1e-5 relative (the kernels' float rounding against the float64 reference)."""
    return 1e-5 * (x.abs() @ g.dequantize_ref(blocks, qtype, k).abs().T).max().item() + 1e-6


@needs_kernels
@pytest.mark.parametrize("isa_name", HOST_ISAS)
@pytest.mark.parametrize("qtype", [g.Q4_1, g.Q8_0])
@pytest.mark.parametrize("m,n,k", [(1, 96, 64), (3, 200, 576), (2, 33, 96), (5, 64, 544), (4, 40, 1536),
                                   (9, 17, 672)])
def test_product_matches_reference(isa_name, qtype, m, n, k):
    blocks = random_blocks(n, k, qtype, seed=n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    out = a8.linear(x, a8.repack(blocks, qtype, k), qtype, k, isa_name)
    ref = a8.linear_ref(x, blocks, qtype, k)
    assert (out - ref).abs().max().item() <= product_tolerance(x, blocks, qtype, k)
    exact = F.linear(x.double(), g.dequantize_ref(blocks, qtype, k).double())
    err = (out.double() - exact).norm() / exact.norm()
    assert 1e-4 < err < 0.02                                     # int8 x: about 0.5%, and not fp32 activations


@needs_kernels
def test_product_threads_and_many_rows():
    """Threaded (a matrix above the threshold) equals one thread; many rows take dequantize + sgemm (fp32 x)."""
    blocks = random_blocks(2048, 576, g.Q4_1, seed=1)
    packed = a8.repack(blocks, g.Q4_1, 576)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(2))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = a8.linear(x, packed, g.Q4_1, 576)
        torch.set_num_threads(max(2, threads))
        many = a8.linear(x, packed, g.Q4_1, 576)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)                                # rows are split, never a row's sum
    wide = torch.randn(a8.MANY_ROWS, 576)
    out = a8.linear(wide, packed, g.Q4_1, 576)
    assert torch.allclose(out, F.linear(wide, g.dequantize_ref(blocks, g.Q4_1, 576)), atol=1e-4, rtol=1e-4)


@needs_kernels
def test_packed_gemm_matches_linear():
    blocks = random_blocks(300, 576, g.Q8_0, seed=4)
    packed = a8.repack(blocks, g.Q8_0, 576)
    x = torch.randn(2, 576, generator=torch.Generator().manual_seed(4))
    gemm = a8.PackedGemmA8(g.Q8_0, 576)
    assert torch.equal(gemm(x, packed), a8.linear(x, packed, g.Q8_0, 576))
    assert torch.equal(gemm(x.t().contiguous().t(), packed), gemm(x, packed))    # strided x: the general path


def test_choose_isa_follows_flags():
    assert a8.choose_isa(isa.preset("amx")) == "avx512_vnni"
    assert a8.choose_isa(isa.preset("avx512_vnni")) == "avx512_vnni"
    assert a8.choose_isa(isa.preset("avx512")) == "avx2"            # AVX-512 without VNNI: the 256-bit maddubs
    assert a8.choose_isa(isa.preset("avx_vnni")) == "avx_vnni"
    assert a8.choose_isa(isa.preset("avx2")) == "avx2"
    assert a8.choose_isa(isa.CpuFeatures("none", frozenset(), "test")) == "scalar"


def test_fallback_without_kernels(monkeypatch):
    monkeypatch.setenv("DEEPSERVE_CPU_KERNELS", "0")
    assert a8.library() is None
    blocks = random_blocks(16, 96, g.Q4_1, seed=5)
    packed = a8.repack(blocks, g.Q4_1, 96)
    assert torch.equal(packed, a8.repack_ref(blocks, g.Q4_1, 96))
    x = torch.randn(2, 96)
    assert torch.equal(a8.linear(x, packed, g.Q4_1, 96), a8.linear_ref(x, blocks, g.Q4_1, 96))
    assert torch.equal(a8.dequantize(packed, g.Q4_1, 96), g.dequantize_ref(blocks, g.Q4_1, 96))
