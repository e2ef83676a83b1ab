"""Paged attention kernels (KV write, alone or fused with the rotary embedding; decode with split-K and its reduce)
and the TritonPagedAttention backend (with the prefill kernel of test_paged_prefill.py) against the PyTorch
reference backend."""

import itertools
import math
from dataclasses import replace

import pytest
import torch

from deepserve.kernels import INTERPRET
from deepserve.layers.attention_triton import TritonPagedAttention
from deepserve.kernels import num_sms
from deepserve.kernels.decode_launch import (DECODE_BLOCK_N, DEEP_PIPELINE_TILES, HEADS_FIRST, DecodeTiles,
                                            decode_num_splits, decode_tiles)
from deepserve.kernels.paged_attention import (active_splits_ref, decode_attention, decode_attention_ref, decode_reduce,
                                               decode_reduce_ref)
from deepserve.kernels.kv_write import rotary_write_kv, rotary_write_kv_ref, write_kv, write_kv_ref
from deepserve.kernels import l2_prefetch
from deepserve.kernels.l2_prefetch import (L2_PREFETCH_MAX_ROWS, L2_PREFETCH_PIECE, L2_PREFETCH_PIECES,
                                          l2_prefetch_plan)
from deepserve.kernels.rotary import apply_rotary
from deepserve.layers.attention import TorchPagedAttention
from deepserve.layers.forward_batch import ForwardBatch
from deepserve.layers.rotary import RotaryEmbedding
from kernel_testing import (DTYPES, assert_attention_close, assert_close_rel, assert_within_ulps, make_batch,
                            poison_unused_splits, random_cache, rotation_pair_norms, skip_bf16_in_interpreter)

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


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def _rotary_case(device, dtype, heads, kv_heads, head_dim, t, num_blocks, bs):
    """q, k, v as strided views of one projection output, distinct slots with two padding rows (slot -1), random
    positions with the cache's first and last."""
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, device=device).to(dtype)
    q = qkv[:, :heads * head_dim].view(t, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(t, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(t, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * bs, device=device)[:t]
    slots[[1, t - 2]] = -1
    positions = torch.randint(0, 4096, (t,), device=device)
    positions[0], positions[-1] = 0, 4095
    return q, k, v, slots, positions


@pytest.mark.parametrize("dtype", DTYPES + [torch.float32])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 64), (7, 1, 128), (6, 3, 96)])
@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING], ids=["default", "llama3"])
@pytest.mark.parametrize("half_cache", [False, True], ids=["full_cache", "half_cache"])
@pytest.mark.parametrize("inputs_ready", [False, True], ids=["after_wait", "before_wait"])
def test_rotary_write_kv_matches_reference(device, dtype, heads, kv_heads, head_dim, scaling, half_cache,
                                          inputs_ready):
    """One launch = the rotary kernel then the cache write, bit for bit (the same rotation code); = the PyTorch
    rotation then the reference write within one rounding; padding rows (slot -1) write nothing. Positions and slots
    read after the PDL wait or before it (inputs_ready, as the backend launches it)."""
    skip_bf16_in_interpreter(dtype)
    nb, bs, t = 12, 16, 19
    rope = RotaryEmbedding(head_dim, 4096, 500000.0, scaling).to(device)
    cos, sin = rope.cos_cache, rope.sin_cache
    if half_cache:     # MLARotaryEmbedding's layout: one column per angle (RotaryEmbedding's halves are equal)
        cos, sin = cos[:, :head_dim // 2].contiguous(), sin[:, :head_dim // 2].contiguous()
    q, k, v, slots, positions = _rotary_case(device, dtype, heads, kv_heads, head_dim, t, nb, bs)
    cache = random_cache(nb, bs, kv_heads, head_dim, dtype, device)
    fused = cache.clone()
    q_rot = rotary_write_kv(fused, q, k, v, slots, positions, cos, sin, inputs_ready=inputs_ready)
    assert q_rot.shape == q.shape and q_rot.is_contiguous()

    two_launches = cache.clone()
    kernel_q, kernel_k = apply_rotary(positions, q, k, cos, sin)
    write_kv(two_launches, kernel_k, v, slots)
    assert torch.equal(q_rot, kernel_q) and torch.equal(fused, two_launches)

    ref = cache.clone()
    ref_q = rotary_write_kv_ref(ref, q, k, v, slots, positions, rope.cos_cache, rope.sin_cache)
    # x1*cos - x2*sin may be contracted into one fused multiply-add (see test_elementwise_kernels.py).
    atol = 2.0 ** -21 * max(q.float().abs().max().item(), k.float().abs().max().item())
    # float32 outputs keep the contraction's last-bit difference (measured on an H200: 81% bit-identical); bf16 and
    # fp16 round it away almost always.
    min_exact = 0.5 if dtype == torch.float32 else 0.98
    assert_within_ulps(q_rot, ref_q, dtype, ulps=1, min_exact=min_exact, atol=atol)
    assert_within_ulps(fused[0], ref[0], dtype, ulps=1, min_exact=min_exact, atol=atol)
    assert torch.equal(fused[1], ref[1])
    written = torch.zeros(nb * bs, dtype=torch.bool, device=device)
    written[slots[slots >= 0]] = True
    untouched = cache.view(2, nb * bs, kv_heads, head_dim)[:, ~written]
    assert torch.equal(fused.view(2, nb * bs, kv_heads, head_dim)[:, ~written], untouched)


@pytest.fixture
def l2_prefetch_setting(request, monkeypatch):
    """DEEPSERVE_L2_PREFETCH set to the test's value for its duration (the setting is read once per device)."""
    monkeypatch.setenv("DEEPSERVE_L2_PREFETCH", request.param)
    l2_prefetch._setting.cache_clear()
    yield request.param
    monkeypatch.undo()
    l2_prefetch._setting.cache_clear()


def _assert_prefetch_plan(weight: torch.Tensor, rows: int, like: torch.Tensor, site: str, setting: str) -> None:
    """On Hopper and later the setting's site has prefetch programs for the whole weight (an odd byte count rounded
    down to 16 bytes) with the setting's policy, the other site none; elsewhere no site has any."""
    plan = l2_prefetch_plan(weight, rows, like, site)
    hopper = weight.is_cuda and not INTERPRET and torch.cuda.get_device_capability(weight.device)[0] >= 9
    assert (plan.programs > 0) == hopper
    if hopper:
        assert plan.policy == (2 if setting.endswith("evict_last") else 1)
        assert plan.nbytes == weight.numel() * weight.element_size() // 16 * 16
        assert plan.programs == -(-plan.nbytes // (L2_PREFETCH_PIECE * L2_PREFETCH_PIECES))
    other = "reduce" if site == "rotary" else "rotary"
    assert l2_prefetch_plan(weight, rows, like, other).programs == 0
    # Past L2_PREFETCH_MAX_ROWS rows there is nothing to prefetch for.
    assert l2_prefetch_plan(weight, L2_PREFETCH_MAX_ROWS + 1, like, site).programs == 0


@pytest.mark.parametrize("l2_prefetch_setting", ["rotary", "rotary_evict_last"], indirect=True)
@pytest.mark.parametrize("weight_shape", [(2048, 2048), (1000, 3)])
def test_rotary_write_kv_l2_prefetch_changes_nothing(device, weight_shape, l2_prefetch_setting):
    """The rotary kernel's prefetch programs (kernels/l2_prefetch.py) ask L2 for o_proj's weight and nothing
    else: q_rot, the cache and the weight are bitwise those of the launch without them."""
    dtype = torch.bfloat16 if not INTERPRET else torch.float16
    nb, bs, t, heads, kv_heads, head_dim = 12, 16, 8, 32, 8, 64
    rope = RotaryEmbedding(head_dim, 4096, 500000.0).to(device)
    q, k, v, slots, positions = _rotary_case(device, dtype, heads, kv_heads, head_dim, t, nb, bs)
    weight = torch.randn(weight_shape, device=device).to(dtype)
    weight_before = weight.clone()
    _assert_prefetch_plan(weight, t, q, "rotary", l2_prefetch_setting)
    cache = random_cache(nb, bs, kv_heads, head_dim, dtype, device)
    plain, prefetching = cache.clone(), cache.clone()
    q_plain = rotary_write_kv(plain, q, k, v, slots, positions, rope.cos_cache, rope.sin_cache, inputs_ready=True)
    q_pref = rotary_write_kv(prefetching, q, k, v, slots, positions, rope.cos_cache, rope.sin_cache,
                             inputs_ready=True, l2_prefetch=weight)
    assert torch.equal(q_pref, q_plain) and torch.equal(prefetching, plain) and torch.equal(weight, weight_before)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float32])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 4, 128), (6, 3, 96)])
