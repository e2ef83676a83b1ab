"""The MLA rotary kernel (deepserve/kernels/rotary.py with `interleaved` and half-width caches), alone and fused with
the latent cache write, against MLARotaryEmbedding's PyTorch path (deepserve/layers/mla.py), which HF's DeepSeek code
fixes."""

import pytest
import torch

from deepserve.kernels.mla_decode import rotary_write_latents, rotary_write_latents_ref, write_latents
from deepserve.kernels.rotary import apply_rotary, rotate
from deepserve.layers.kernel_dispatch import use_triton
from deepserve.layers.mla import MLARotaryEmbedding
from kernel_testing import assert_within_ulps, skip_bf16_in_interpreter

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MAX_POS = 8192
# DeepSeek-V2's YaRN (benchmarks/h200_moe.py), and a variant whose mscale != mscale_all_dim (cos/sin scaled).
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
            beta_fast=32.0, beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707)
SCALINGS = {"default": {"rope_type": "default", "rope_theta": 10000.0}, "yarn": YARN,
            "yarn-mscale": {**YARN, "mscale": 1.0, "mscale_all_dim": 0.0}}


def _views(t, heads, nope, rope, rank, dtype, device):
    """q_pe and k_pe as the model makes them: slices of the q projection and of kv_a_proj's output."""
    q = torch.randn(t, heads * (nope + rope), device=device).to(dtype)
    kv_a = torch.randn(t, rank + rope, device=device).to(dtype)
    q_pe = q.view(t, heads, nope + rope)[..., nope:]
    k_pe = kv_a[:, rank:].unsqueeze(1)
    return q_pe, k_pe


def _positions(t, device):
    """Random positions, with the first and the last of the cache among them."""
    pos = torch.randint(0, MAX_POS, (t,), device=device)
    pos[0], pos[-1] = 0, MAX_POS - 1
    return pos


def _assert_close(out, ref, dtype, x):
    # x1*cos - x2*sin may be contracted into one fused multiply-add: a float32 difference of about 2**-23 of the
    # products, visible only where the two products cancel (results near 0); |cos|, |sin| <= attention factor.
    atol = 2.0 ** -21 * x.float().abs().max().item() * 1.5
    # In a float32 output that contraction shows in the last bit of about a quarter of the elements (measured on
    # an H200: 76% bit-identical); a half-precision output rounds it away almost always.
    min_exact = 0.5 if dtype == torch.float32 else 0.98
    assert_within_ulps(out, ref, dtype, ulps=1, min_exact=min_exact, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "neox"])
