"""Shared helpers of the GPU kernel tests: random paged batches and per-dtype tolerances."""

import pytest
import torch

from deepserve.kernels import INTERPRET
from deepserve.layers.forward_batch import ForwardBatch

DTYPES = [torch.bfloat16, torch.float16]

# Attention (flash-style: probabilities rounded to the value dtype before P @ V, output rounded once) against the
# reference (float32 softmax, output rounded once): relative Frobenius error and max abs error (|q|, |k|, |v| ~ 1).
ATTN_TOL = {torch.bfloat16: (1.5e-2, 6e-2), torch.float16: (3e-3, 1e-2)}
# Elementwise kernels that do the reference's float32 arithmetic: one or two roundings of the output dtype.
ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -22}


def skip_bf16_in_interpreter(dtype):
    if INTERPRET and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter gets bf16 wrong (tl.dot; float32 -> bf16 truncates): GPU only")


def cdiv(a, b):
    return -(-a // b)


def make_batch(seqs, block_size, num_blocks, device, pad_blocks=2):
    """ForwardBatch for sequences given as (cached tokens, new tokens), on blocks drawn at random (non-contiguous,
    shuffled) from a cache of `num_blocks`; block tables padded with 0 beyond each sequence's blocks."""
    perm = torch.randperm(num_blocks).tolist()
    tables, positions, slots, q_lens, s_lens = [], [], [], [], []
    for ctx, n in seqs:
        seq_len = ctx + n
        table = [perm.pop() for _ in range(cdiv(seq_len, block_size))]
        tables.append(table)
        pos = list(range(ctx, seq_len))
        positions += pos
        slots += [table[p // block_size] * block_size + p % block_size for p in pos]
        q_lens.append(n)
        s_lens.append(seq_len)
    max_blocks = max(len(t) for t in tables) + pad_blocks
    bt = torch.zeros(len(seqs), max_blocks, dtype=torch.int64)
    for b, t in enumerate(tables):
        bt[b, :len(t)] = torch.tensor(t)
    starts = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    starts[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    t_total = sum(q_lens)
    return ForwardBatch(
        input_ids=torch.zeros(t_total, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=bt.to(device), query_start_loc=starts.to(device),
        seq_lens=torch.tensor(s_lens, dtype=torch.int64, device=device),
        query_lens_cpu=q_lens, seq_lens_cpu=s_lens,
        logits_indices=torch.zeros(0, dtype=torch.int64, device=device), block_size=block_size)


def random_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device):
    return torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, device=device).to(dtype)


def assert_attention_close(out, ref, dtype):
    o, r = out.float(), ref.float()
    assert torch.isfinite(o).all(), "non-finite output (unwritten rows?)"
    rel = ((o - r).norm() / r.norm()).item()
    max_abs = (o - r).abs().max().item()
    rel_tol, abs_tol = ATTN_TOL[dtype]
    assert rel < rel_tol and max_abs < abs_tol, f"rel {rel:.2e} (tol {rel_tol}), max abs {max_abs:.2e} (tol {abs_tol})"


def assert_within_ulps(out, ref, dtype, ulps=1, min_exact=0.99, atol=0.0, scale=None):
    """|out - ref| <= ulps roundings of the dtype (relative) + atol, and most elements bit-identical. `atol` covers
    float32 reassociation (e.g. a fused multiply-add) on results that cancel to near zero. `scale` (ref's shape):
    the magnitude each element's roundings are counted in, where it is not |ref| (`rotation_pair_norms`)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    o, r = out.float(), ref.float()
    assert torch.isfinite(o).all()
    tol = ulps * ULP[dtype] * (r.abs() if scale is None else scale.float()) + atol + 1e-30
    excess = (o - r).abs() - tol
    bad = excess > 0
    if bad.any():
        i = int(excess.flatten().argmax())
        raise AssertionError(f"{int(bad.sum())} of {o.numel()} elements beyond {ulps} ulp + {atol:.1e}; worst: "
                             f"out {o.flatten()[i].item():.8e} ref {r.flatten()[i].item():.8e}")
    exact = (o == r).float().mean().item()
    assert exact >= min_exact, f"only {exact:.4f} of elements bit-identical"


def rotation_pair_norms(x):
    """|(x[j], x[j + D/2])| for each element of x [..., D] (NeoX pairs): what a rotated element's roundings scale
    with. A rotated value x1 cos - x2 sin may cancel far below its terms, and an input rounded one ulp apart (its
    norm statistics summed in another order) then moves it by an ulp of the terms, many of its own."""
    half = x.shape[-1] // 2
    norms = torch.hypot(x[..., :half].float(), x[..., half:].float())
    return torch.cat([norms, norms], dim=-1)


def assert_close_rel(out, ref, tol):
    """tol = (relative Frobenius error, max abs error) of out against ref, both as float32; out all finite."""
    o, r = out.float(), ref.float()
    assert torch.isfinite(o).all(), "non-finite output (unwritten rows?)"
    rel = ((o - r).norm() / r.norm()).item()
    max_abs = (o - r).abs().max().item()
    assert rel < tol[0] and max_abs < tol[1], f"rel {rel:.2e} (tol {tol[0]}), max abs {max_abs:.2e} (tol {tol[1]})"


def poison_unused_splits(part_out, part_lse, used):
    """Split-K partials [n, H, S, D] / [n, H, S] with NaN in every split at or past used[i] (splits a reduce must not
    read)."""
    unused = torch.arange(part_lse.shape[-1], device=part_lse.device)[None, :] >= used[:, None]      # [n, S]
    part_out = part_out.masked_fill(unused[:, None, :, None], float("nan"))
    part_lse = part_lse.masked_fill(unused[:, None, :], float("nan"))
    return part_out, part_lse