def test_rotary_write_kv_with_qk_norm_matches_reference(device, dtype, heads, kv_heads, head_dim):
    """Qwen3's per-head q/k RMSNorm folded into the rotate-and-write launch = the reference norms, rotation and write
    (within two roundings, in half precision mostly bit-identical); padding rows write nothing; the weights matter."""
    skip_bf16_in_interpreter(dtype)
    nb, bs, t = 12, 16, 19
    rope = RotaryEmbedding(head_dim, 4096, 1000000.0).to(device)
    q, k, v, slots, positions = _rotary_case(device, dtype, heads, kv_heads, head_dim, t, nb, bs)
    q, k = q * 3, k * 0.5          # norms that are far from 1
    q_w = (torch.rand(head_dim, device=device) + 0.5).to(dtype)
    k_w = (torch.rand(head_dim, device=device) + 0.5).to(dtype)
    cache = random_cache(nb, bs, kv_heads, head_dim, dtype, device)
    fused, ref = cache.clone(), cache.clone()
    q_rot = rotary_write_kv(fused, q, k, v, slots, positions, rope.cos_cache, rope.sin_cache, inputs_ready=True,
                            qk_norm=(q_w, k_w, 1e-6))
    ref_q = rotary_write_kv_ref(ref, q, k, v, slots, positions, rope.cos_cache, rope.sin_cache,
                                qk_norm=(q_w, k_w, 1e-6))
    # Norm statistics summed in another order and the rotation's fused multiply-add: a rounding or two apart. In
    # float32 a head whose rstd differs in its last bit differs everywhere, so only the bound is checked there.
    atol = 2.0 ** -20 * max(ref_q.float().abs().max().item(), ref[0].float().abs().max().item())
    min_exact = 0.0 if dtype == torch.float32 else 0.95
    assert_within_ulps(q_rot, ref_q, dtype, ulps=2, min_exact=min_exact, atol=atol, scale=rotation_pair_norms(ref_q))
    assert_within_ulps(fused[0], ref[0], dtype, ulps=2, min_exact=min_exact, atol=atol,
                       scale=rotation_pair_norms(ref[0]))
    assert torch.equal(fused[1], ref[1])
    unnormed = cache.clone()
    plain_q = rotary_write_kv(unnormed, q, k, v, slots, positions, rope.cos_cache, rope.sin_cache)
    assert not torch.allclose(plain_q.float(), q_rot.float(), atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k_eps", [1e-6, 1e-5], ids=["fused", "unfused"])
def test_triton_backend_qk_norm_matches_torch_backend(device, dtype, k_eps):
    """The backend path Qwen3 takes: TritonPagedAttention.forward with qk_norm = TorchPagedAttention.forward (the norm
    modules, then rotation and write), decode rows and a prefill together. Norms with two eps values cannot share
    the fused launch: the backend runs them apart first, with the same result."""
    from deepserve.layers.norm import RMSNorm
    skip_bf16_in_interpreter(dtype)
    heads, kv_heads, head_dim, bs, nb = 8, 2, 64, 16, 32
    batch = make_batch([(30, 1), (0, 9), (17, 1)], bs, nb, device)
    t = int(batch.input_ids.shape[0])
    rope = RotaryEmbedding(head_dim, 4096, 10000.0).to(device)
    qkv = (3 * torch.randn(t, (heads + 2 * kv_heads) * head_dim, device=device)).to(dtype)
    q = qkv[:, :heads * head_dim].view(t, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(t, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(t, kv_heads, head_dim)
    norms = (RMSNorm(head_dim, 1e-6).to(device, dtype), RMSNorm(head_dim, k_eps).to(device, dtype))
    for n in norms:
        torch.nn.init.uniform_(n.weight, 0.5, 1.5)
    cache = random_cache(nb, bs, kv_heads, head_dim, dtype, device)
    ref_cache = cache.clone()
    torch_backend, triton_backend = TorchPagedAttention(), TritonPagedAttention()
    batch.attn_metadata = torch_backend.build_metadata(batch)
    want = torch_backend.forward(q, k, v, ref_cache, batch, head_dim ** -0.5, rotary=rope, qk_norm=norms)
    batch.attn_metadata = triton_backend.build_metadata(batch)
    got = triton_backend.forward(q, k, v, cache, batch, head_dim ** -0.5, rotary=rope, qk_norm=norms)
    assert_attention_close(got, want, dtype)
    atol = 2.0 ** -20 * ref_cache[0].float().abs().max().item()
    assert_within_ulps(cache[0], ref_cache[0], dtype, ulps=2, min_exact=0.95, atol=atol,
                       scale=rotation_pair_norms(ref_cache[0]))
    assert torch.equal(cache[1], ref_cache[1])


def test_rotary_write_kv_no_tokens(device):
    rope = RotaryEmbedding(64, 128, 10000.0).to(device)
    cache = random_cache(2, 16, 2, 64, torch.float16, device)
    before = cache.clone()
    empty = torch.zeros(0, 2, 64, device=device).half()
    none = torch.zeros(0, dtype=torch.int64, device=device)
    q_rot = rotary_write_kv(cache, torch.zeros(0, 4, 64, device=device).half(), empty, empty, none, none,
                            rope.cos_cache, rope.sin_cache)
    assert q_rot.shape == (0, 4, 64) and torch.equal(cache, before)


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


@pytest.mark.parametrize("tiles", [DecodeTiles(64, 4, 2, True), DecodeTiles(32, 4, 3, True),
                                   DecodeTiles(128, 8, 2, False), DEEP_PIPELINE_TILES,
                                   DecodeTiles(64, 4, 3, False, heads_first=True),
                                   DecodeTiles(64, 4, 2, False, heads_first=True, maxnreg=96)], ids=str)
def test_decode_tile_settings_match_reference(device, tiles):
    """Every launch setting the engine may pick (keys per tile, warps, stages, values loaded with the keys, the
    launch order, a register cap), with and without split-K: the same attention as the reference."""
    dtype = torch.float16
    lens = [1, 33, 64, 129, 700]
    batch, cache, q = _decode_case(device, dtype, 64, 4, lens, 16, cdiv_total(lens, 16) + 8)
    _assert_splits_match_reference(q, cache, batch, max(lens), tiles, dtype)


def _assert_splits_match_reference(q, cache, batch, max_len, tiles, dtype, scale=0.2):
    """The decode kernel under `tiles`, unsplit and in 3 splits, against the reference (every output row written)."""
    ref = decode_attention_ref(q, cache, batch.block_tables, batch.seq_lens, scale)
    for splits in (1, 3):
        out = torch.full_like(q, float("nan"))
        decode_attention(q, cache, batch.block_tables, batch.seq_lens, scale, out=out, max_seq_len=max_len,
                         num_splits=splits, tiles=tiles)
        assert_attention_close(out, ref, dtype)


def spy_decode_launches(monkeypatch) -> list:
    """(KV heads a program, splits) of each paged decode launch from now on, the launches still running."""
    from deepserve.kernels import paged_attention
    launched = []
    real = paged_attention._decode_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launched.append((kw["KV_HEADS"], grid[2]))
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(paged_attention, "_decode_kernel", Spy())
    return launched


@pytest.mark.parametrize("head_dim,group", [(64, 4), (64, 1), (32, 8), (64, 3)])
@pytest.mark.parametrize("tiles", [DecodeTiles(kv_heads=2), DecodeTiles(64, 4, 3, True, heads_first=True, kv_heads=2)],
                         ids=str)
def test_decode_two_kv_heads_a_program_match_reference(device, head_dim, group, tiles):
    """DecodeTiles.kv_heads 2: each program reads two adjacent KV heads' columns in one tile row and keeps each
    query row to its own head's columns: the same attention as the reference, with and without split-K, for groups
    that fill the stacked tile or not (3: rows 0-2 and 3-5 of a 16-row tile; 1: MQA-like pairs)."""
    dtype = torch.float16
    lens = [1, 33, 64, 129, 700]
    num_kv_heads = 4
    seqs = [(n - 1, 1) for n in lens]
    batch = make_batch(seqs, 16, cdiv_total(lens, 16) + 8, device)
    cache = random_cache(cdiv_total(lens, 16) + 8, 16, num_kv_heads, head_dim, dtype, device)
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, device=device).to(dtype)
    _assert_splits_match_reference(q, cache, batch, max(lens), tiles, dtype)


def test_two_kv_heads_a_program_only_where_they_pair(device, monkeypatch):
    """DEEPSERVE_GQA_KV_HEADS_PER_PROGRAM=2 pairs heads of at most 128 bytes a token (64-wide fp16, 128-wide fp8) of
    an even count; wider heads or an odd count keep one a program (the launch asserts a forced pairing of an odd
    count)."""
    from deepserve.kernels import decode_launch
    launched = spy_decode_launches(monkeypatch)
    monkeypatch.setattr(decode_launch, "KV_HEADS_PER_PROGRAM", "2")
    lens = [5, 40]
    for head_dim, kv_heads, cache_dtype, want in ((64, 4, torch.float16, 2), (128, 4, torch.float16, 1),
                                                  (64, 3, torch.float16, 1), (128, 2, torch.float8_e4m3fn, 2)):
        batch = make_batch([(n - 1, 1) for n in lens], 16, 12, device)
        cache = random_cache(12, 16, kv_heads, head_dim, torch.float16, device).to(cache_dtype)
        q = torch.randn(len(lens), kv_heads * 2, head_dim, device=device).half()
        out = decode_attention(q, cache, batch.block_tables, batch.seq_lens, 0.2, max_seq_len=max(lens))
        assert launched[-1][0] == want
        assert_attention_close(out, decode_attention_ref(q, cache, batch.block_tables, batch.seq_lens, 0.2),
                               torch.float16)
    odd = random_cache(12, 16, 3, 64, torch.float16, device)
    with pytest.raises(AssertionError, match="KV heads a program"):
        decode_attention(torch.randn(len(lens), 6, 64, device=device).half(), odd, batch.block_tables,
                         batch.seq_lens, 0.2, tiles=DecodeTiles(kv_heads=2))


def test_auto_pairs_kv_heads_in_one_wave_unsplit_launches_over_16_bit_caches(device, monkeypatch):
    """DEEPSERVE_GQA_KV_HEADS_PER_PROGRAM=auto (the default): 64-wide 16-bit heads pair in a launch without a split
    whose programs fit the SMs in one wave, not past one wave (four times the rows) nor in a split launch (two rows
    over a long context); each matches the reference."""
    from deepserve.kernels import decode_launch
    launched = spy_decode_launches(monkeypatch)
    monkeypatch.setattr(decode_launch, "KV_HEADS_PER_PROGRAM", "auto")
    kv_heads, head_dim = 8, 64
    one_wave_rows = num_sms(torch.device(device)) // 2    # x 8 heads x 64 = two 128-wide an SM
    for lens, want_pairs, want_split in (([100] * one_wave_rows, 2, False), ([100] * (4 * one_wave_rows), 1, False),
                                         ([900, 700], 1, True)):
        blocks = cdiv_total(lens, 16) + 4
        batch = make_batch([(n - 1, 1) for n in lens], 16, blocks, device)
        cache = random_cache(blocks, 16, kv_heads, head_dim, torch.float16, device)   # fp16: the interpreter's too
        q = torch.randn(len(lens), kv_heads * 4, head_dim, device=device).half()
        out = decode_attention(q, cache, batch.block_tables, batch.seq_lens, 0.2, max_seq_len=max(lens))
        assert launched[-1][0] == want_pairs and (launched[-1][1] > 1) == want_split
        assert_attention_close(out, decode_attention_ref(q, cache, batch.block_tables, batch.seq_lens, 0.2),
                               torch.float16)


def test_decode_tiles_deepen_the_pipeline_only_for_one_wave_without_split(device):
    """A launch without split-K whose programs fit the SMs two 128-wide (four 64-wide) ones at a time gets the
    three-stage tiles; more programs, or a split launch, the default, except past one wave without a split over an
    fp8 cache: three stages (the measured rule). Every launch in HEADS_FIRST's order."""
    dev = torch.device(device)
    two_a_sm = 2 * num_sms(dev)
    order = dict(heads_first=HEADS_FIRST)
    deep = replace(DEEP_PIPELINE_TILES, **order)
    for fp8 in (False, True):
        assert decode_tiles(two_a_sm, 128, False, dev, fp8) == decode_tiles(2 * two_a_sm, 64, False, dev, fp8) == deep
        assert decode_tiles(8, 128, True, dev, fp8) == DecodeTiles(**order)
    assert (decode_tiles(two_a_sm + 1, 128, False, dev) == decode_tiles(2 * two_a_sm + 1, 64, False, dev)
            == DecodeTiles(**order))
    past_one_wave = decode_tiles(two_a_sm + 1, 128, False, dev, fp8_cache=True)
    assert past_one_wave == (DecodeTiles(num_stages=3, heads_first=True) if HEADS_FIRST else DecodeTiles())
    assert DEEP_PIPELINE_TILES.block_n == DecodeTiles().block_n      # the split partition does not depend on it


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


@pytest.mark.parametrize("num_splits", [2, 33, 64])
def test_decode_reduce_reads_only_active_splits(device, num_splits):
    """The reduce over a CUDA graph's grid (splits sized for a long context) at short and long contexts: a float32
    merge of the same partials; the splits a sequence does not use hold NaN and are never read; a sequence within
    one split gets that split's output bit for bit (weight exactly 1)."""
    lens = [1, 63, 64, 65, 193, 1000, 4096]
    n, h, d = len(lens), 4, 64
    seq_lens = torch.tensor(lens, device=device)
    seq_ids = torch.randperm(n, device=device)
    q_rows = torch.randperm(n + 3, device=device)[:n]
    used = active_splits_ref(seq_lens[seq_ids], num_splits, DECODE_BLOCK_N)
    part_out, part_lse = poison_unused_splits(torch.randn(n, h, num_splits, d, device=device),
                                              4 * torch.randn(n, h, num_splits, device=device), used)
    out = torch.full((n + 3, h, d), float("nan"), device=device)
    decode_reduce(part_out, part_lse, q_rows, seq_ids, seq_lens, out)
    ref = decode_reduce_ref(part_out, part_lse, q_rows, seq_ids, seq_lens, torch.zeros_like(out))
    assert_close_rel(out[q_rows], ref[q_rows], (1e-6, 1e-5))
    single = used == 1
    assert single.any() and torch.equal(out[q_rows][single], part_out[single, :, 0])


@pytest.mark.parametrize("num_splits", [None, 64])
def test_decode_graph_grid_short_contexts(device, num_splits):
    """A decode launch sized as a CUDA graph's (max_seq_len far above every context): most splits are empty, their
    programs exit without storing, and the reduce merges only the used ones."""
    dtype = torch.float16
    lens = [1, 17, 64, 65, 193]
    batch, cache, q = _decode_case(device, dtype, 64, 4, lens, 16, 40)
    ref = decode_attention_ref(q, cache, batch.block_tables, batch.seq_lens, 0.125)
    out = decode_attention(q, cache, batch.block_tables, batch.seq_lens, 0.125, max_seq_len=8192,
                           num_splits=num_splits)
    assert_attention_close(out, ref, dtype)


@pytest.mark.parametrize("inputs_ready", [False, True])
def test_decode_rows_subset(device, inputs_ready):
    """Decode rows scattered among other rows: only those rows are written, each from its own sequence; the
    inputs read before or after the PDL wait (inputs_ready: the backends' metadata, copied in before the step), with
    and without a split."""
    dtype = torch.float16
    lens = [40, 7, 300]
    batch, cache, q_small = _decode_case(device, dtype, 64, 4, lens, 16, 64)
    q = torch.randn(10, q_small.shape[1], 64, device=device).half()
    rows = torch.tensor([8, 2, 5], device=device)
    seq_ids = torch.tensor([2, 0, 1], device=device)
    ref = decode_attention_ref(q, cache, batch.block_tables, batch.seq_lens, 0.125, q_rows=rows, seq_ids=seq_ids)
    others = torch.ones(10, dtype=torch.bool, device=device)
    others[rows] = False
    for splits in (1, 5):
        out = torch.full_like(q, float("nan"))
        decode_attention(q, cache, batch.block_tables, batch.seq_lens, 0.125, out=out, q_rows=rows,
                         seq_ids=seq_ids, num_splits=splits, max_seq_len=4096, inputs_ready=inputs_ready)
        assert_attention_close(out[rows], ref[rows], dtype)
        assert torch.isnan(out[others]).all()


@pytest.mark.parametrize("l2_prefetch_setting", ["reduce", "reduce_evict_last"], indirect=True)
@pytest.mark.parametrize("lens", [[1000], [40, 7, 300, 1, 64, 900, 5, 2048]])
def test_decode_reduce_l2_prefetch_changes_nothing(device, lens, l2_prefetch_setting):
    """The split reduce's prefetch programs (kernels/l2_prefetch.py; extra grid rows, a piece per (row, head))
    ask L2 for o_proj's weight and nothing else: batch 1 and batch 8, split launches of a CUDA graph's grid, give
    bitwise the output of the launch without them, and leave the weight as it was."""
    dtype = torch.bfloat16 if not INTERPRET else torch.float16
    batch, cache, q = _decode_case(device, dtype, 64, 4, lens, 16, 400)
    n = len(lens)
    rows, seq_ids = torch.arange(n, device=device), torch.arange(n, device=device)
    weight = torch.randn(2048, 2048, device=device).to(dtype)
    weight_before = weight.clone()
    _assert_prefetch_plan(weight, n, q, "reduce", l2_prefetch_setting)
    outs = []
    for prefetch in (None, weight):
        out = torch.full_like(q, float("nan"))
        decode_attention(q, cache, batch.block_tables, batch.seq_lens, 0.125, out=out, q_rows=rows, seq_ids=seq_ids,
                         num_splits=16, max_seq_len=4096, inputs_ready=True, l2_prefetch=prefetch)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(weight, weight_before)
    ref = decode_attention_ref(q, cache, batch.block_tables, batch.seq_lens, 0.125)
    assert_attention_close(outs[1], ref, dtype)


@pytest.mark.parametrize("head_dim,group,kv_heads_a_program", [(64, 4, 1), (128, 4, 1), (64, 1, 1), (128, 8, 1),
                                                                (64, 3, 2)])
@pytest.mark.parametrize("max_seq_len,num_splits", [(None, 2), (None, 4), (8192, 3)])
def test_decode_split_merge_in_the_kernel_matches_the_reduce(device, head_dim, group, kv_heads_a_program,
                                                             max_seq_len, num_splits):
    """DEEPSERVE_DECODE_SPLIT_MERGE=last: the last split program of each (row, KV heads) merges the partials in the
    decode kernel. Against the reference, and within an ulp of the reduce launch's merge (mostly bit for bit); rows
    scattered among others (those stay untouched), contexts within one split and across many, a CUDA graph's grid
    (max_seq_len far above every context: most splits empty); every counter back to zero after each launch."""
    from deepserve.kernels.decode_launch import merge_tile, split_counters
    dtype = torch.float16
    lens = [1, 17, 64, 65, 193, 700, 1000]
    kv_heads = 4
    batch = make_batch([(n - 1, 1) for n in lens], 16, cdiv_total(lens, 16) + 8, device)
    cache = random_cache(cdiv_total(lens, 16) + 8, 16, kv_heads, head_dim, dtype, device)
    t = len(lens) + 3
    q = torch.randn(t, kv_heads * group, head_dim, device=device).to(dtype)
    rows = torch.randperm(t, device=device)[:len(lens)]
    seq_ids = torch.randperm(len(lens), device=device)
    ref = decode_attention_ref(q, cache, batch.block_tables, batch.seq_lens, 0.2, q_rows=rows, seq_ids=seq_ids)
    others = torch.ones(t, dtype=torch.bool, device=device)
    others[rows] = False
    tiles = DecodeTiles(heads_first=True, kv_heads=kv_heads_a_program)
    outs = {}
    for merge in ("reduce", "last"):
        out = torch.full_like(q, float("nan"))
        decode_attention(q, cache, batch.block_tables, batch.seq_lens, 0.2, out=out, q_rows=rows, seq_ids=seq_ids,
                         max_seq_len=max_seq_len, num_splits=num_splits, tiles=tiles, split_merge=merge)
        assert torch.isnan(out[others]).all()
        assert_attention_close(out[rows], ref[rows], dtype)
        outs[merge] = out[rows]
    assert merge_tile(kv_heads_a_program * group, num_splits, head_dim) is not None     # no fallback to the reduce
    assert_within_ulps(outs["last"], outs["reduce"], dtype, ulps=1, min_exact=0.9)
    assert not split_counters(q.device).any()


def test_decode_split_merge_keeps_the_reduce_past_its_tile(device, monkeypatch):
    """A merge tile past MERGE_MAX_ELEMENTS (many splits of wide heads), a head width that is not a power of two:
    the launch keeps its reduce."""
    from deepserve.kernels import paged_attention
    from deepserve.kernels.decode_launch import merge_tile
    assert merge_tile(4, 8, 64) == (4, 8)
    assert merge_tile(3, 5, 64) == (4, 8)
    assert merge_tile(4, 32, 128) is None
    assert merge_tile(4, 2, 96) is None        # partials packed at a power-of-two head width
    reduces = []
    real = paged_attention.decode_reduce
    monkeypatch.setattr(paged_attention, "decode_reduce", lambda *a, **k: reduces.append(1) or real(*a, **k))
    lens = [1000, 300]
    batch, cache, q = _decode_case(device, torch.float16, 128, 4, lens, 16, cdiv_total(lens, 16) + 8)
    for splits, want in ((4, 0), (32, 1)):
        decode_attention(q, cache, batch.block_tables, batch.seq_lens, 0.2, max_seq_len=4096, num_splits=splits,
                         split_merge="last")
        assert len(reduces) == want


@pytest.mark.parametrize("lens", [[1044], [1000, 1044, 3, 700]])
def test_one_tile_partitions_merge_in_the_kernel_past_the_tile(device, lens, monkeypatch):
    """DEEPSERVE_DECODE_MERGE_ONE_TILE: a launch of 64-key partitions whose split count is past the merge tile's 16
    (Llama-3.2-1B's heads: 18 splits for a graph sized for 1100 keys, 17 of them used) merges them in the kernel over
    a 32-split tile instead of a reduce launch: against the reference, within an ulp of the reduce's merge, every
    counter back to zero. Off, the same launch takes the reduce."""
    from deepserve.kernels import decode_launch, paged_attention
    from deepserve.kernels.decode_launch import split_counters
    reduces = []
    real = paged_attention.decode_reduce
    monkeypatch.setattr(paged_attention, "decode_reduce", lambda *a, **k: reduces.append(1) or real(*a, **k))
    dtype = torch.float16
    batch, cache, q = _decode_case(device, dtype, 64, 4, lens, 16, cdiv_total(lens, 16) + 8)
    n = len(lens)
    rows = torch.arange(n, device=device)
    ref = decode_attention_ref(q, cache, batch.block_tables, batch.seq_lens, 0.2)
    outs = {}
    for one_tile in (False, True):
        monkeypatch.setattr(decode_launch, "ONE_TILE_MERGE", one_tile)
        out = torch.full_like(q, float("nan"))
        decode_attention(q, cache, batch.block_tables, batch.seq_lens, 0.2, out=out, q_rows=rows, seq_ids=rows,
                         max_seq_len=1100, num_splits=18, split_merge="last")
        assert len(reduces) == (0 if one_tile else 1)
        reduces.clear()
        assert_attention_close(out, ref, dtype)
        outs[one_tile] = out
    assert decode_launch.merge_tile(4, 18, 64, one_tile=True) == (4, 32)
    assert_within_ulps(outs[True], outs[False], dtype, ulps=1, min_exact=0.9)
    assert not split_counters(q.device).any()


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


def test_backend_decode_splits_forced_by_the_environment(device, monkeypatch):
    """DEEPSERVE_DECODE_SPLITS (an A/B switch): the backend's decode launches split in that many parts, rounded to
    whole 64-key tiles of the longest context (32 over 1501 keys: 24 splits of 64, past the in-kernel merge's tile,
    so a reduce merges them), and a mixed step still matches the reference backend."""
    monkeypatch.setenv("DEEPSERVE_DECODE_SPLITS", "32")
    launched = spy_decode_launches(monkeypatch)
    ref, out = _mixed_step_through_both_backends(device)
    assert TritonPagedAttention().num_splits == 32 and TritonPagedAttention(rows_as_decodes=True).num_splits == 1
    assert [splits for _, splits in launched] == [24]
    assert_attention_close(out, ref, torch.float16)


def _mixed_step_through_both_backends(device, **forward_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """MIXED_SEQS' step (fp16, 64-wide heads in groups of 2) through TorchPagedAttention, then TritonPagedAttention,
    each on its own copy of one random cache: (reference output, Triton output)."""
    dtype, head_dim, group, bs = torch.float16, 64, 2, 16
    batch = make_batch(MIXED_SEQS, bs, 160, device)
    h, hkv, t = NUM_KV_HEADS * group, NUM_KV_HEADS, batch.num_tokens
    q, k, v = (torch.randn(t, n, head_dim, device=device).to(dtype) for n in (h, hkv, hkv))
    cache = random_cache(160, bs, hkv, head_dim, dtype, device)
    outs = []
    for backend in (TorchPagedAttention(), TritonPagedAttention()):
        batch.attn_metadata = backend.build_metadata(batch)
        outs.append(backend.forward(q, k, v, cache.clone(), batch, 0.125, **forward_kwargs))
    return outs[0], outs[1]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qkv_views", [True, False], ids=["qkv_views", "separate"])
def test_backend_with_rotary_matches_torch_backend(device, dtype, qkv_views):
    """A mixed step with the layer's rotary embedding handed to the backend (the Llama layer's call): the reference
    rotates then writes, the Triton backend does both in one kernel; same cache (rotated keys within one rounding),
    outputs within the attention tolerance. q and k as views of one qkv output (Llama) or separate tensors (Qwen3's
    normalised q and k)."""
    skip_bf16_in_interpreter(dtype)
    bs, h, hkv, d = 16, 8, 2, 64
    batch = make_batch(MIXED_SEQS, bs, 160, device)
    t = batch.num_tokens
    qkv = torch.randn(t, (h + 2 * hkv) * d, device=device).to(dtype)
    q = qkv[:, :h * d].view(t, h, d)
    k = qkv[:, h * d:(h + hkv) * d].view(t, hkv, d)
    v = qkv[:, (h + hkv) * d:].view(t, hkv, d)
    if not qkv_views:
        q, k = q.contiguous(), k.contiguous()
    rope = RotaryEmbedding(d, 4096, 10000.0, LLAMA3_SCALING).to(device)
    cache = random_cache(160, bs, hkv, d, dtype, device)
    results = {}
    for name, backend in (("torch", TorchPagedAttention()), ("triton", TritonPagedAttention())):
        c = cache.clone()
        batch.attn_metadata = backend.build_metadata(batch)
        results[name] = (backend.forward(q, k, v, c, batch, 0.125, rotary=rope), c)
    (ref, ref_cache), (out, out_cache) = results["torch"], results["triton"]
    atol = 2.0 ** -21 * qkv.float().abs().max().item()      # a fused multiply-add in the rotation (see above)
    assert_within_ulps(out_cache[0], ref_cache[0], dtype, ulps=1, min_exact=0.98, atol=atol)
    assert torch.equal(out_cache[1], ref_cache[1])
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


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_as_decodes_match_and_do_not_depend_on_the_batch(device, dtype):
    """Batch-invariant mode: every row of a mixed step runs as a decode of its own length. Outputs agree with the
    reference backend, and each sequence's rows are bitwise the same computed alone (its own batch) or in the step."""
    skip_bf16_in_interpreter(dtype)
    bs, head_dim, group = 16, 64, 2
    seqs = MIXED_SEQS
    batch = make_batch(seqs, bs, 160, device)
    h, hkv = NUM_KV_HEADS * group, NUM_KV_HEADS
    t = batch.num_tokens
    q = torch.randn(t, h, head_dim, device=device).to(dtype)
    k = torch.randn(t, hkv, head_dim, device=device).to(dtype)
    v = torch.randn(t, hkv, head_dim, device=device).to(dtype)
    cache = random_cache(160, bs, hkv, head_dim, dtype, device)
    scale = 1 / math.sqrt(head_dim)
    backend = TritonPagedAttention(rows_as_decodes=True)
    c = cache.clone()
    batch.attn_metadata = backend.build_metadata(batch)
    out = backend.forward(q, k, v, c, batch, scale)
    ref_backend = TorchPagedAttention()
    c_ref = cache.clone()
    batch.attn_metadata = ref_backend.build_metadata(batch)
    assert_attention_close(out, ref_backend.forward(q, k, v, c_ref, batch, scale), dtype)
    # Sequence 3 (70 rows over 130 cached keys) alone: the same tables, lengths and cache (written by the step).
    starts = batch.query_start_loc.tolist()
    lo, hi = starts[3], starts[4]
    alone = ForwardBatch(
        input_ids=batch.input_ids[lo:hi], positions=batch.positions[lo:hi], slot_mapping=batch.slot_mapping[lo:hi],
        block_tables=batch.block_tables[3:4], query_start_loc=torch.tensor([0, hi - lo], device=device),
        seq_lens=batch.seq_lens[3:4], query_lens_cpu=[hi - lo], seq_lens_cpu=batch.seq_lens_cpu[3:4],
        logits_indices=batch.logits_indices, block_size=bs)
    alone.attn_metadata = backend.build_metadata(alone)
    single = backend.forward(q[lo:hi], k[lo:hi], v[lo:hi], c.clone(), alone, scale)
    assert torch.equal(single, out[lo:hi])


# --- fp8 KV caches (kv_cache_dtype "fp8" / "fp8_e5m2"): written saturated and rounded, read widened ------------------
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _act_dtype():
    return torch.float16 if INTERPRET else torch.bfloat16     # the interpreter gets bf16 products wrong


def skip_fp8_rounding_in_interpreter():
    if INTERPRET:
        pytest.skip("Triton's interpreter drops the carry when a float rounds up into the next fp8 exponent "
                    "(1.997 -> 1.0): GPU only")


@pytest.mark.parametrize("cache_dtype", FP8, ids=str)
def test_write_kv_into_fp8_matches_reference(device, cache_dtype):
    """The codes written are the reference's (a clamp to the format's largest value, then torch's cast), bit for bit;
    outliers saturate instead of becoming NaN or inf."""
    skip_fp8_rounding_in_interpreter()
    bs, nb, t, hkv, d = 16, 40, 37, 2, 64
    cache = torch.zeros(2, nb, bs, hkv, d, device=device).to(cache_dtype)
    slots = torch.randperm(nb * bs, device=device)[:t]
    k = torch.randn(t, hkv, d, device=device).to(_act_dtype())
    v = (torch.randn(t, hkv, d, device=device) * 3).to(_act_dtype())
    k[0, 0, :4] = torch.tensor([1000.0, -1000.0, 60000.0, 1e-4])       # past E4M3's 448 / E5M2's 57344; a subnormal
    ref = cache.clone()
    write_kv_ref(ref, k, v, slots)
    write_kv(cache, k, v, slots)
    assert torch.equal(cache.view(torch.uint8), ref.view(torch.uint8))
    assert torch.isfinite(cache.float()).all()


@pytest.mark.parametrize("cache_dtype", FP8, ids=str)
def test_rotary_write_kv_into_fp8_matches_reference(device, cache_dtype):
    skip_fp8_rounding_in_interpreter()
    heads, kv_heads, head_dim, t, nb, bs = 8, 2, 64, 21, 30, 16
    dtype = _act_dtype()
    q, k, v, slots, positions = _rotary_case(device, dtype, heads, kv_heads, head_dim, t, nb, bs)
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0).to(device)
    cache = torch.zeros(2, nb, bs, kv_heads, head_dim, device=device).to(cache_dtype)
    ref = cache.clone()
    ref_q = rotary_write_kv_ref(ref, q, k, v, slots, positions, rotary.cos_cache, rotary.sin_cache)
    q_rot = rotary_write_kv(cache, q, k, v, slots, positions, rotary.cos_cache, rotary.sin_cache)
    assert_within_ulps(q_rot, ref_q, dtype, ulps=1, min_exact=0.98)
    # A rotated key one rounding off the reference's (a fused multiply-add) may round to the neighbouring fp8 code.
    same = cache.view(torch.uint8) == ref.view(torch.uint8)
    assert same.float().mean().item() > 0.99
    tiny = torch.finfo(cache_dtype).smallest_normal          # subnormal codes are this far apart at most
    assert ((cache.float() - ref.float()).abs() <= 0.26 * ref.float().abs() + tiny).all()   # one code (E5M2: 25%)


@pytest.mark.parametrize("cache_dtype", FP8, ids=str)
@pytest.mark.parametrize("head_dim,group", [(64, 4), (128, 8)])
def test_decode_over_fp8_cache_matches_reference(device, cache_dtype, head_dim, group):
    dtype = _act_dtype()
    lens = [1, 15, 17, 100, 333]
    batch, cache, q = _decode_case(device, dtype, head_dim, group, lens, 16, 80)
    cache = cache.to(cache_dtype)
    scale = 1 / math.sqrt(head_dim)
    ref = decode_attention_ref(q, cache, batch.block_tables, batch.seq_lens, scale)
    pairs = [None, DecodeTiles(kv_heads=2)] if head_dim == 64 else [None]      # two KV heads a program too
    for splits, tiles in itertools.product((1, 3), pairs):
        out = torch.full_like(q, float("nan"))
        decode_attention(q, cache, batch.block_tables, batch.seq_lens, scale, out=out, max_seq_len=max(lens),
                         num_splits=splits, tiles=tiles)
        assert_attention_close(out, ref, dtype)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, None], ids=["e4m3", "act-dtype"])