@pytest.mark.parametrize("scaling", list(SCALINGS), ids=list(SCALINGS))
@pytest.mark.parametrize("heads,nope,rope,rank", [(16, 128, 64, 512), (3, 5, 10, 7)], ids=["V2", "odd"])
def test_mla_rotary_matches_reference(device, dtype, interleaved, scaling, heads, nope, rope, rank):
    """q_pe [T, H, rope] and k_pe [T, 1, rope] in one launch (odd T, strided views) vs the torch path; the
    layer's dispatch; the half-width cache read as a full-width one gives the same bits."""
    skip_bf16_in_interpreter(dtype)
    rotary = MLARotaryEmbedding(rope, MAX_POS, SCALINGS[scaling], 163840, interleaved).to(device)
    t = 37
    positions = _positions(t, device)
    q_pe, k_pe = _views(t, heads, nope, rope, rank, dtype, device)
    ref_q, ref_k = rotary.reference(positions, q_pe), rotary.reference(positions, k_pe)
    out_q, out_k = apply_rotary(positions, q_pe, k_pe, rotary.cos_cache, rotary.sin_cache, interleaved=interleaved)
    assert out_q.shape == q_pe.shape and out_k.shape == k_pe.shape
    _assert_close(out_q, ref_q, dtype, q_pe)
    _assert_close(out_k, ref_k, dtype, k_pe)
    layer_q, layer_k = rotary(positions, q_pe, k_pe)
    if use_triton(q_pe):
        assert torch.equal(layer_q, out_q) and torch.equal(layer_k, out_k)     # the layer runs the kernel
    else:
        assert torch.equal(layer_q, ref_q) and torch.equal(layer_k, ref_k)     # interpreter: the torch path
    full_cos = torch.cat((rotary.cos_cache, rotary.cos_cache), dim=-1)
    full_sin = torch.cat((rotary.sin_cache, rotary.sin_cache), dim=-1)
    full_q, full_k = apply_rotary(positions, q_pe, k_pe, full_cos, full_sin, interleaved=interleaved)
    assert torch.equal(full_q, out_q) and torch.equal(full_k, out_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mla_rotary_interleaved_in_place_and_one_tensor(device, dtype):
    """In place (every pair is read before its outputs are written) and `rotate` on q and k side by side."""
    rotary = MLARotaryEmbedding(64, MAX_POS, YARN, 163840, True).to(device)
    t = 9
    positions = _positions(t, device)
    q_pe, k_pe = _views(t, 16, 128, 64, 512, dtype, device)
    out_q, out_k = apply_rotary(positions, q_pe, k_pe, rotary.cos_cache, rotary.sin_cache, interleaved=True)
    q2, k2 = q_pe.contiguous(), k_pe.contiguous()
    r_q, _ = apply_rotary(positions, q2, k2, rotary.cos_cache, rotary.sin_cache, inplace=True, interleaved=True)
    assert r_q.data_ptr() == q2.data_ptr() and torch.equal(q2, out_q) and torch.equal(k2, out_k)
    both = rotate(positions, torch.cat((q_pe, k_pe), dim=1), rotary.cos_cache, rotary.sin_cache, interleaved=True)
    assert torch.equal(both, torch.cat((out_q, out_k), dim=1))


def test_mla_rotary_no_tokens(device):
    rotary = MLARotaryEmbedding(64, 128, SCALINGS["default"], 128, True).to(device)
    q_pe, k_pe = _views(0, 4, 16, 64, 32, torch.float32, device)
    out_q, out_k = apply_rotary(torch.zeros(0, dtype=torch.int64, device=device), q_pe, k_pe, rotary.cos_cache,
                                rotary.sin_cache, interleaved=True)
    assert out_q.shape == (0, 4, 64) and out_k.shape == (0, 1, 64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "neox"])
@pytest.mark.parametrize("scaling", ["default", "yarn"])
@pytest.mark.parametrize("heads,nope,rope,rank", [(16, 128, 64, 512), (3, 5, 10, 7)], ids=["V2", "odd"])
@pytest.mark.parametrize("inputs_ready", [False, True], ids=["after_wait", "before_wait"])
def test_rotary_write_latents_matches_reference(device, dtype, interleaved, scaling, heads, nope, rope, rank,
                                                inputs_ready):
    """One launch = the rotary kernel then the latent write, bit for bit (the same rotation code); = the PyTorch
    rotation then the reference write within one rounding; padding rows (slot -1) write nothing. Positions and slots
    read after the PDL wait or before it (inputs_ready, as the backend launches it)."""
    skip_bf16_in_interpreter(dtype)
    rotary = MLARotaryEmbedding(rope, MAX_POS, SCALINGS[scaling], 163840, interleaved).to(device)
    t, nb, bs = 13, 4, 8
    positions = _positions(t, device)
    q_pe, k_pe = _views(t, heads, nope, rope, rank, dtype, device)
    k_pe = k_pe.squeeze(1)                                         # [T, rope], as the backend takes it
    latent = torch.randn(t, rank + rope, device=device).to(dtype)[:, :rank]
    slots = torch.randperm(nb * bs, device=device)[:t]
    slots[[2, 7]] = -1
    cache = torch.randn(nb, bs, rank + rope, device=device).to(dtype)
    fused = cache.clone()
    q_rot = rotary_write_latents(fused, q_pe, latent, k_pe, slots, positions, rotary.cos_cache, rotary.sin_cache,
                                 interleaved, inputs_ready=inputs_ready)
    assert q_rot.shape == q_pe.shape and q_rot.is_contiguous()

    two_launches = cache.clone()
    kernel_q, kernel_k = apply_rotary(positions, q_pe, k_pe.unsqueeze(1), rotary.cos_cache, rotary.sin_cache,
                                      interleaved=interleaved)
    write_latents(two_launches, latent, kernel_k.squeeze(1), slots)
    assert torch.equal(q_rot, kernel_q) and torch.equal(fused, two_launches)

    ref = cache.clone()
    ref_q = rotary_write_latents_ref(ref, q_pe, latent, k_pe, slots, positions, rotary)
    _assert_close(q_rot, ref_q, dtype, q_pe)
    _assert_close(fused[..., rank:], ref[..., rank:], dtype, k_pe)
    assert torch.equal(fused[..., :rank], ref[..., :rank])
    unwritten = torch.ones(nb * bs, dtype=torch.bool, device=device)
    unwritten[slots[slots >= 0]] = False
    assert torch.equal(fused.view(nb * bs, -1)[unwritten], cache.view(nb * bs, -1)[unwritten])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,nope,rope,rank", [(16, 128, 64, 512), (3, 5, 10, 7)], ids=["V2", "odd"])
