"""The one-call decode step of a Llama stack (kernels/cpu/llama_decode.c) against its PyTorch twin, on random packed
weights and a paged cache with scattered blocks: the residual stream out and every key/value it writes."""

import pytest
import torch

from deepserve.kernels.cpu import gguf_a8 as a8
from deepserve.kernels.cpu import gguf_linear as g
from deepserve.kernels.cpu import llama_decode as ld
from gguf_blocks import random_blocks

needs_kernel = pytest.mark.skipif(ld.library() is None, reason="no C compiler or DEEPSERVE_CPU_KERNELS=0")
HOST_ISAS = [name for name in g.ISAS if g.library() is not None and g.resolved_isa(name) == name]
A8_HOST_ISAS = [name for name in a8.ISAS if a8.library() is not None and a8.resolved_isa(name) == name]

SHAPE = ld.StackShape(hidden=128, intermediate=192, heads=4, kv_heads=2, head_dim=32, eps=1e-5, scale=32 ** -0.5)
NUM_BLOCKS, BLOCK_SIZE = 12, 16


def weight(rows, cols, qtype, gen, bias=False, int8_activations=False):
    blocks = random_blocks(rows, cols, qtype, gen=gen)
    if int8_activations:
        blocks = a8.repack(blocks, qtype, cols)
    return ld.PackedWeight(blocks, qtype, torch.randn(rows, generator=gen) * 0.1 if bias else None, int8_activations)


def make_layers(n, qtype, cache_dtype, gen, bias=False, int8_activations=(False, False)):
    """`int8_activations`: for (qkv and down, o and gate_up): the matrices of a stack may mix both kinds."""
    s, (a, b) = SHAPE, int8_activations
    qkv_rows = (s.heads + 2 * s.kv_heads) * s.head_dim
    return [ld.LayerWeights(
        input_norm=1 + 0.1 * torch.randn(s.hidden, generator=gen),
        qkv=weight(qkv_rows, s.hidden, qtype, gen, bias, a),
        o=weight(s.hidden, s.heads * s.head_dim, qtype, gen, int8_activations=b),
        post_norm=1 + 0.1 * torch.randn(s.hidden, generator=gen),
        gate_up=weight(2 * s.intermediate, s.hidden, g.Q8_0, gen, int8_activations=b),   # types may differ, too
        down=weight(s.hidden, s.intermediate, qtype, gen, int8_activations=a),
        kv_cache=torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, s.kv_heads, s.head_dim, generator=gen).to(cache_dtype))
        for _ in range(n)]


def rotary_tables(positions=256):
    inv = 1.0 / 10000 ** (torch.arange(0, SHAPE.head_dim, 2).float() / SHAPE.head_dim)
    emb = torch.outer(torch.arange(positions).float(), inv).repeat(1, 2)
    return emb.cos(), emb.sin()


