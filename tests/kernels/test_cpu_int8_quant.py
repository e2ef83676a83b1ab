"""w8a8's per-token quantization, and the C epilogue against its PyTorch twin: bit-identical."""

import pytest
import torch

from deepserve.kernels.cpu import int8_quant
from deepserve.kernels.cpu.int8_quant import dequantize, dequantize_ref, quantize_per_token, quantize_per_token_ref

needs_kernels = pytest.mark.skipif(int8_quant._library() is None, reason="no C compiler or DEEPSERVE_CPU_KERNELS=0")


@needs_kernels
@pytest.mark.parametrize("rows,cols", [(1, 576), (64, 1536), (33, 49)])
def test_dequantize_matches_torch_bit_for_bit(rows, cols):
    acc = torch.randint(-2**20, 2**20, (rows, cols), dtype=torch.int32)
    row_scales, col_scales = torch.rand(rows, 1) / 127, torch.rand(cols) / 127
    assert torch.equal(dequantize(acc, row_scales, col_scales), dequantize_ref(acc, row_scales, col_scales))


@needs_kernels
@pytest.mark.parametrize("rows,cols", [(1, 576), (64, 1536), (33, 49), (600, 576)])   # 600 x 576: threaded
def test_quantize_matches_torch_bit_for_bit(rows, cols):
    x = torch.randn(rows, cols) * torch.logspace(-3, 3, rows)[:, None]
    x[0, :8] = torch.tensor([0.5, -1.5, 2.5, 126.5, -126.5, 3.4999, 0.0, -0.0]) * x[0].abs().max() / 127
    q, s = quantize_per_token(x)
    q_ref, s_ref = quantize_per_token_ref(x)
    assert q.dtype == torch.int8 and s.shape == (rows, 1)
    assert torch.equal(s, s_ref) and torch.equal(q, q_ref)


def test_quantize_per_token_rounds_half_to_even_and_clamps_zero_rows():
    x = torch.randn(3, 32)
    x[0, 3] = 127.0                        # the row's maximum: its scale is exactly 1
    x[0, :3] = torch.tensor([0.5, -1.5, 2.5])   # exact halves: ties go to even
    x[2] = 0.0                                                            # an all-zero row: the scale clamps
    q, s = quantize_per_token(x)
    assert q[0, :3].tolist() == [0, -2, 2] and s[2].item() == pytest.approx(1e-8 / 127) and not q[2].any()
    assert (q.float() * s - x).abs().max() <= s.max() / 2 + 1e-9


def test_fallback_without_kernels(monkeypatch):
    monkeypatch.setenv("DEEPSERVE_CPU_KERNELS", "0")
    acc = torch.randint(-2**20, 2**20, (4, 16), dtype=torch.int32)
    rs, cs = torch.rand(4, 1), torch.rand(16)
    assert torch.equal(dequantize(acc, rs, cs), dequantize_ref(acc, rs, cs))
    x = torch.randn(4, 16)
    assert all(torch.equal(a, b) for a, b in zip(quantize_per_token(x), quantize_per_token_ref(x)))
