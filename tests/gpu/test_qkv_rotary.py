"""The fused qkv GEMV + rotary + KV-cache write against the two-step path: F.linear in float32 rounded to the
activation dtype (the projection's output), then rotary_write_kv's PyTorch twin. The GEMV sums in another order,
so a projected value may differ by one rounding, and the rotation carries that through: within 2 roundings."""

import pytest
import torch

from deepserve.kernels.qkv_rotary import qkv_rotary_write, skinny_qkv_rotary_write
from deepserve.kernels.kv_write import rotary_write_kv_ref
from deepserve.layers.rotary import RotaryEmbedding

from kernel_testing import DTYPES, assert_within_ulps, skip_bf16_in_interpreter


def assert_fp8_caches_close(cache, ref_cache):
    """An fp8 cache against the two-step path's: most codes equal, the rest at most one code apart (a value one
    rounding off may sit at a boundary), and something written."""
    same = cache.view(torch.uint8) == ref_cache.view(torch.uint8)
    assert same.float().mean().item() > 0.97
    got, want = cache.float(), ref_cache.float()
    tiny = torch.finfo(cache.dtype).smallest_normal          # subnormal codes are this far apart at most
    assert ((got - want).abs() <= 0.26 * want.abs() + tiny).all()     # at most one code apart (E5M2: 25%)
    assert got.abs().sum() > 0


def two_step(x, w, bias, cache, slots, positions, cos, sin, heads, kv_heads):
    d, t = cache.shape[-1], x.shape[0]
    qkv = torch.nn.functional.linear(x.float(), w.float(), None if bias is None else bias.float()).to(x.dtype)
    q = qkv[:, :heads * d].view(t, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(t, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d:].view(t, kv_heads, d)
    return rotary_write_kv_ref(cache, q, k, v, slots, positions, cos, sin)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 64), (4, 4, 128), (6, 1, 32)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("half_cache", [False, True])