@pytest.mark.parametrize("block_size", [16, 64])
def test_decode_values_transposed_matches_reference(device, cache_dtype, block_size):
    """DecodeTiles.values_t: the same cache with each block's values stored [KV heads, head_dim, slots] gives the
    same attention, over tiles that span several blocks (or half of one), with and without split-K; the slots past a
    sequence's end in its last run of 16 are read and weigh nothing."""
    dtype = _act_dtype()
    lens = [1, 15, 17, 100, 333]
    batch, cache, q = _decode_case(device, dtype, 128, 8, lens, block_size, cdiv_total(lens, block_size) + 8)
    cache = cache.to(cache_dtype or dtype)
    ref = decode_attention_ref(q, cache, batch.block_tables, batch.seq_lens, 0.1)
    transposed = cache.clone()
    transposed[1] = cache[1].permute(0, 2, 3, 1).contiguous().view(cache[1].shape)
    for tiles in (DecodeTiles(values_t=True), DecodeTiles(64, 4, 3, True, heads_first=True, values_t=True),
                  DecodeTiles(values_t=True, kv_heads=2)):
        for splits in (1, 3):
            out = torch.full_like(q, float("nan"))
            decode_attention(q, transposed, batch.block_tables, batch.seq_lens, 0.1, out=out, max_seq_len=max(lens),
                             num_splits=splits, tiles=tiles)
            assert_attention_close(out, ref, dtype)