def step_inputs(seq_lens, gen):
    """Each sequence's blocks drawn without repeats from the whole cache, its table padded with block 0 (as the engine
    pads them); its new token at position seq_len - 1."""
    b = len(seq_lens)
    max_blocks = -(-max(seq_lens) // BLOCK_SIZE)
    perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables = torch.zeros(b, max_blocks, dtype=torch.int64)
    for i, n in enumerate(seq_lens):
        used = -(-n // BLOCK_SIZE)
        tables[i, :used] = torch.tensor(perm[:used])
        del perm[:used]
    lens = torch.tensor(seq_lens)
    positions = lens - 1
    slots = tables[torch.arange(b), positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    return positions, slots.contiguous(), tables, lens


def run_both(layers, seq_lens, gen, isa_name=None, a8_isa_name=None):
    cos, sin = rotary_tables()
    positions, slots, tables, lens = step_inputs(seq_lens, gen)
    h = torch.randn(len(seq_lens), SHAPE.hidden, generator=gen)
    ref_layers = [ld.LayerWeights(**{**w.__dict__, "kv_cache": w.kv_cache.clone()}) for w in layers]
    ref = ld.decode_step_ref(h, ref_layers, SHAPE, cos, sin, positions, slots, tables, lens)
    stack = ld.DecodeStack(layers, SHAPE, cos, sin, isa_name, a8_isa_name=a8_isa_name)
    out = stack.run(h.clone(), positions, slots, tables, lens)
    return out, ref, layers, ref_layers


@needs_kernel
@pytest.mark.parametrize("isa_name", HOST_ISAS)
@pytest.mark.parametrize("qtype", [g.Q4_1, g.Q8_0])
@pytest.mark.parametrize("seq_lens", [[1], [37], [16, 70, 5]])
def test_step_matches_reference(isa_name, qtype, seq_lens):
    gen = torch.Generator().manual_seed(len(seq_lens) * 100 + seq_lens[0])
    out, ref, layers, ref_layers = run_both(make_layers(3, qtype, torch.float32, gen), seq_lens, gen, isa_name)
    assert torch.allclose(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    for w, r in zip(layers, ref_layers):        # the keys (rotated) and values of the step's tokens, nothing else
        assert torch.allclose(w.kv_cache, r.kv_cache, rtol=1e-5, atol=1e-5 * r.kv_cache.abs().max().item())


@needs_kernel
def test_each_layer_s_sliding_window():
    """Layers of their own windows (0: every key; 5: inside a block; 20: across blocks): each reads its rows' last
    keys only, as the reference does; without the windows the result differs."""
    gen = torch.Generator().manual_seed(11)
    layers = make_layers(3, g.Q8_0, torch.float32, gen)
    for w, window in zip(layers, (0, 5, 20)):
        w.window = window
    out, ref, _, _ = run_both(layers, [37, 70, 3], gen)
    assert torch.allclose(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    gen = torch.Generator().manual_seed(11)
    unwindowed, _, _, _ = run_both(make_layers(3, g.Q8_0, torch.float32, gen), [37, 70, 3], gen)
    assert not torch.allclose(out[:2], unwindowed[:2], rtol=1e-3, atol=1e-3 * ref.abs().max().item())


@needs_kernel
@pytest.mark.parametrize("seq_lens", [[1], [16, 70, 5], [3, 9, 20, 33, 1, 7]])    # 3 and 6 rows: f32_gemv's tail
def test_float32_and_int8_steps_match_reference(seq_lens):
    """Plain float32 weights (the dequantized model's Linears, qtype F32: llama_decode.c's f32_gemv) and int8 rows
    with a scale each (Int8Linear's, I8: i8_gemv), mixed with a packed matrix in the same stack, with a bias."""
    gen = torch.Generator().manual_seed(7 + len(seq_lens))
    layers = make_layers(2, g.Q4_1, torch.float32, gen, bias=True)
    for w in layers:
        for name in ("qkv", "o", "down"):
            packed = getattr(w, name)
            k = packed.blocks.shape[1] // g.BLOCK_BYTES[packed.qtype] * g.QK
            dense = torch.randn(packed.blocks.shape[0], k, generator=gen) * k ** -0.5
            if name == "o":                     # int8 rows, scaled as Int8Linear scales them
                scales = dense.abs().amax(dim=1) / 127
                q = torch.round(dense / scales[:, None]).to(torch.int8)
                setattr(w, name, ld.PackedWeight(q, ld.I8, packed.bias, scales=scales))
            else:
                setattr(w, name, ld.PackedWeight(dense, ld.F32, packed.bias))
    out, ref, layers, ref_layers = run_both(layers, seq_lens, gen)
    assert torch.allclose(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    for w, r in zip(layers, ref_layers):
        assert torch.allclose(w.kv_cache, r.kv_cache, rtol=1e-5, atol=1e-5 * r.kv_cache.abs().max().item())
    bad = ld.LayerWeights(**{**layers[0].__dict__, "qkv": ld.PackedWeight(layers[0].qkv.blocks.double(), ld.F32)})
    with pytest.raises(ValueError, match="qkv: needs a torch.float32"):
        ld.DecodeStack([bad], SHAPE, *rotary_tables())
    bad = ld.LayerWeights(**{**layers[0].__dict__, "o": ld.PackedWeight(layers[0].o.blocks, ld.I8)})
    with pytest.raises(ValueError, match="o: an int8 weight takes its row scales"):
        ld.DecodeStack([bad], SHAPE, *rotary_tables())


@needs_kernel
@pytest.mark.parametrize("a8_isa", A8_HOST_ISAS)
@pytest.mark.parametrize("mix", [(True, True), (True, False), (False, True)], ids=["all", "qkv_down", "o_gate_up"])
@pytest.mark.parametrize("seq_lens", [[1], [16, 70, 5]])
def test_int8_activation_step_matches_reference(a8_isa, mix, seq_lens):
    """quantization="gguf_a8": matrices in the repacked layout quantize their input to int8. The reference
    quantizes the same way (gguf_a8.linear_ref); its float sums differ in order, which can move an activation across
    a rounding boundary of its int8 quantization: one quantum of one element, far below the tolerance."""
    gen = torch.Generator().manual_seed(len(seq_lens) * 10 + sum(mix))
    layers = make_layers(3, g.Q4_1, torch.float32, gen, bias=True, int8_activations=mix)
    out, ref, layers, ref_layers = run_both(layers, seq_lens, gen, a8_isa_name=a8_isa)
    assert torch.allclose(out, ref, rtol=1e-3, atol=1e-3 * ref.abs().max().item())
    for w, r in zip(layers, ref_layers):
        assert torch.allclose(w.kv_cache, r.kv_cache, rtol=1e-3, atol=1e-3 * r.kv_cache.abs().max().item())


@needs_kernel
def test_bias_and_bf16_cache():
    if ld.library(torch.bfloat16) is None:
        pytest.skip("no bf16 build")
    gen = torch.Generator().manual_seed(7)
    out, ref, layers, ref_layers = run_both(make_layers(2, g.Q4_1, torch.bfloat16, gen, bias=True), [20, 3], gen)
    assert torch.allclose(out, ref, rtol=1e-3, atol=1e-3 * ref.abs().max().item())
    for w, r in zip(layers, ref_layers):        # fp32 -> bf16 rounds the same way as torch's .to()
        diff = (w.kv_cache.float() - r.kv_cache.float()).abs()
        assert diff.max().item() <= 1e-2 * r.kv_cache.float().abs().max().item()


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@needs_kernel
@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_fp8_cache_writes_round_as_torch(dtype):
    """kv_fp8.h's rounding of a float into an fp8 cache, bit for bit against the reference's (a clamp, then torch's
    cast): every finite code, the midpoints between neighbours (ties go to the even code) and a float to either side,
    subnormals, values past the largest code (saturated), infinities, zeros of both signs, random floats."""
    from deepserve.kernels.reference.attention import to_cache_dtype
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    finite = codes[torch.isfinite(codes)].sort().values
    mids = (finite[1:] + finite[:-1]) / 2
    inf = torch.tensor(float("inf"))
    gen = torch.Generator().manual_seed(0)
    values = torch.cat([finite, mids, torch.nextafter(mids, inf), torch.nextafter(mids, -inf),
                        torch.randn(20000, generator=gen) * 10, torch.randn(20000, generator=gen) * 1e-3,
                        torch.randn(2000, generator=gen) * 1e5,
                        torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 1e-45, -1e-45, 3e38, 500.0, 6e4])])
    got = ld.fp8_narrow(values, dtype)
    want = to_cache_dtype(values, dtype).view(torch.uint8)
    assert torch.equal(got, want), values[got != want][:8]


@needs_kernel
@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_fp8_cache_step_matches_reference(dtype):
    gen = torch.Generator().manual_seed(11)
    out, ref, layers, ref_layers = run_both(make_layers(2, g.Q8_0, dtype, gen), [20, 3, 33], gen)
    assert torch.allclose(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    for w, r in zip(layers, ref_layers):        # the same codes as the reference's write; nothing else changed
        same = w.kv_cache.view(torch.uint8) == r.kv_cache.view(torch.uint8)
        # A key or value within an ulp of a rounding boundary may land on the neighbouring code (the GEMV's and
        # the reference's float sums differ in order): allow a handful among the step's 2 x 3 x 2 x 32 writes.
        assert (~same).sum().item() <= 8


@needs_kernel
@pytest.mark.parametrize("field,value,message", [("positions", 10_000, "rotary"), ("slots", -1, "slot"),
                                                  ("tables", NUM_BLOCKS, "block table"), ("lens", 0, "length")])
def test_bad_indices_raise_and_write_nothing(field, value, message):
    gen = torch.Generator().manual_seed(3)
    layers = make_layers(1, g.Q4_1, torch.float32, gen)
    cos, sin = rotary_tables()
    inputs = dict(zip(("positions", "slots", "tables", "lens"), step_inputs([30], gen)))
    inputs[field] = inputs[field].clone()
    inputs[field].view(-1)[0] = value
    cache, h = layers[0].kv_cache.clone(), torch.randn(1, SHAPE.hidden, generator=gen)
    stack = ld.DecodeStack(layers, SHAPE, cos, sin)
    with pytest.raises(IndexError, match=message):
        stack.run(h.clone(), inputs["positions"], inputs["slots"], inputs["tables"], inputs["lens"])
    assert torch.equal(layers[0].kv_cache, cache)


@needs_kernel
def test_rejects_tensors_it_cannot_take():
    gen = torch.Generator().manual_seed(4)
    cos, sin = rotary_tables()
    layers = make_layers(2, g.Q4_1, torch.float32, gen)
    layers[1].kv_cache = layers[1].kv_cache[:, :4].clone()          # another cache shape than the first layer's
    with pytest.raises(ValueError, match="kv_cache"):
        ld.DecodeStack(layers, SHAPE, cos, sin)
    with pytest.raises(ValueError, match="unsupported shape"):
        ld.DecodeStack(make_layers(1, g.Q4_1, torch.float32, gen), ld.StackShape(**{**SHAPE.__dict__, "head_dim": 48}),
                       cos, sin)


@needs_kernel
def test_phase_timer_build_times_every_phase_and_computes_the_same():
    gen = torch.Generator().manual_seed(5)
    layers = make_layers(2, g.Q4_1, torch.float32, gen)
    cos, sin = rotary_tables()
    positions, slots, tables, lens = step_inputs([40], gen)
    h = torch.randn(1, SHAPE.hidden, generator=gen)
    plain = ld.DecodeStack(layers, SHAPE, cos, sin).run(h.clone(), positions, slots, tables, lens)
    timed = ld.DecodeStack(layers, SHAPE, cos, sin, phase_times=True)
    assert torch.equal(timed.run(h.clone(), positions, slots, tables, lens), plain)
    times = timed.phase_times()
    assert list(times) == list(ld.PHASES) and all(t > 0 for t in times.values())
    assert all(t == 0 for t in timed.phase_times().values())          # read and reset
