"""The token bitmask: int32 words, 32 tokens a word (token t is bit t % 32 of word t // 32), bit set = allowed.

xgrammar fills rows of it on the host (one row per sampled logits row); the sampler turns disallowed tokens
into -inf before any other processing. A row of all ones (-1 words) allows every token, and rows that carry
no grammar are never touched at all, so an unconstrained row's logits stay the same bit for bit.
"""

from __future__ import annotations

import torch

ALL_ALLOWED = -1        # an int32 word with all 32 bits set


def num_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate(rows: int, vocab_size: int) -> torch.Tensor:
    """A host bitmask of `rows` rows that allows every token (xgrammar fills rows of a CPU int32 tensor)."""
    return torch.full((rows, num_words(vocab_size)), ALL_ALLOWED, dtype=torch.int32)


def allow_only(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    """Row `row` allows `token_id` alone (a forced token)."""
    bitmask[row].zero_()
    word, bit = divmod(token_id, 32)
    bitmask[row, word] = _as_int32(1 << bit)


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 words -> [R, vocab_size] bool (True = allowed)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1          # arithmetic shift: bit 31 of a negative word is kept
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """A copy of `logits` with the disallowed tokens of `rows` at -inf (`bitmask` has one row per logits row;
    only `rows` are read). Other rows are copied unchanged; the caller's tensor is not written.

    float32 CPU logits go through a C kernel (kernels/cpu/token_bitmask.c: ~0.5 ms at 32 x 49152 where unpacking
    the bits with torch ops takes ~12 ms); other devices, or without the C library, the torch ops below."""
    if logits.is_cpu:
        from deepserve.kernels.cpu.token_bitmask import apply_token_bitmask_
        masked = logits.clone()
        if apply_token_bitmask_(masked, bitmask, rows):
            return masked
    rows = rows.to(logits.device)
    allowed = allowed_tokens(bitmask.to(logits.device, non_blocking=True).index_select(0, rows), logits.shape[-1])
    return logits.index_put((rows,), logits.index_select(0, rows).masked_fill(~allowed, float("-inf")))


def _as_int32(value: int) -> int:
    return value - (1 << 32) if value >= 1 << 31 else value
