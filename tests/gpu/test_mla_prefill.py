"""TritonMLA on steps with prefill rows (batched expanded attention, deepserve/kernels/mla_prefill.py; decode rows
of mixed steps through the latent decode kernel) against the reference TorchMLA (deepserve/layers/mla.py)."""

import pytest
import torch

from deepserve.layers.mla_triton import TritonMLA, TritonMLAMetadata
from deepserve.kernels.mla_prefill import MLA_PREFILL_BLOCK_M, plan_prefill
from deepserve.layers.attention import TorchPagedAttention
from deepserve.layers.mla import MLAWeights, TorchMLA
from kernel_testing import make_batch, skip_bf16_in_interpreter, assert_close_rel
from test_fused_moe import _interpreter_scalars  # noqa: F401  (autouse fixture)

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Backend vs reference on the same inputs (|q|, |c|, |k_pe| ~ 1, expanded keys/values ~ 1): relative Frobenius
# error and max abs error. float32: reassociation only (IEEE products in the kernel). Half precision: the
# reference runs SDPA in the dtype, the kernel rounds probabilities to it for P @ V (flash-attention style); the
# decode rows add the absorbed query and W_UV products in the dtype (the reference does them in float32).
TOL = {torch.float32: (1e-5, 1e-4), torch.float16: (5e-3, 2e-2), torch.bfloat16: (3e-2, 1e-1)}

# (heads, kv_lora_rank, rope, nope, v): DeepSeek-V2-Lite's attention, and a small odd one (no power of two,
# nope != v, fewer heads than anything real).
SHAPES = {"V2": (16, 512, 64, 128, 128), "odd": (3, 40, 6, 10, 12)}

# (cached tokens, new tokens) per sequence: decodes, fresh prompts (one inside a query tile, one over three
# tiles), chunks over a cached prefix that is not tile- or block-aligned, a 2-token chunk over a long prefix,
# and a 1-token chunk of a prompt (a decode as far as attention goes).
MIXED = [(40, 1), (0, 23), (7, 1), (0, 150), (70, 90), (130, 2), (200, 1), (16, 1), (33, 17)]


def _inputs(device, dtype, t, heads, rank, rope, nope, v_dim, stacked=True):
    """Queries and latents as strided views of the projections' outputs (what the model passes), per-head
    weights as views of one kv_b_proj matrix."""
    kv_b = (torch.randn(heads * (nope + v_dim), rank, device=device) / rank ** 0.5).to(dtype)
    w_uk, w_uv = kv_b.view(heads, nope + v_dim, rank).split([nope, v_dim], dim=1)
    q = torch.randn(t, heads, nope + rope, device=device).to(dtype)
    kv_a = torch.randn(t, rank + rope, device=device).to(dtype)
    q_nope, q_pe = q.split([nope, rope], dim=-1)
    latent, k_pe = kv_a.split([rank, rope], dim=-1)
    return q_nope, q_pe, latent, k_pe, MLAWeights(w_uk, w_uv, kv_b if stacked else None)


