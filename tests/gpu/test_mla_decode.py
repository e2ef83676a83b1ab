"""MLA decode kernel (latent space, paged latent cache, split-K) and the TritonMLA backend against the reference
(deepserve/layers/mla.py); the backend switch on a whole tiny DeepSeek model."""

import math

import pytest
import torch

from deepserve.kernels import INTERPRET
from deepserve.layers.mla_triton import TritonMLA, TritonMLAMetadata
from deepserve.kernels.mla_decode import (MLA_BLOCK_N, REDUCE_CHUNK_S, mla_decode, mla_decode_ref, mla_num_splits,
                                          mla_reduce, mla_reduce_ref, write_latents, write_latents_ref)
from deepserve.kernels.paged_attention import active_splits_ref
from deepserve.layers.moe_triton import TritonMoE, select_moe_and_mla_backends
from deepserve.layers.attention import TorchPagedAttention
from deepserve.layers.mla import MLAWeights, TorchMLA
from kernel_testing import assert_close_rel, make_batch, poison_unused_splits, skip_bf16_in_interpreter
from test_fused_moe import _interpreter_scalars  # noqa: F401  (autouse fixture)

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Kernel vs float32 reference on the same inputs: relative Frobenius error and max abs error (|q|, |c| ~ 1).
KERNEL_TOL = {torch.float32: (1e-5, 1e-4), torch.float16: (3e-3, 1e-2), torch.bfloat16: (1.5e-2, 6e-2)}
# Backend: also the absorbed query and the W_UV product, in the dtype (the reference does them in float32).
BACKEND_TOL = {torch.float32: (1e-5, 1e-4), torch.float16: (5e-3, 2e-2), torch.bfloat16: (3e-2, 1e-1)}

# (heads, kv_lora_rank, rope dims): DeepSeek-V2/V3's 512 + 64 with V2-Lite's 16 heads, then small shapes
# with a head count that leaves a partial head tile and a rank that is not a power of two.
SHAPES = [(16, 512, 64), (20, 64, 16), (3, 48, 8)]
LENS = [1, 15, 16, 17, 33, 100, 300]


