"""The rotary embedding handed to the attention (the Llama layer's call): the reference backend rotates q and k at the
batch's positions, then writes and attends, bit for bit as rotating first; q and k given as views side by side in the
fused qkv output are rotated in one pass (one C call on the CPU), as the Llama layer did before it handed them over."""

from __future__ import annotations

import math

import pytest
import torch

from deepserve.kernels.cpu import rotary as cpu_rotary
from deepserve.layers.attention import TorchPagedAttention
from deepserve.layers.rotary import RotaryEmbedding, side_by_side
from deepserve.layers.forward_batch import ForwardBatch

H, HKV, D, BS, NUM_BLOCKS = 6, 2, 32, 16, 24


def _batch(seqs) -> ForwardBatch:
    """Sequences (cached, new) on consecutive blocks."""
    positions, slots, tables, next_block = [], [], [], 0
    for cached, new in seqs:
        n_blocks = -(-(cached + new) // BS)
        table = list(range(next_block, next_block + n_blocks))
        next_block += n_blocks
        tables.append(table)
        positions += range(cached, cached + new)
        slots += [table[p // BS] * BS + p % BS for p in range(cached, cached + new)]
    block_tables = torch.zeros(len(seqs), max(map(len, tables)), dtype=torch.int64)
    for b, table in enumerate(tables):
        block_tables[b, :len(table)] = torch.tensor(table)
    q_lens = [n for _, n in seqs]
    starts = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    starts[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    return ForwardBatch(input_ids=torch.zeros(sum(q_lens), dtype=torch.int64), positions=torch.tensor(positions),
                        slot_mapping=torch.tensor(slots), block_tables=block_tables, query_start_loc=starts,
                        seq_lens=torch.tensor([c + n for c, n in seqs]), query_lens_cpu=q_lens,
                        seq_lens_cpu=[c + n for c, n in seqs], logits_indices=torch.zeros(0, dtype=torch.int64),
                        block_size=BS)


def _qkv(t: int, dtype=torch.float32):
    qkv = torch.randn(t, (H + 2 * HKV) * D).to(dtype)
    return (qkv[:, :H * D].view(t, H, D), qkv[:, H * D:(H + HKV) * D].view(t, HKV, D),
            qkv[:, (H + HKV) * D:].view(t, HKV, D))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("separate", [False, True], ids=["qkv_views", "separate"])
def test_reference_backend_rotates_then_writes(dtype, separate):
    torch.manual_seed(0)
    rope = RotaryEmbedding(D, 512, 10000.0)
    batch = _batch([(0, 9), (20, 1), (5, 1), (30, 4)])
    q, k, v = _qkv(batch.num_tokens, dtype)
    if separate:                # Qwen3's q and k come out of their norms as tensors of their own
        q, k = q.clone(), k.clone()
    cache = torch.randn(2, NUM_BLOCKS, BS, HKV, D).to(dtype)
    backend = TorchPagedAttention()
    with torch.inference_mode():
        batch.attn_metadata = backend.build_metadata(batch)
        fused_cache, first_cache = cache.clone(), cache.clone()
        out = backend.forward(q, k, v, fused_cache, batch, 1 / math.sqrt(D), rotary=rope)
        q_rot, k_rot = rope(batch.positions, q, k)
        ref = backend.forward(q_rot, k_rot, v, first_cache, batch, 1 / math.sqrt(D))
    assert torch.equal(out, ref) and torch.equal(fused_cache, first_cache)


def test_side_by_side_views_rotate_in_one_pass(monkeypatch):
    torch.manual_seed(1)
    rope = RotaryEmbedding(D, 512, 10000.0)
    calls = []
    real = cpu_rotary.rotate_half
    monkeypatch.setattr(cpu_rotary, "rotate_half", lambda pos, x, *a: calls.append(x.shape) or real(pos, x, *a))
    for t in (1, 5):
        q, k, v = _qkv(t)
        pos = torch.randint(0, 512, (t,))
        assert side_by_side(q, v) is None and side_by_side(q, k.clone()) is None
        assert side_by_side(q, k).data_ptr() == q.data_ptr()
        calls.clear()
        with torch.inference_mode():
            q_rot, k_rot = rope(pos, q, k)
            assert calls == [(t, H + HKV, D)]
            apart = rope(pos, q.clone(), k.clone())
        assert len(calls) == 3
        assert torch.equal(q_rot, apart[0]) and torch.equal(k_rot, apart[1])
