"""Paged attention kernels (KV write, decode with split-K, varlen prefill over a cached prefix) and the
TritonPagedAttention backend against the PyTorch reference backend."""

import math

import pytest
import torch

from deepserve.kernels import INTERPRET
from deepserve.kernels.attention_backend import TritonPagedAttention
from deepserve.kernels.paged_attention import (decode_attention, decode_attention_ref, decode_num_splits,
                                               prefill_attention, prefill_attention_ref, prefill_tiles, write_kv,
                                               write_kv_ref)
from deepserve.layers.attention import TorchPagedAttention
from kernel_testing import DTYPES, assert_attention_close, make_batch, random_cache, skip_bf16_in_interpreter

pytestmark = pytest.mark.gpu

HEAD_DIMS = [64, 128]
GROUPS = [1, 4, 8]          # query heads per KV head
NUM_KV_HEADS = 2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_kv_heads,head_dim", [(2, 64), (8, 128), (3, 96)])
def test_write_kv_matches_reference(device, dtype, num_kv_heads, head_dim):
    bs, nb, t = 16, 40, 37
    cache = random_cache(nb, bs, num_kv_heads, head_dim, dtype, device)
    slots = torch.randperm(nb * bs, device=device)[:t]
    # k and v as the attention layer sees them: strided views into one fused projection output.
    qkv = torch.randn(t, (4 + 2) * num_kv_heads * head_dim, device=device).to(dtype)
    k = qkv[:, 4 * num_kv_heads * head_dim:5 * num_kv_heads * head_dim].view(t, num_kv_heads, head_dim)
    v = qkv[:, 5 * num_kv_heads * head_dim:].view(t, num_kv_heads, head_dim)
    ref = cache.clone()
    write_kv_ref(ref, k, v, slots)
    write_kv(cache, k, v, slots)
    assert torch.equal(cache, ref)


def test_write_kv_skips_negative_slots(device):
    cache = random_cache(4, 16, 2, 64, torch.float16, device)
    before = cache.clone()
    k = torch.randn(3, 2, 64, device=device).half()
    slots = torch.tensor([5, -1, 17], device=device)
    write_kv(cache, k, k, slots)
    flat = cache.view(2, -1, 2, 64)
    assert torch.equal(flat[0, 5], k[0]) and torch.equal(flat[1, 17], k[2])
    mask = torch.ones(flat.shape[1], dtype=torch.bool, device=device)
    mask[[5, 17]] = False
    assert torch.equal(flat[:, mask], before.view(2, -1, 2, 64)[:, mask])


def _decode_case(device, dtype, head_dim, group, lens, block_size, num_blocks):
    seqs = [(n - 1, 1) for n in lens]
    batch = make_batch(seqs, block_size, num_blocks, device)
    h = NUM_KV_HEADS * group
    cache = random_cache(num_blocks, block_size, NUM_KV_HEADS, head_dim, dtype, device)
    q = torch.randn(len(lens), h, head_dim, device=device).to(dtype)
    return batch, cache, q


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("group", GROUPS)
def test_decode_matches_reference(device, dtype, head_dim, group):
    skip_bf16_in_interpreter(dtype)
    lens = [1, 15, 16, 17, 100, 333, 1000]
    batch, cache, q = _decode_case(device, dtype, head_dim, group, lens, 16, 200)
    scale = 1 / math.sqrt(head_dim)
    ref = decode_attention_ref(q, cache, batch.block_tables, batch.seq_lens, scale)
    for splits in (None, 1, 3, 7):
        out = torch.full_like(q, float("nan"))
        decode_attention(q, cache, batch.block_tables, batch.seq_lens, scale, out=out, max_seq_len=max(lens),
                         num_splits=splits)
        assert_attention_close(out, ref, dtype)


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_decode_other_block_sizes(device, block_size):
    dtype = torch.float16
    lens = [3, 31, 64, 65, 250]
    batch, cache, q = _decode_case(device, dtype, 128, 4, lens, block_size, cdiv_total(lens, block_size) + 8)
    ref = decode_attention_ref(q, cache, batch.block_tables, batch.seq_lens, 0.1)
    for splits in (1, 4):
        out = decode_attention(q, cache, batch.block_tables, batch.seq_lens, 0.1, num_splits=splits)
        assert_attention_close(out, ref, dtype)