def _cdiv_total(lens, bs):
    return sum(-(-n // bs) for n in lens)


def _decode_case(device, dtype, heads, rank, rope, lens, block_size):
    num_blocks = _cdiv_total(lens, block_size) + 8
    batch = make_batch([(n - 1, 1) for n in lens], block_size, num_blocks, device)
    cache = torch.randn(num_blocks, block_size, rank + rope, device=device).to(dtype)
    q_lat = torch.randn(len(lens), heads, rank, device=device).to(dtype)
    q_pe = torch.randn(len(lens), heads, rope, device=device).to(dtype)
    return batch, cache, q_lat, q_pe


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "H{}-R{}-P{}".format(*s))
def test_decode_matches_reference(device, dtype, shape):
    """Contexts inside one block, on block edges and across many; the heuristic split and forced ones."""
    skip_bf16_in_interpreter(dtype)
    heads, rank, rope = shape
    batch, cache, q_lat, q_pe = _decode_case(device, dtype, heads, rank, rope, LENS, 16)
    scale = 1 / math.sqrt(rank + rope)
    ref = mla_decode_ref(q_lat, q_pe, cache, batch.block_tables, batch.seq_lens, scale)
    for splits in (None, 1, 3, 7):
        out = mla_decode(q_lat, q_pe, cache, batch.block_tables, batch.seq_lens, scale, max_seq_len=max(LENS),
                         num_splits=splits)
        assert_close_rel(out, ref, KERNEL_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_n,warps,stages", [(64, 4, 2), (32, 4, 3), (16, 4, 2)])
def test_decode_tiles_one_split(device, dtype, block_n, warps, stages):
    """One split (batch 256's launch) at tilings the tuning benchmark times (mla_decode_ab.py), V2-Lite's shape,
    contexts shorter and longer than a tile."""
    skip_bf16_in_interpreter(dtype)
    if torch.device(device).type == "cuda" and dtype == torch.float32 and block_n == 64:
        pytest.skip("two 64-row float32 stages exceed the shared memory")
    lens = [1, 40, 64, 65, 130]
    batch, cache, q_lat, q_pe = _decode_case(device, dtype, 16, 512, 64, lens, 16)
    scale = 1 / math.sqrt(576)
    ref = mla_decode_ref(q_lat, q_pe, cache, batch.block_tables, batch.seq_lens, scale)
    out = mla_decode(q_lat, q_pe, cache, batch.block_tables, batch.seq_lens, scale, max_seq_len=max(lens),
                     num_splits=1, block_n=block_n, num_warps=warps, num_stages=stages)
    assert_close_rel(out, ref, KERNEL_TOL[dtype])


@pytest.mark.parametrize("block_size", [1, 8, 64])
def test_decode_other_block_sizes(device, block_size):
    lens = [3, 31, 64, 65, 250]
    batch, cache, q_lat, q_pe = _decode_case(device, torch.float32, 16, 64, 16, lens, block_size)
    ref = mla_decode_ref(q_lat, q_pe, cache, batch.block_tables, batch.seq_lens, 0.1)
    for splits in (1, 4):
        out = mla_decode(q_lat, q_pe, cache, batch.block_tables, batch.seq_lens, 0.1, num_splits=splits)
        assert_close_rel(out, ref, KERNEL_TOL[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_long_context_uses_split_k(device, dtype):
    """Few sequences with long contexts (DeepSeek's 512 + 64): the heuristic splits, the reduce merges, and
    split boundaries fall inside blocks (partitions are multiples of 32 tokens, blocks of 48)."""
    skip_bf16_in_interpreter(dtype)
    lens = [5000, 1, 2049] if not INTERPRET else [1500, 1, 700]
    heads, rank, rope = 16, 512, 64
    assert mla_num_splits(len(lens), heads, max(lens), torch.device(device)) > 1
    batch, cache, q_lat, q_pe = _decode_case(device, dtype, heads, rank, rope, lens, 48)
    # Sharper than 1/sqrt(d) so long contexts are not a near-uniform average.
    scale = 4 / math.sqrt(rank + rope)
    ref = mla_decode_ref(q_lat, q_pe, cache, batch.block_tables, batch.seq_lens, scale)
    out = mla_decode(q_lat, q_pe, cache, batch.block_tables, batch.seq_lens, scale)
    assert_close_rel(out, ref, KERNEL_TOL[dtype])


@pytest.mark.parametrize("num_splits", [2, 37, 128])
@pytest.mark.parametrize("chunk_s", [4, REDUCE_CHUNK_S])
def test_reduce_reads_only_active_splits(device, num_splits, chunk_s):
    """The reduce over a CUDA graph's grid (up to 128 splits sized for a long context) at short and long contexts:
    a float32 merge of the same partials into a heads-major output view; the splits a sequence does not use hold NaN
    and are never read; a sequence within one split gets that split's latents bit for bit (weight exactly 1)."""
    lens = [1, 31, 32, 33, 193, 1000, 4096]
    bsz, heads, rank = len(lens), 3, 48
    seq_lens = torch.tensor(lens, device=device)
    used = active_splits_ref(seq_lens, num_splits, MLA_BLOCK_N)
    part_out, part_lse = poison_unused_splits(torch.randn(bsz, heads, num_splits, rank, device=device),
                                              4 * torch.randn(bsz, heads, num_splits, device=device), used)
    out = torch.full((heads, bsz, rank), float("nan"), device=device).transpose(0, 1)
    mla_reduce(part_out, part_lse, seq_lens, out, chunk_s=chunk_s)
    ref = mla_reduce_ref(part_out, part_lse, seq_lens, torch.empty(bsz, heads, rank, device=device))
    assert_close_rel(out, ref, (1e-6, 1e-5))
    single = used == 1
    assert single.any() and torch.equal(out[single], part_out[single, :, 0])


@pytest.mark.parametrize("inputs_ready", [False, True])
@pytest.mark.parametrize("num_splits", [None, 128])
def test_decode_graph_grid_short_contexts(device, num_splits, inputs_ready):
    """A launch sized as a CUDA graph's (max_seq_len far above every context): most splits are empty, their programs
    exit without storing, and the reduce merges only the used ones. inputs_ready: lengths and block ids read before
    the PDL wait, as the backend launches it."""
    lens = [1, 17, 32, 33, 193]
    batch, cache, q_lat, q_pe = _decode_case(device, torch.float32, 16, 64, 16, lens, 16)
    ref = mla_decode_ref(q_lat, q_pe, cache, batch.block_tables, batch.seq_lens, 0.1)
    out = mla_decode(q_lat, q_pe, cache, batch.block_tables, batch.seq_lens, 0.1, max_seq_len=4096,
                     num_splits=num_splits, inputs_ready=inputs_ready)
    assert_close_rel(out, ref, KERNEL_TOL[torch.float32])


def test_decode_strided_inputs_and_output(device):
    """q_lat as the backend makes it (a transposed bmm output) and a heads-major output view."""
    lens = [40, 7, 300]
    heads, rank, rope = 4, 64, 16
    batch, cache, _, q_pe = _decode_case(device, torch.float32, heads, rank, rope, lens, 16)
    q_lat = torch.randn(heads, len(lens), rank, device=device).transpose(0, 1)
    out = torch.full((heads, len(lens), rank), float("nan"), device=device)
    mla_decode(q_lat, q_pe, cache, batch.block_tables, batch.seq_lens, 0.2, out=out.transpose(0, 1))
    ref = mla_decode_ref(q_lat, q_pe, cache, batch.block_tables, batch.seq_lens, 0.2)
    assert_close_rel(out.transpose(0, 1), ref, KERNEL_TOL[torch.float32])


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("shape", SHAPES[:2], ids=lambda s: "H{}-R{}-P{}".format(*s))
def test_decode_over_fp8_cache_matches_reference(device, cache_dtype, shape):
    """kv_cache_dtype fp8: the latent chunks and k_pe widen to q's dtype as they load; the reference reads the
    same codes."""
    dtype = torch.float16 if INTERPRET else torch.bfloat16
    heads, rank, rope = shape
    batch, cache, q_lat, q_pe = _decode_case(device, dtype, heads, rank, rope, LENS, 16)
    cache = cache.to(cache_dtype)
    scale = 1 / math.sqrt(rank + rope)
    ref = mla_decode_ref(q_lat, q_pe, cache, batch.block_tables, batch.seq_lens, scale)
    for splits in (1, 3):
        out = mla_decode(q_lat, q_pe, cache, batch.block_tables, batch.seq_lens, scale, max_seq_len=max(LENS),
                         num_splits=splits)
        assert_close_rel(out, ref, KERNEL_TOL[dtype])


@pytest.mark.parametrize("tiles", [(16, 4, 3, None), (16, 4, 2, None), (32, 8, 3, None), (64, 8, 2, None),
                                   (32, 4, 2, 168), (16, 4, 3, 128)], ids=lambda t: "x".join(map(str, t[:3])) +
                         (f"r{t[3]}" if t[3] else ""))
def test_forced_tiles_over_fp8_cache_with_splits(device, tiles, monkeypatch):
    """DEEPSERVE_MLA_DECODE_TILES' tiles (kernel_resources.py's candidates) in split launches: the partitions and
    the reduce follow the forced tile width."""
    import deepserve.kernels.mla_decode as mla
    monkeypatch.setattr(mla, "FORCED_TILES", tiles)
    dtype = torch.float16 if INTERPRET else torch.bfloat16
    lens = [1, 17, 64, 100, 300]
    batch, cache, q_lat, q_pe = _decode_case(device, dtype, 16, 512, 64, lens, 16)
    cache = cache.to(torch.float8_e4m3fn)
    ref = mla_decode_ref(q_lat, q_pe, cache, batch.block_tables, batch.seq_lens, 1 / math.sqrt(576))
    for splits in (1, 3):
        out = mla_decode(q_lat, q_pe, cache, batch.block_tables, batch.seq_lens, 1 / math.sqrt(576),
                         max_seq_len=max(lens), num_splits=splits)
        assert_close_rel(out, ref, KERNEL_TOL[dtype])


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_write_latents_into_fp8(device, cache_dtype):
    """The codes written are the reference's (clamped to the format's largest value, rounded to nearest), bit for
    bit; an outlier saturates."""
    if INTERPRET:
        pytest.skip("Triton's interpreter drops the carry of a rounding into the next fp8 exponent: GPU only")
    nb, bs, t, rank, rope = 12, 16, 9, 512, 64
    cache = torch.zeros(nb, bs, rank + rope, device=device).to(cache_dtype)
    proj = (torch.randn(t, rank + rope, device=device) * 4).to(torch.bfloat16)
    proj[0, :3] = torch.tensor([1000.0, -70000.0, 1e-4])
    latent, k_pe = proj[:, :rank], proj[:, rank:]
    slots = torch.randperm(nb * bs, device=device)[:t]
    ref = cache.clone()
    write_latents_ref(ref, latent, k_pe, slots)
    write_latents(cache, latent, k_pe, slots)
    assert torch.equal(cache.view(torch.uint8), ref.view(torch.uint8))
    assert torch.isfinite(cache.float()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank,rope", [(512, 64), (48, 8)])
def test_write_latents(device, dtype, rank, rope):
    """The cache write equals the reference's (rows as strided views of one projection output) and skips
    negative slots (padding rows of a CUDA-graph batch)."""
    nb, bs, t = 12, 16, 9
    cache = torch.randn(nb, bs, rank + rope, device=device).to(dtype)
    proj = torch.randn(t, rank + rope + 5, device=device).to(dtype)
    latent, k_pe = proj[:, :rank], proj[:, rank:rank + rope]
    slots = torch.randperm(nb * bs, device=device)[:t]
    ref = cache.clone()
    write_latents_ref(ref, latent, k_pe, slots)
    write_latents(cache, latent, k_pe, slots)
    assert torch.equal(cache, ref)
    slots[[2, 5]] = -1
    before = cache.clone()
    write_latents(cache, latent * 2, k_pe * 2, slots)
    expected = before.clone()
    keep = slots >= 0
    write_latents_ref(expected, latent[keep] * 2, k_pe[keep] * 2, slots[keep])
    assert torch.equal(cache, expected)


# --- backend --------------------------------------------------------------------------------------

def _mla_inputs(device, dtype, t, heads=4, nope=16, rope=8, v_dim=16, rank=32):
    """Per-head weights as views of one kv_b_proj matrix (the strides the model passes)."""
    kv_b = torch.randn(heads * (nope + v_dim), rank, device=device) / rank ** 0.5
    w_uk, w_uv = kv_b.to(dtype).view(heads, nope + v_dim, rank).split([nope, v_dim], dim=1)
    tensors = [torch.randn(*s, device=device).to(dtype)
               for s in ((t, heads, nope), (t, heads, rope), (t, rank), (t, rope))]
    return (*tensors, MLAWeights(w_uk, w_uv))


def _both_backends(device, dtype, seqs, num_blocks=64, block_size=16, own_metadata=True, rotary=None, **dims):
    """(output, cache) of TorchMLA and of TritonMLA on one step; TritonMLA with its own metadata builder or
    with the reference's; with `rotary`, both rotate q_pe and k_pe themselves."""
    batch = make_batch(seqs, block_size, num_blocks, device)
    q_nope, q_pe, latent, k_pe, weights = _mla_inputs(device, dtype, batch.num_tokens, **dims)
    rank, rope = latent.shape[-1], k_pe.shape[-1]
    cache = torch.randn(num_blocks, block_size, rank + rope, device=device).to(dtype)
    results = []
    for backend, builder in ((TorchMLA(), TorchPagedAttention()),
                             (TritonMLA(), TritonMLA() if own_metadata else TorchPagedAttention())):
        batch.attn_metadata = builder.build_metadata(batch)
        c = cache.clone()
        results.append((backend.forward(q_nope, q_pe, latent, k_pe, c, weights, batch, 0.15, rotary=rotary), c))
    return results


@pytest.mark.parametrize("own_metadata", [True, False], ids=["triton_meta", "torch_meta"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backend_decode_matches_torch_mla(device, dtype, own_metadata):
    """A decode-only step: same cache writes, outputs within the half-precision tolerance, contiguous."""
    skip_bf16_in_interpreter(dtype)
    seqs = [(n - 1, 1) for n in (1, 16, 17, 90, 200)]
    (ref, ref_cache), (out, out_cache) = _both_backends(device, dtype, seqs, own_metadata=own_metadata)
    assert torch.equal(out_cache, ref_cache)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert out.is_contiguous()          # the layer's reshape for o_proj is a view, not a copy per layer
    assert_close_rel(out, ref, BACKEND_TOL[dtype])


@pytest.mark.parametrize("own_metadata", [True, False], ids=["triton_meta", "torch_meta"])
def test_backend_mixed_step(device, own_metadata):
    """Steps with prefill rows: with TritonMLA's own metadata they run its batched prefill path (equal to the
    reference within the fp32 tolerance); with the reference's metadata they go through the reference bit for bit.
    The cache writes are exact either way."""
    seqs = [(0, 23), (40, 1), (7, 1), (30, 12)]
    (ref, ref_cache), (out, out_cache) = _both_backends(device, torch.float32, seqs, own_metadata=own_metadata)
    assert torch.equal(out_cache, ref_cache)
    if own_metadata:
        assert_close_rel(out, ref, BACKEND_TOL[torch.float32])
    else:
        assert torch.equal(out, ref)


@pytest.mark.parametrize("seqs", [[(n - 1, 1) for n in (1, 17, 90, 200)], [(0, 23), (40, 1), (7, 1), (30, 12)]],
                         ids=["decode", "mixed"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "neox"])
def test_backend_with_rotary_matches_torch_mla(device, seqs, interleaved):
    """The layer's rotary embedding handed to the backend: the reference rotates then writes, TritonMLA does both in
    one kernel. Same latents in the cache, rotated keys within the rotation's tolerance, outputs within the
    backend tolerance (decode-only and mixed steps)."""
    from deepserve.layers.mla import MLARotaryEmbedding
    rotary = MLARotaryEmbedding(8, 512, {"rope_type": "default", "rope_theta": 10000.0}, 512, interleaved).to(device)
    (ref, ref_cache), (out, out_cache) = _both_backends(device, torch.float32, seqs, rotary=rotary)
    assert torch.equal(out_cache[..., :32], ref_cache[..., :32])
    assert_close_rel(out_cache[..., 32:], ref_cache[..., 32:], (1e-6, 1e-5))
    assert_close_rel(out, ref, BACKEND_TOL[torch.float32])


def _padded_decode(device, lens, pad, num_blocks=40, block_size=16):
    """A decode batch and the same batch padded as the CUDA-graph runner pads: slot -1, length 1, block 0."""
    batch = make_batch([(n - 1, 1) for n in lens], block_size, num_blocks, device)
    padded = make_batch([(n - 1, 1) for n in lens] + [(0, 1)] * pad, block_size, num_blocks, device)
    b = len(lens)
    for name in ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens"):
        full = getattr(padded, name)
        full[:b] = getattr(batch, name)[:, :full.shape[1]] if full.dim() == 2 else getattr(batch, name)
    padded.block_tables[b:] = 0
    padded.slot_mapping[b:] = -1
    padded.seq_lens[b:] = 1
    padded.query_lens_cpu, padded.seq_lens_cpu = [1] * (b + pad), [1] * (b + pad)   # placeholders, as in graphs
    return batch, padded


def test_backend_graph_metadata_with_padding_rows(device):
    """The decode path as a CUDA graph runs it: graph metadata sized for a long maximum context (split-K
    with empty splits), padding rows that read block 0 and write nothing, placeholder host lengths."""
    lens = [5, 40, 170]
    batch, padded = _padded_decode(device, lens, pad=3)
    q_nope, q_pe, latent, k_pe, weights = _mla_inputs(device, torch.float32, padded.num_tokens)
    cache = torch.randn(40, 16, 32 + 8, device=device)
    batch.attn_metadata = TorchPagedAttention().build_metadata(batch)
    ref_cache = cache.clone()
    b = len(lens)
    ref = TorchMLA().forward(q_nope[:b], q_pe[:b], latent[:b], k_pe[:b], ref_cache, weights, batch, 0.15)
    backend = TritonMLA()
    padded.attn_metadata = backend.build_graph_metadata(padded, max_seq_len=2048)
    assert isinstance(padded.attn_metadata, TritonMLAMetadata)
    out = backend.forward(q_nope, q_pe, latent, k_pe, cache, weights, padded, 0.15)
    assert torch.equal(cache, ref_cache)
    assert_close_rel(out[:b], ref, BACKEND_TOL[torch.float32])
    assert torch.isfinite(out[b:]).all()


def _tiny_deepseek(device):
    from deepserve.models.deepseek_v2 import DeepseekV2ForCausalLM

    cfg = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
               max_position_embeddings=256, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
               num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=32,
               qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, q_lora_rank=None, rms_norm_eps=1e-6,
               topk_method="greedy", routed_scaling_factor=1.5, rope_theta=10000.0)
    model = DeepseekV2ForCausalLM(cfg, max_position=256)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.15)
    return model.to(device).eval()


def test_select_backends_on_tiny_deepseek(device):
    """The runner's switch puts TritonMoE / TritonMLA into every MoE / MLA layer (only for CUDA), and a
    prefill + decode through the whole model then matches the reference backends."""
    model = _tiny_deepseek(device)
    select_moe_and_mla_backends(model, "cpu")
    assert all(isinstance(layer.backend, TorchMLA) for layer in model.attention_layers())
    bs, nb = 16, 16
    prompt = [(0, 20), (0, 5)]
    caches = [torch.zeros(layer.kv_cache_shape(nb, bs), device=device) for layer in model.attention_layers()]

    def run(seed_batch):
        for layer, cache in zip(model.attention_layers(), caches):
            layer.kv_cache = cache.clone()
        logits = []
        for seqs in (prompt, [(20, 1), (5, 1)]):          # the same blocks in both steps (seeded tables)
            torch.manual_seed(seed_batch)
            batch = make_batch(seqs, bs, nb, device)
            batch.input_ids = torch.randint(0, 128, (batch.num_tokens,), generator=torch.Generator().manual_seed(1)
                                            ).to(device)
            batch.logits_indices = torch.arange(batch.num_tokens, device=device)
            batch.attn_metadata = TorchPagedAttention().build_metadata(batch)
            with torch.inference_mode():
                logits.append(model.compute_logits(model(batch)))
        return logits

    ref = run(3)
    # The switch only looks at the device's type; under the interpreter the "CUDA" model lives on the CPU.
    select_moe_and_mla_backends(model, "cuda")
    assert all(isinstance(layer.backend, TritonMLA) for layer in model.attention_layers())
    assert len(model.moe_layers()) == 1 and all(isinstance(m.backend, TritonMoE) for m in model.moe_layers())
    # ... and stacks each layer's q and kv_a weights into one tensor, which the 25-row prefill reads in one GEMM.
    for layer in model.layers:
        stacked = layer.self_attn.input_projections
        assert stacked is not None and layer.self_attn.kv_a_proj_with_mqa.weight.data_ptr() == \
            stacked[layer.self_attn.q_proj.weight.shape[0]:].data_ptr()
    out = run(3)
    for o, r in zip(out, ref):
        assert_close_rel(o, r, (1e-4, 1e-3))


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs need a GPU")
def test_backend_decode_in_cuda_graph(device):
    """TritonMLA's decode captured once in a CUDA graph (graph metadata, padded batch) and replayed on new
    contexts, block tables and queries written into the same tensors: matches the reference each time."""
    dtype, b, pad = torch.bfloat16, 3, 2
    _, static = _padded_decode(device, [300, 5, 40], pad, num_blocks=64)
    q_nope, q_pe, latent, k_pe, weights = _mla_inputs(device, dtype, b + pad)
    cache = torch.randn(64, 16, 32 + 8, device=device).to(dtype)
    backend = TritonMLA()
    static.attn_metadata = backend.build_graph_metadata(static, max_seq_len=1024)

    def step():
        return backend.forward(q_nope, q_pe, latent, k_pe, cache, weights, static, 0.15)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()                               # compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for lens in ([170, 1, 17], [33, 299, 2]):
        batch, padded = _padded_decode(device, lens, pad, num_blocks=64)
        for name in ("input_ids", "positions", "slot_mapping", "seq_lens"):
            getattr(static, name).copy_(getattr(padded, name))
        static.block_tables.zero_()
        static.block_tables[:, :padded.block_tables.shape[1]] = padded.block_tables
        for t in (q_nope, q_pe, latent, k_pe):
            t.copy_(torch.randn_like(t, dtype=torch.float32))
        ref_cache = cache.clone()
        batch.attn_metadata = TorchPagedAttention().build_metadata(batch)
        ref = TorchMLA().forward(q_nope[:b], q_pe[:b], latent[:b], k_pe[:b], ref_cache, weights, batch, 0.15)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(cache, ref_cache)
        assert_close_rel(out[:b], ref, BACKEND_TOL[dtype])
