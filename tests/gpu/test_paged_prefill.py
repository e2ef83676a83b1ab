"""The varlen paged prefill kernel (kernels/paged_prefill.py) against its PyTorch twin: whole prompts, prompts over a
cached prefix and chunks, odd lengths, in one launch."""

import math

import pytest
import torch

from deepserve.kernels import INTERPRET
from deepserve.kernels.paged_prefill import prefill_attention, prefill_attention_ref, prefill_tiles
from kernel_testing import DTYPES, assert_attention_close, make_batch, random_cache, skip_bf16_in_interpreter
from test_paged_attention import GROUPS, HEAD_DIMS, NUM_KV_HEADS, cdiv_total

pytestmark = pytest.mark.gpu


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


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("head_dim,group", [(64, 4), (128, 8)])
def test_prefill_over_fp8_cache_matches_reference(device, cache_dtype, head_dim, group):
    """An fp8 cache (kv_cache_dtype "fp8" / "fp8_e5m2"): keys and values widened to q's dtype as they load, against
    the reference reading the same codes."""
    dtype = torch.float16 if INTERPRET else torch.bfloat16
    seqs = [(0, 37), (17, 50), (100, 70), (0, 1)]
    bs = 16
    nb = cdiv_total([c + n for c, n in seqs], bs) + 10
    batch = make_batch(seqs, bs, nb, device)
    cache = random_cache(nb, bs, NUM_KV_HEADS, head_dim, dtype, device).to(cache_dtype)
    q = torch.randn(batch.num_tokens, NUM_KV_HEADS * group, head_dim, device=device).to(dtype)
    tile_seq, tile_m0 = prefill_tiles(batch.query_lens_cpu, list(range(len(seqs))), device)
    out = torch.full_like(q, float("nan"))
    prefill_attention(q, cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, 0.1, tile_seq, tile_m0,
                      out=out)
    ref = prefill_attention_ref(q, cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, 0.1,
                                seqs=list(range(len(seqs))))
    assert_attention_close(out, ref, dtype)


@pytest.mark.parametrize("window", [1, 5, 64, 100, 300, 3000])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_prefill_sliding_window_matches_reference(device, window, head_dim):
    """Query i sees keys i - window < j <= i: windows shorter than a tile (some rows see no key of the band's first
    tiles), starting mid-tile, with unmasked tiles between the window's edge and the diagonal (300 over 1200 keys),
    and longer than every context; whole prompts, chunks over a cached prefix."""
    dtype = torch.float16
    seqs = PREFILL_SEQS if not INTERPRET else [(0, 37), (17, 50), (100, 70), (0, 1)]
    bs = 16
    nb = cdiv_total([c + n for c, n in seqs], bs) + 10
    batch = make_batch(seqs, bs, nb, device)
    cache = random_cache(nb, bs, NUM_KV_HEADS, head_dim, dtype, device)
    q = torch.randn(batch.num_tokens, NUM_KV_HEADS * 4, head_dim, device=device).to(dtype)
    tile_seq, tile_m0 = prefill_tiles(batch.query_lens_cpu, list(range(len(seqs))), device)
    out = torch.full_like(q, float("nan"))
    prefill_attention(q, cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, 0.5, tile_seq, tile_m0,
                      out=out, window=window)
    ref = prefill_attention_ref(q, cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, 0.5,
                                seqs=list(range(len(seqs))), window=window)
    assert_attention_close(out, ref, dtype)
    if window < 64:
        full = prefill_attention_ref(q, cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, 0.5,
                                     seqs=list(range(len(seqs))))
        assert not torch.allclose(out.float(), full.float(), atol=1e-2)