def test_rotary_write_latents_with_latent_norm(device, dtype, heads, nope, rope, rank):
    """kv_a_layernorm folded into the launch: the cached latent = the RMSNorm kernel's output then the plain write
    (within one rounding: the same arithmetic, the sum of squares maybe in another order), and = the PyTorch
    reference norm within two roundings; q_pe, k_pe as without the norm; padding rows write nothing."""
    skip_bf16_in_interpreter(dtype)
    from deepserve.kernels.norm import fused_add_rms_norm
    rotary = MLARotaryEmbedding(rope, MAX_POS, SCALINGS["yarn"], 163840, True).to(device)
    t, nb, bs, eps = 9, 4, 8, 1e-6
    positions = _positions(t, device)
    q_pe, k_pe = _views(t, heads, nope, rope, rank, dtype, device)
    k_pe = k_pe.squeeze(1)
    latent = (3 * torch.randn(t, rank + rope, device=device)).to(dtype)[:, :rank]
    weight = (1 + 0.1 * torch.randn(rank, device=device)).to(dtype)
    slots = torch.randperm(nb * bs, device=device)[:t]
    slots[4] = -1
    cache = torch.randn(nb, bs, rank + rope, device=device).to(dtype)
    fused = cache.clone()
    q_rot = rotary_write_latents(fused, q_pe, latent, k_pe, slots, positions, rotary.cos_cache, rotary.sin_cache,
                                 True, weight, eps)
    two_launches = cache.clone()
    q_two = rotary_write_latents(two_launches, q_pe, fused_add_rms_norm(latent, None, weight, eps), k_pe, slots,
                                 positions, rotary.cos_cache, rotary.sin_cache, True)
    assert torch.equal(q_rot, q_two) and torch.equal(fused[..., rank:], two_launches[..., rank:])
    assert_within_ulps(fused[..., :rank], two_launches[..., :rank], dtype, ulps=1, min_exact=0.95, atol=1e-6)
    ref = cache.clone()
    rotary_write_latents_ref(ref, q_pe, latent, k_pe, slots, positions, rotary, weight, eps)
    # float32: rsqrt vs 1/sqrt and the summation order show in the last bit of ~10% of the values.
    min_exact = 0.5 if dtype == torch.float32 else 0.9
    assert_within_ulps(fused[..., :rank], ref[..., :rank], dtype, ulps=2, min_exact=min_exact, atol=1e-6)
    unwritten = torch.ones(nb * bs, dtype=torch.bool, device=device)
    unwritten[slots[slots >= 0]] = False
    assert torch.equal(fused.view(nb * bs, -1)[unwritten], cache.view(nb * bs, -1)[unwritten])