def cdiv_total(lens, bs):
    return sum(-(-n // bs) for n in lens)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_decode_long_context_uses_split_k(device, dtype, head_dim):
    """Contexts up to 8k with a small batch: the heuristic splits the context and the reduce merges it."""
    skip_bf16_in_interpreter(dtype)
    lens = [8192, 5000, 1, 777] if not INTERPRET else [2500, 1, 700]
    group = 4
    assert decode_num_splits(len(lens), NUM_KV_HEADS, max(lens), torch.device(device)) > 1
    batch, cache, q = _decode_case(device, dtype, head_dim, group, lens, 16, cdiv_total(lens, 16) + 16)
    scale = 1 / math.sqrt(head_dim)
    # Sharper scores than 1/sqrt(d) so that long contexts are not a near-uniform average.
    ref = decode_attention_ref(q, cache, batch.block_tables, batch.seq_lens, 4 * scale)
    out = decode_attention(q, cache, batch.block_tables, batch.seq_lens, 4 * scale)
    assert_attention_close(out, ref, dtype)


def test_decode_rows_subset(device):
    """Decode rows scattered among other rows: only those rows are written, each from its own sequence."""
    dtype = torch.float16
    lens = [40, 7, 300]
    batch, cache, q_small = _decode_case(device, dtype, 64, 4, lens, 16, 64)
    q = torch.randn(10, q_small.shape[1], 64, device=device).half()
    rows = torch.tensor([8, 2, 5], device=device)
    seq_ids = torch.tensor([2, 0, 1], device=device)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, cache, batch.block_tables, batch.seq_lens, 0.125, out=out, q_rows=rows, seq_ids=seq_ids)
    ref = decode_attention_ref(q, cache, batch.block_tables, batch.seq_lens, 0.125, q_rows=rows, seq_ids=seq_ids)
    assert_attention_close(out[rows], ref[rows], dtype)
    others = torch.ones(10, dtype=torch.bool, device=device)
    others[rows] = False
    assert torch.isnan(out[others]).all()


PREFILL_SEQS = [(0, 2), (0, 37), (0, 64), (17, 50), (100, 129), (256, 3), (1000, 200), (31, 1), (0, 1)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("group", GROUPS)
def test_prefill_matches_reference(device, dtype, head_dim, group):
    """Whole prompts, prompts over a cached prefix and chunks, with odd lengths, in one launch."""
    skip_bf16_in_interpreter(dtype)
    seqs = PREFILL_SEQS if not INTERPRET else [(0, 37), (17, 50), (100, 70), (0, 1)]
    bs = 16
    nb = cdiv_total([c + n for c, n in seqs], bs) + 10
    batch = make_batch(seqs, bs, nb, device)
    h = NUM_KV_HEADS * group
    cache = random_cache(nb, bs, NUM_KV_HEADS, head_dim, dtype, device)
    q = torch.randn(batch.num_tokens, h, head_dim, device=device).to(dtype)
    scale = 1 / math.sqrt(head_dim)
    tile_seq, tile_m0 = prefill_tiles(batch.query_lens_cpu, list(range(len(seqs))), device)
    out = torch.full_like(q, float("nan"))
    prefill_attention(q, cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, scale, tile_seq, tile_m0,
                      out=out)
    ref = prefill_attention_ref(q, cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, scale,
                                seqs=list(range(len(seqs))))
    assert_attention_close(out, ref, dtype)


MIXED_SEQS = [(0, 23), (40, 1), (7, 1), (130, 70), (0, 1), (1500, 1), (64, 64), (5, 2)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("group", GROUPS)
def test_backend_matches_torch_backend(device, dtype, head_dim, group):
    """A mixed step (prefills, a chunk over a cached prefix, decodes) through both backends: same cache writes,
    same outputs, with q/k/v as strided views of one projection output."""
    skip_bf16_in_interpreter(dtype)
    bs = 16
    batch = make_batch(MIXED_SEQS, bs, 160, device)
    h, hkv = NUM_KV_HEADS * group, NUM_KV_HEADS
    t = batch.num_tokens
    qkv = torch.randn(t, (h + 2 * hkv) * head_dim, device=device).to(dtype)
    q = qkv[:, :h * head_dim].view(t, h, head_dim)
    k = qkv[:, h * head_dim:(h + hkv) * head_dim].view(t, hkv, head_dim)
    v = qkv[:, (h + hkv) * head_dim:].view(t, hkv, head_dim)
    cache = random_cache(160, bs, hkv, head_dim, dtype, device)
    scale = 1 / math.sqrt(head_dim)
    results = {}
    for name, backend in (("torch", TorchPagedAttention()), ("triton", TritonPagedAttention())):
        c = cache.clone()
        batch.attn_metadata = backend.build_metadata(batch)
        results[name] = (backend.forward(q, k, v, c, batch, scale), c)
    (ref, ref_cache), (out, out_cache) = results["torch"], results["triton"]
    assert torch.equal(out_cache, ref_cache)
    assert_attention_close(out, ref, dtype)


def test_backend_decode_only_long(device):
    """A decode-only step with long contexts through the backend (split-K path)."""
    dtype = torch.float16
    lens = [4000, 6000, 123] if not INTERPRET else [1500, 600]
    batch = make_batch([(n - 1, 1) for n in lens], 16, cdiv_total(lens, 16) + 4, device)
    hkv, h, d = 2, 8, 128
    cache = random_cache(cdiv_total(lens, 16) + 4, 16, hkv, d, dtype, device)
    q = torch.randn(len(lens), h, d, device=device).to(dtype)
    k = torch.randn(len(lens), hkv, d, device=device).to(dtype)
    v = torch.randn(len(lens), hkv, d, device=device).to(dtype)
    outs = []
    for backend in (TorchPagedAttention(), TritonPagedAttention()):
        c = cache.clone()
        batch.attn_metadata = backend.build_metadata(batch)
        outs.append((backend.forward(q, k, v, c, batch, 0.2), c))
    assert torch.equal(outs[0][1], outs[1][1])
    assert_attention_close(outs[1][0], outs[0][0], dtype)
