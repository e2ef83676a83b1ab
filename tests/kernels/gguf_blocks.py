"""Random GGUF blocks for the packed-weight kernel tests (test_gguf_linear.py, test_gguf_a8.py)."""

import torch

from deepserve.kernels.cpu import gguf_linear as g


def random_blocks(rows: int, cols: int, qtype: int, seed: int = 0,
                  gen: torch.Generator | None = None) -> torch.Tensor:
    """Random blocks with sane fp16 scales (d > 0; Q4_1's m < 0, as llama.cpp's quantizer makes them), drawn from
    `gen` (default: a generator seeded with `seed`)."""
    gen = torch.Generator().manual_seed(seed) if gen is None else gen
    nb = cols // g.QK
    b = torch.randint(0, 256, (rows, nb, g.BLOCK_BYTES[qtype]), dtype=torch.uint8, generator=gen)
    b[..., 0:2] = (torch.rand(rows, nb, generator=gen) * 0.02 + 1e-3).half().view(torch.uint8).reshape(rows, nb, 2)
    if qtype == g.Q4_1:
        b[..., 2:4] = (-torch.rand(rows, nb, generator=gen) * 0.1).half().view(torch.uint8).reshape(rows, nb, 2)
    return b.reshape(rows, -1).contiguous()
