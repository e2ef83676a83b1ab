"""The C per-token quantization and w8a8 epilogue against their PyTorch twins: bit-identical."""

import pytest
import torch

from deepserve.kernels.cpu import int8_quant
from deepserve.kernels.cpu.int8_quant import dequantize, dequantize_ref, quantize_per_token, quantize_per_token_ref

needs_kernels = pytest.mark.skipif(int8_quant._library() is None, reason="no C compiler or DEEPSERVE_CPU_KERNELS=0")


@needs_kernels
@pytest.mark.parametrize("rows,cols", [(1, 576), (7, 64), (64, 1536), (300, 17)])
def test_quantize_matches_torch_bit_for_bit(rows, cols):
    torch.manual_seed(rows * cols)
    x = torch.randn(rows, cols) * torch.logspace(-3, 2, rows)[:, None]
    x[0, :3] = torch.tensor([0.5, -1.5, 2.5]) * x[0].abs().max() / 127   # exact halves: ties go to even
    if rows > 2:
        x[2] = 0.0                                                        # an all-zero row: scale clamps
    q, s = quantize_per_token(x)
    q_ref, s_ref = quantize_per_token_ref(x)
    assert torch.equal(s, s_ref) and torch.equal(q, q_ref)


@needs_kernels
def test_quantize_reads_strided_rows():
    x = torch.randn(5, 40)[:, :32]
    assert not x.is_contiguous()
    q, s = quantize_per_token(x)
    q_ref, s_ref = quantize_per_token_ref(x)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)


@needs_kernels
@pytest.mark.parametrize("rows,cols", [(1, 576), (64, 1536), (33, 49)])
def test_dequantize_matches_torch_bit_for_bit(rows, cols):
    acc = torch.randint(-2**20, 2**20, (rows, cols), dtype=torch.int32)
    row_scales, col_scales = torch.rand(rows, 1) / 127, torch.rand(cols) / 127
    assert torch.equal(dequantize(acc, row_scales, col_scales), dequantize_ref(acc, row_scales, col_scales))


def test_fallback_without_kernels(monkeypatch):
    monkeypatch.setenv("DEEPSERVE_CPU_KERNELS", "0")
    x = torch.randn(4, 16)
    q, s = quantize_per_token(x)
    q_ref, s_ref = quantize_per_token_ref(x)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
