"""The int32 token bitmask: bit t % 32 of word t // 32, set = allowed; rows without a grammar untouched."""

from __future__ import annotations

import pytest
import torch

from deepserve.structured import bitmask as bm


def naive_allowed(words: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.tensor([[(int(words[r, t // 32]) >> (t % 32)) & 1 == 1 for t in range(vocab)]
                         for r in range(words.shape[0])])


def test_unpacking_matches_the_bit_layout():
    gen = torch.Generator().manual_seed(0)
    words = torch.randint(-2**31, 2**31 - 1, (3, 4), dtype=torch.int32, generator=gen)
    assert torch.equal(bm.allowed_tokens(words, 100), naive_allowed(words, 100))


def test_allow_only_sets_one_bit_also_the_sign_bit():
    mask = bm.allocate(2, 70)
    for token in (0, 31, 63, 69):
        bm.allow_only(mask, 1, token)
        allowed = bm.allowed_tokens(mask, 70)
        assert allowed[0].all() and allowed[1].nonzero().flatten().tolist() == [token]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])     # xgrammar's kernel; the torch path
def test_apply_masks_only_the_given_rows_and_leaves_the_input_alone(dtype):
    logits = torch.randn(3, 70).to(dtype)
    before = logits.clone()
    mask = bm.allocate(3, 70)
    bm.allow_only(mask, 0, 5)                  # row 0 carries a mask but is not in `rows`: untouched
    bm.allow_only(mask, 1, 42)
    out = bm.apply_bitmask(logits, mask, torch.tensor([1]))
    assert torch.equal(logits, before)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert out[1, 42] == logits[1, 42] and torch.isinf(out[1]).sum() == 69


def test_the_c_kernel_and_the_torch_ops_agree(monkeypatch):
    from deepserve.kernels.cpu.token_bitmask import apply_token_bitmask_
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 1000, generator=gen)
    mask = torch.randint(-2**31, 2**31 - 1, (5, bm.num_words(1000)), dtype=torch.int32, generator=gen)
    mask[1] = 0                                 # a row that allows nothing, and one word of each kind:
    mask[3, 0], mask[3, 1] = -1, 0
    rows = torch.tensor([1, 3, 4])
    in_c = logits.clone()
    if not apply_token_bitmask_(in_c, mask, rows):
        pytest.skip("no C compiler")
    monkeypatch.setenv("DEEPSERVE_CPU_KERNELS", "0")
    assert torch.equal(in_c, bm.apply_bitmask(logits, mask, rows))


def test_both_paths_agree_on_random_masks():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 1000, generator=gen)
    mask = torch.randint(-2**31, 2**31 - 1, (4, bm.num_words(1000)), dtype=torch.int32, generator=gen)
    rows = torch.tensor([0, 3])
    kernel = bm.apply_bitmask(logits, mask, rows)
    torch_path = bm.apply_bitmask(logits.t().contiguous().t(), mask, rows)     # not contiguous: torch ops
    assert torch.equal(kernel, torch_path)
    assert torch.equal(torch.isinf(kernel[rows]), ~bm.allowed_tokens(mask[rows], 1000))