def _run_both(device, dtype, seqs, shape, block_size=16, stacked=True, cache_dtype=None):
    """(reference output, reference cache, TritonMLA output, TritonMLA cache, TritonMLA metadata) of one step; the
    latent cache in `cache_dtype` (default: the activations' dtype)."""
    heads, rank, rope, nope, v_dim = shape
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 6
    batch = make_batch(seqs, block_size, num_blocks, device)
    q_nope, q_pe, latent, k_pe, weights = _inputs(device, dtype, batch.num_tokens, heads, rank, rope, nope, v_dim,
                                                  stacked)
    cache = torch.randn(num_blocks, block_size, rank + rope, device=device).to(cache_dtype or dtype)
    scale = (nope + rope) ** -0.5
    batch.attn_metadata = TorchPagedAttention().build_metadata(batch)
    ref_cache = cache.clone()
    ref = TorchMLA().forward(q_nope, q_pe, latent, k_pe, ref_cache, weights, batch, scale)
    backend = TritonMLA()
    meta = backend.build_metadata(batch)
    batch.attn_metadata = meta
    out = backend.forward(q_nope, q_pe, latent, k_pe, cache, weights, batch, scale)
    return ref, ref_cache, out, cache, meta


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_mixed_step_matches_torch_mla(device, dtype, shape):
    """Decodes, fresh prompts, chunks over cached prefixes in one step: same cache writes, outputs within TOL."""
    skip_bf16_in_interpreter(dtype)
    ref, ref_cache, out, cache, meta = _run_both(device, dtype, MIXED, shape)
    assert isinstance(meta, TritonMLAMetadata) and meta.decode_rows is not None
    assert torch.equal(cache, ref_cache)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert_close_rel(out, ref, TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_only_step(device, dtype):
    """Fresh prompts only (the large prefill step): no decode rows; the weights without their stacked matrix."""
    ref, ref_cache, out, cache, meta = _run_both(device, dtype, [(0, 64), (0, 65), (0, 2), (0, 31)],
                                                 SHAPES["odd"], stacked=False)
    assert meta.decode_rows is None and len(meta.prefill.groups) == 1
    assert torch.equal(cache, ref_cache)
    assert_close_rel(out, ref, TOL[dtype])


@pytest.mark.parametrize("block_size", [1, 5, 64])
def test_other_block_sizes(device, block_size):
    """Gathered keys are whole cache blocks: blocks of one token, of an odd size, larger than some sequences."""
    ref, ref_cache, out, cache, _ = _run_both(device, torch.float32, MIXED[:6], SHAPES["odd"], block_size)
    assert torch.equal(cache, ref_cache)
    assert_close_rel(out, ref, TOL[torch.float32])


def test_long_prefixes_split_into_groups(device):
    """Chunks over long prefixes: visible tokens far beyond the step's tokens are expanded a group at a time
    (each group within max(step tokens, longest context)), with the same results."""
    seqs = [(300, 4), (5, 1), (280, 3), (0, 5), (150, 2)]
    ref, ref_cache, out, cache, meta = _run_both(device, torch.float32, seqs, SHAPES["odd"])
    assert len(meta.prefill.groups) > 1
    assert torch.equal(cache, ref_cache)
    assert_close_rel(out, ref, TOL[torch.float32])


def test_plan_layout():
    """Host plan: prefill sequences only, whole blocks each, key offsets, one tile per BLOCK_M query rows
    (those that see the most keys first), groups bounded by max(step tokens, longest context)."""
    m = MLA_PREFILL_BLOCK_M
    q_lens, s_lens = [1, 2 * m + 1, 3, 1], [50, 2 * m + 1, 3, 9]
    layout = plan_prefill(q_lens, s_lens, 16)
    (block_seq, block_idx, tile_seq, tile_m0), = layout.groups
    nb1 = -(-(2 * m + 1) // 16)
    assert block_seq == [1] * nb1 + [2] and block_idx == list(range(nb1)) + [0]
    assert layout.key_start == [0, 0, nb1 * 16, 0]
    assert tile_m0 == [2 * m, m, 0, 0] and tile_seq == [1, 1, 1, 2]
    # 7 step tokens, longest context 300: the two 150-token contexts share a group, the 300-token one is alone.
    layout = plan_prefill([2, 2, 3], [150, 150, 300], 16)
    assert [sorted(set(g[0])) for g in layout.groups] == [[0, 1], [2]] and layout.key_start == [0, 160, 0]
    # A 2-token chunk over a 10-token prefix sees more keys than a fresh 60-token prompt's tile: it goes first.
    layout = plan_prefill([60, 2, 80], [60, 12, 80], 16)
    assert [g[2] for g in layout.groups] == [[1, 0], [2, 2]]


def test_reference_metadata_on_mixed_step_uses_reference(device):
    """Another builder's metadata (the reference's) on a mixed step: the reference runs, bit for bit."""
    seqs = MIXED[:4]
    batch = make_batch(seqs, 16, 40, device)
    q_nope, q_pe, latent, k_pe, weights = _inputs(device, torch.float32, batch.num_tokens, *SHAPES["odd"])
    cache = torch.randn(40, 16, 40 + 6, device=device)
    batch.attn_metadata = TorchPagedAttention().build_metadata(batch)
    ref_cache, own_cache = cache.clone(), cache.clone()
    ref = TorchMLA().forward(q_nope, q_pe, latent, k_pe, ref_cache, weights, batch, 0.2)
    out = TritonMLA().forward(q_nope, q_pe, latent, k_pe, own_cache, weights, batch, 0.2)
    assert torch.equal(own_cache, ref_cache) and torch.equal(out, ref)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_mixed_step_over_fp8_cache_matches_torch_mla(device, cache_dtype):
    """kv_cache_dtype fp8 on MLA: the step's latents are written as the reference rounds them, the prefill rows'
    gathered latents and the decode rows' tiles widen before their products."""
    from deepserve.kernels import INTERPRET
    if INTERPRET:
        pytest.skip("Triton's interpreter drops the carry of a rounding into the next fp8 exponent: GPU only")
    dtype = torch.bfloat16
    ref, ref_cache, out, cache, meta = _run_both(device, dtype, MIXED, SHAPES["V2"], cache_dtype=cache_dtype)
    assert cache.dtype == cache_dtype and meta.decode_rows is not None
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))
    assert_close_rel(out, ref, TOL[dtype])