def test_matches_two_step_path(device, dtype, heads, kv_heads, head_dim, with_bias, half_cache):
    skip_bf16_in_interpreter(dtype)
    hidden, block_size, num_blocks = 96, 16, 6
    n = (heads + 2 * kv_heads) * head_dim
    x = torch.randn(1, hidden, device=device).to(dtype)
    w = (torch.randn(n, hidden, device=device) * hidden ** -0.5).to(dtype)
    bias = torch.randn(n, device=device).to(dtype) if with_bias else None
    rot = RotaryEmbedding(head_dim, 512, 10000.0)
    cos, sin = rot.cos_cache.to(device), rot.sin_cache.to(device)
    # Half-width caches (one column per angle) hold the same values: the kernel must give the same result.
    kcos, ksin = (cos[:, :head_dim // 2].contiguous(), sin[:, :head_dim // 2].contiguous()) if half_cache else (cos, sin)
    positions = torch.tensor([37], device=device)
    slots = torch.tensor([3 * block_size + 5], device=device)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, device=device).to(dtype)
    ref_cache = cache.clone()
    q = qkv_rotary_write(x, w, bias, cache, slots, positions, kcos, ksin, heads, kv_heads)
    q_ref = two_step(x, w, bias, ref_cache, slots, positions, cos, sin, heads, kv_heads)
    assert q.shape == (1, heads, head_dim) and q.dtype == dtype
    assert_within_ulps(q, q_ref.view(q.shape), dtype, ulps=2, min_exact=0.85, atol=2e-3)
    assert_within_ulps(cache, ref_cache, dtype, ulps=2, min_exact=0.98, atol=2e-3)
    written = cache.view(2, -1, kv_heads, head_dim)[:, slots[0]]
    assert not torch.equal(written, torch.zeros_like(written))


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("rows", [1, 8])
def test_writes_into_an_fp8_cache(device, cache_dtype, rows):
    """An fp8 cache (kv_cache_dtype "fp8" / "fp8_e5m2"): the key and value of the step land rounded (saturated,
    to nearest) as the two-step path rounds them; a value one rounding off there may take the neighbouring code."""
    from deepserve.kernels import INTERPRET
    if INTERPRET:
        pytest.skip("Triton's interpreter drops the carry of a rounding into the next fp8 exponent: GPU only")
    dtype, heads, kv_heads, head_dim, hidden, block_size = torch.bfloat16, 8, 2, 64, 96, 16
    n = (heads + 2 * kv_heads) * head_dim
    x = torch.randn(rows, hidden, device=device).to(dtype)
    w = (torch.randn(n, hidden, device=device) * hidden ** -0.5 * 4).to(dtype)
    rot = RotaryEmbedding(head_dim, 512, 10000.0)
    cos, sin = rot.cos_cache.to(device), rot.sin_cache.to(device)
    positions = torch.arange(rows, device=device) * 11 + 37
    slots = torch.randperm(4 * block_size, device=device)[:rows]
    cache = torch.zeros(2, 4, block_size, kv_heads, head_dim, device=device).to(cache_dtype)
    ref_cache = cache.clone()
    launch = qkv_rotary_write if rows == 1 else skinny_qkv_rotary_write       # batch 1, or a few rows
    q = launch(x, w, None, cache, slots, positions, cos, sin, heads, kv_heads)
    q_ref = two_step(x, w, None, ref_cache, slots, positions, cos, sin, heads, kv_heads)
    assert_within_ulps(q, q_ref.view(q.shape), dtype, ulps=2, min_exact=0.85, atol=2e-3)
    assert_fp8_caches_close(cache, ref_cache)


def test_padding_slot_writes_nothing(device):
    heads, kv_heads, d, hidden = 4, 2, 32, 64
    n = (heads + 2 * kv_heads) * d
    x = torch.randn(1, hidden, device=device).half()
    w = torch.randn(n, hidden, device=device).half()
    rot = RotaryEmbedding(d, 64, 10000.0)
    cache = torch.randn(2, 3, 8, kv_heads, d, device=device).half()
    before = cache.clone()
    q = qkv_rotary_write(x, w, None, cache, torch.tensor([-1], device=device), torch.tensor([3], device=device),
                         rot.cos_cache.to(device), rot.sin_cache.to(device), heads, kv_heads)
    assert torch.equal(cache, before)
    assert torch.isfinite(q.float()).all()


def test_rejects_wrong_row_count(device):
    x = torch.randn(1, 16, device=device).half()
    cache = torch.zeros(2, 2, 4, 2, 8, device=device).half()
    rot = RotaryEmbedding(8, 16, 10000.0)
    with pytest.raises(AssertionError, match="qkv rows"):
        qkv_rotary_write(x, torch.randn(40, 16, device=device).half(), None, cache, torch.tensor([0], device=device),
                         torch.tensor([0], device=device), rot.cos_cache.to(device), rot.sin_cache.to(device), 2, 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,heads,kv_heads,head_dim", [(2, 8, 2, 64), (5, 4, 4, 128), (16, 6, 1, 32),
                                                          (8, 12, 4, 64), (40, 4, 2, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("half_cache", [False, True])
def test_few_rows_match_two_step_path(device, dtype, rows, heads, kv_heads, head_dim, with_bias, half_cache):
    """The skinny GEMM's version (2-16 rows, one token each, their own positions and slots, one a padding row with
    slot -1): q, the written keys and values, and nothing else in the cache, as the two-step path's."""
    skip_bf16_in_interpreter(dtype)
    hidden, block_size, num_blocks = 96, 16, 2 * rows + 2
    n = (heads + 2 * kv_heads) * head_dim
    x = torch.randn(rows, hidden, device=device).to(dtype)
    w = (torch.randn(n, hidden, device=device) * hidden ** -0.5).to(dtype)
    bias = torch.randn(n, device=device).to(dtype) if with_bias else None
    rot = RotaryEmbedding(head_dim, 512, 10000.0)
    cos, sin = rot.cos_cache.to(device), rot.sin_cache.to(device)
    half = head_dim // 2
    kcos, ksin = (cos[:, :half].contiguous(), sin[:, :half].contiguous()) if half_cache else (cos, sin)
    positions = torch.randint(0, 512, (rows,), device=device)
    slots = torch.randperm(num_blocks * block_size, device=device)[:rows]
    slots[rows // 2] = -1                                   # a CUDA-graph padding row
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, device=device).to(dtype)
    ref_cache = cache.clone()
    q = skinny_qkv_rotary_write(x, w, bias, cache, slots, positions, kcos, ksin, heads, kv_heads)
    keep = slots >= 0
    q_ref = two_step(x, w, bias, ref_cache.clone(), slots.clamp(min=0), positions, cos, sin, heads, kv_heads)
    two_step(x[keep], w, bias, ref_cache, slots[keep], positions[keep], cos, sin, heads, kv_heads)
    assert q.shape == (rows, heads, head_dim) and q.dtype == dtype
    assert_within_ulps(q, q_ref.view(q.shape), dtype, ulps=2, min_exact=0.85, atol=2e-3)
    assert_within_ulps(cache, ref_cache, dtype, ulps=2, min_exact=0.98, atol=2e-3)
    written = cache.view(2, -1, kv_heads, head_dim)[:, slots[keep]]
    assert not torch.equal(written, torch.zeros_like(written))


def test_few_rows_with_the_norm_in_the_k_loop(device):
    """With the layer's RMSNorm (NORM): q and the cache as the norm kernel, then the unnormed launch, within the
    operand roundings (fp16 here, which the interpreter multiplies right; the engine takes bf16 only)."""
    from deepserve.layers.norm import RMSNorm
    dtype, rows, heads, kv_heads, d, hidden = torch.float16, 6, 4, 2, 64, 128
    n = (heads + 2 * kv_heads) * d
    x = (3 * torch.randn(rows, hidden, device=device)).to(dtype)
    w = (torch.randn(n, hidden, device=device) * hidden ** -0.5).to(dtype)
    norm = RMSNorm(hidden, 1e-5).to(device)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(hidden, device=device))
    norm = norm.to(dtype)
    rot = RotaryEmbedding(d, 512, 10000.0)
    cos, sin = rot.cos_cache.to(device), rot.sin_cache.to(device)
    positions, slots = torch.arange(rows, device=device) * 7, torch.arange(rows, device=device) * 3
    cache = torch.zeros(2, 4, 16, kv_heads, d, device=device).to(dtype)
    ref_cache = cache.clone()
    with torch.inference_mode():
        q = skinny_qkv_rotary_write(x, w, None, cache, slots, positions, cos, sin, heads, kv_heads, norm=norm)
        q_ref = skinny_qkv_rotary_write(norm(x), w, None, ref_cache, slots, positions, cos, sin, heads, kv_heads)
    for got, want in ((q, q_ref), (cache, ref_cache)):
        rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert rel < 4 * 2.0 ** -10, rel
    assert cache.float().abs().sum() > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the engine on a CUDA GPU")
def test_engine_batch1_decode_uses_it_and_keeps_the_tokens(tiny_llama, monkeypatch):
    """bf16, CUDA graphs: a batch-1 decode step takes the fused launch, and greedy tokens equal those of the
    unfused path (projection GEMV, then rotary + cache write) over 24 steps."""
    from deepserve import LLM, SamplingParams
    from deepserve.layers import attention as attention_module
    prompt = {"prompt_token_ids": list(range(3, 30))}
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    real, calls = attention_module.fused_qkv_rotary_write, []
    monkeypatch.setattr(attention_module, "fused_qkv_rotary_write", lambda *a: calls.append(1) or real(*a))
    fused = LLM(tiny_llama, skip_tokenizer_init=True, device="cuda", dtype="bfloat16", kv_cache_memory_bytes=1 << 26)
    fused_tokens = fused.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert calls, "the batch-1 decode never reached the fused qkv launch"
    del fused
    monkeypatch.setattr(attention_module, "fused_qkv_rotary_write", lambda *a: None)
    plain = LLM(tiny_llama, skip_tokenizer_init=True, device="cuda", dtype="bfloat16", kv_cache_memory_bytes=1 << 26)
    assert plain.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == fused_tokens


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_prologue_is_the_norm_kernel_then_the_launch(device, dtype):
    """qkv_rotary_write(x, ..., norm=n) = the RMSNorm kernel, then qkv_rotary_write of its output: within one
    rounding (the sum of squares runs in another order), the same cache slot written."""
    skip_bf16_in_interpreter(dtype)
    from torch import nn
    from deepserve.kernels.norm import fused_add_rms_norm
    heads, kv_heads, d, hidden = 8, 2, 64, 256
    n = (heads + 2 * kv_heads) * d
    x = (3 * torch.randn(1, hidden, device=device)).to(dtype)
    w = (torch.randn(n, hidden, device=device) * hidden ** -0.5).to(dtype)
    norm = nn.Module()
    norm.weight = nn.Parameter((1 + 0.3 * torch.randn(hidden, device=device)).to(dtype), requires_grad=False)
    norm.eps = 1e-6
    rot = RotaryEmbedding(d, 128, 10000.0)
    cos, sin = rot.cos_cache.to(device), rot.sin_cache.to(device)
    positions, slots = torch.tensor([21], device=device), torch.tensor([13], device=device)
    cache = torch.randn(2, 2, 8, kv_heads, d, device=device).to(dtype)
    ref_cache = cache.clone()
    q = qkv_rotary_write(x, w, None, cache, slots, positions, cos, sin, heads, kv_heads, norm=norm)
    xn = fused_add_rms_norm(x, None, norm.weight, norm.eps)
    q_ref = qkv_rotary_write(xn, w, None, ref_cache, slots, positions, cos, sin, heads, kv_heads)
    assert_within_ulps(q, q_ref, dtype, ulps=1, min_exact=0.9, atol=1e-4)
    assert_within_ulps(cache, ref_cache, dtype, ulps=1, min_exact=0.97, atol=1e-4)


def test_few_rows_dispatch(device, monkeypatch):
    """`fused_qkv_rotary_write` takes 2 to DEEPSERVE_QKV_ROTARY_MAX_ROWS rows to the skinny version (a norm only
    where it can run in the K loop: DEEPSERVE_FUSED_NORMS_MAX_ROWS, bf16), declines past the cap and at the default
    cap of 1."""
    from types import SimpleNamespace
    from deepserve.layers import linear as linear_module
    from deepserve.layers.linear import Linear
    from deepserve.layers.norm import RMSNorm
    monkeypatch.setattr(linear_module, "use_triton", lambda x: True)
    heads, kv_heads, d, hidden, rows = 4, 2, 32, 64, 6
    qkv = Linear(hidden, (heads + 2 * kv_heads) * d, bias=False).to(device).half()
    rot = RotaryEmbedding(d, 64, 10000.0)
    rot.cos_cache, rot.sin_cache = rot.cos_cache.to(device), rot.sin_cache.to(device)
    batch = SimpleNamespace(slot_mapping=torch.arange(rows, device=device) * 2,
                            positions=torch.arange(rows, device=device) + 3)
    cache = torch.zeros(2, 4, 8, kv_heads, d, device=device).half()
    norm = RMSNorm(hidden).to(device).half()
    x = torch.randn(rows, hidden, device=device).half()
    with torch.inference_mode():
        assert linear_module.fused_qkv_rotary_write(x, qkv, cache, batch, rot, heads, kv_heads) is None   # cap 1
        monkeypatch.setattr(linear_module, "_QKV_ROTARY_MAX_ROWS", 16)
        assert linear_module.fused_qkv_rotary_rows(x) and not linear_module.fused_qkv_rotary_rows(x[:0])
        q = linear_module.fused_qkv_rotary_write(x, qkv, cache, batch, rot, heads, kv_heads)
        assert q is not None and q.shape == (rows, heads, d) and cache.float().abs().sum() > 0
        # with a norm: only where it can run in the K loop (DEEPSERVE_FUSED_NORMS_MAX_ROWS, bf16 rows)
        monkeypatch.setattr(linear_module, "_FUSED_NORMS_MAX_ROWS", 16)
        assert linear_module.fused_qkv_rotary_write(x, qkv, cache, batch, rot, heads, kv_heads, norm) is None
        monkeypatch.setattr(linear_module, "_NORM_IN_K_LOOP_DTYPES", (torch.float16,))
        assert linear_module.fused_qkv_rotary_write(x, qkv, cache, batch, rot, heads, kv_heads, norm) is not None
        monkeypatch.setattr(linear_module, "_QKV_ROTARY_MAX_ROWS", 4)
        assert not linear_module.fused_qkv_rotary_rows(x)
        assert linear_module.fused_qkv_rotary_write(x, qkv, cache, batch, rot, heads, kv_heads) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the engine on a CUDA GPU")
def test_engine_few_row_decode_uses_it_and_keeps_the_tokens(tiny_llama, monkeypatch):
    """bf16, eager and CUDA graphs, DEEPSERVE_QKV_ROTARY_MAX_ROWS=16 (with and without the few-row fused norms):
    decode steps of 2-16 rows take the skinny qkv + rotary launch, and the greedy tokens are the unfused path's up
    to a near tie where they first part; no KV block leaks."""
    from deepserve import LLM, SamplingParams
    from deepserve.layers import linear as linear_module
    from tests.engine.near_tie import first_divergence_is_a_near_tie
    import deepserve.kernels.qkv_rotary as qkv_rotary_module
    prompts = [{"prompt_token_ids": list(range(3 + i, 30 + 2 * i))} for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)

    def run(eager):
        llm = LLM(tiny_llama, skip_tokenizer_init=True, device="cuda", dtype="bfloat16",
                  kv_cache_memory_bytes=1 << 26, enforce_eager=eager)
        out = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        return out

    want = run(True)
    real, calls = qkv_rotary_module.skinny_qkv_rotary_write, []
    monkeypatch.setattr(qkv_rotary_module, "skinny_qkv_rotary_write", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(linear_module, "_QKV_ROTARY_MAX_ROWS", 16)
    for norms_rows in (1, 16):
        monkeypatch.setattr(linear_module, "_FUSED_NORMS_MAX_ROWS", norms_rows)
        for eager in (True, False):
            calls.clear()
            got = [o.token_ids for o in run(eager)]
            assert calls, "no decode step took the few-row qkv + rotary launch"
            parted = [i for i, (w, g) in enumerate(zip(want, got)) if w.token_ids != g]
            assert all(first_divergence_is_a_near_tie(want[i].token_ids, got[i], want[i].logprobs) for i in parted)
            assert len(parted) <= 1, parted