@pytest.mark.parametrize("window", [1, 7, 64, 100, 700])
@pytest.mark.parametrize("splits,split_merge", [(1, None), (3, "last"), (3, "reduce"), (17, "last"), (40, "reduce")])
def test_decode_sliding_window_matches_reference(device, window, splits, split_merge):
    """A sliding window (key j visible when j >= seq_len - window): the splits partition each row's window, merged in
    the kernel or by the reduce, over a CUDA graph's grid (max_seq_len far above the contexts) too; rows shorter than
    the window see every key. Against the reference, and not the unwindowed result."""
    dtype = torch.float16
    lens = [1, 7, 65, 193, 1000, 1500]
    batch, cache, q = _decode_case(device, dtype, 64, 4, lens, 16, cdiv_total(lens, 16) + 8)
    ref = decode_attention_ref(q, cache, batch.block_tables, batch.seq_lens, 0.5, window=window)
    for max_seq_len in (None, 8192):
        out = torch.full_like(q, float("nan"))
        decode_attention(q, cache, batch.block_tables, batch.seq_lens, 0.5, out=out, max_seq_len=max_seq_len,
                         num_splits=splits, split_merge=split_merge, window=window)
        assert_attention_close(out, ref, dtype)
    full = decode_attention_ref(q, cache, batch.block_tables, batch.seq_lens, 0.5)
    assert not torch.allclose(out[-1].float(), full[-1].float(), atol=1e-2)


@pytest.mark.parametrize("window", [5, 100])
def test_backends_agree_through_a_sliding_window(device, window):
    """A mixed step (prefills, a chunk over a cached prefix, decodes) through both backends with a window."""
    ref, out = _mixed_step_through_both_backends(device, window=window)
    assert_attention_close(out, ref, torch.float16)
