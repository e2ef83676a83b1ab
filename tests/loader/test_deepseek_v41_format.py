"""DeepSeek-V4.1's released weight format (deepinfer.md §3, §2.14, §16.3): the E8M0 / FP8 / FP4 codecs against
values written out by hand from the format definitions, and the checkpoint reader (deepserve/loader/
deepseek_v41_weights.py) on a tiny checkpoint from deepserve.tools.make_tiny_checkpoint: it round-trips exactly,
loads strictly into the reference model, and every corruption fails with an error naming the tensor."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from safetensors import safe_open

from deepserve.loader.deepseek_v41_weights import (
    INDEX_FILE, CheckpointFormatError, Target, load_state_dict, load_weights, merge_gate_up_targets, plan_weights,
    read_checkpoint, targets_of)
from deepserve.loader.fp4 import dequantize_fp4, pack_fp4, quantize_fp4, unpack_fp4
from deepserve.loader.fp8 import (
    dequantize_block_fp8_e8m0, e8m0_to_float, float_to_e8m0, quantize_block_fp8_e8m0)
from deepserve.models.deepseek_v41_config import DeepseekV41Config
from deepserve.models.reference.deepseek_v41 import DeepseekV41Reference
from deepserve.models.reference.tiny import init_tiny_weights, tiny_config
from deepserve.tools.make_tiny_checkpoint import write_deepseek_v41, write_shards


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def u8(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8)


# ================================================================================================ E8M0


def test_e8m0_byte_e_is_two_to_the_e_minus_127():
    got = e8m0_to_float(u8([0, 1, 126, 127, 128, 130, 254]))
    want = torch.tensor([2.0 ** -127, 2.0 ** -126, 0.5, 1.0, 2.0, 8.0, 2.0 ** 127])
    assert torch.equal(got, want)
    # The same bytes as torch's float8_e8m0fnu decode the same way; 255 is E8M0's NaN.
    assert torch.equal(e8m0_to_float(u8([126, 130]).view(torch.float8_e8m0fnu)), torch.tensor([0.5, 8.0]))
    assert e8m0_to_float(u8([255])).isnan().all()


def test_float_to_e8m0_is_the_smallest_power_of_two_at_or_above():
    got = float_to_e8m0(torch.tensor([1.0, 0.75, 0.5, 0.5000001, 3.0, 2.0 ** -130, 0.0])).view(torch.uint8)
    # 1 -> 2^0; 0.75 -> 2^0; 0.5 -> 2^-1; just above 0.5 -> 2^0; 3 -> 2^2; below 2^-127 and 0 clamp to byte 0.
    assert got.tolist() == [127, 127, 126, 127, 129, 0, 0]


# ================================================================================================ FP8 e4m3


# e4m3 (sign, 4 exponent bits with bias 7, 3 mantissa bits; exponent 0 is subnormal: 2^-6 * m/8).
E4M3_BYTES = [0x00, 0x01, 0x08, 0x38, 0x3C, 0x40, 0x7E, 0xB8, 0xC4, 0x80, 0x5B]
E4M3_VALUES = [0.0, 2.0 ** -9, 2.0 ** -6, 1.0, 1.5, 2.0, 448.0, -1.0, -3.0, -0.0, 2.0 ** 4 * (1 + 3 / 8)]


def test_fp8_hand_decoded_bytes_times_each_blocks_scale():
    # Rows 0 and 32 fall in different 32-row blocks: scale bytes 127 (x1) and 130 (x8); the 11 columns one block.
    weight = torch.zeros(33, 11, dtype=torch.uint8)
    weight[0] = weight[32] = u8(E4M3_BYTES)
    scale = u8([[127], [130]]).view(torch.float8_e8m0fnu)
    got = dequantize_block_fp8_e8m0(weight.view(torch.float8_e4m3fn), scale)
    assert got[0].tolist() == E4M3_VALUES
    assert got[32].tolist() == [8 * v for v in E4M3_VALUES]
    assert torch.signbit(got[0, 9])                     # 0x80 is -0


def test_fp8_e8m0_round_trip_is_exact_on_representable_values():
    gen = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (70, 45), generator=gen, dtype=torch.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0x38                    # 0x7F / 0xFF are e4m3's NaNs
    exponents = torch.randint(110, 140, (3, 2), generator=gen, dtype=torch.uint8)
    values = dequantize_block_fp8_e8m0(raw.view(torch.float8_e4m3fn), exponents.view(torch.float8_e8m0fnu))
    q, scale = quantize_block_fp8_e8m0(values)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu and scale.shape == (3, 2)
    assert torch.equal(dequantize_block_fp8_e8m0(q, scale), values)


def test_fp8_e8m0_quantization_error_is_within_e4m3_precision():
    weight = torch.randn(40, 70, generator=torch.Generator().manual_seed(1))
    q, scale = quantize_block_fp8_e8m0(weight)
    got = dequantize_block_fp8_e8m0(q, scale)
    # 3 mantissa bits: relative error <= 2^-4; subnormal steps of 2^-9 x the block scale.
    per_value = e8m0_to_float(scale).repeat_interleave(32, 0)[:40].repeat_interleave(32, 1)[:, :70]
    assert ((got - weight).abs() <= weight.abs() / 16 + per_value * 2.0 ** -9).all()
    assert (q.float().abs() <= 448).all() and (q.float().abs().amax() > 224)   # the scale uses the range


# ================================================================================================ FP4 e2m1


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def test_fp4_low_nibble_is_the_even_element():
    # 0x21: low nibble 1 (0.5) is element 0, high nibble 2 (1.0) element 1. 0xF7: 7 = 6.0 then F = -6.0.
    packed = u8([[0x21, 0xF7, 0x9A, 0x80, 0x53, 0x64]])
    want = [0.5, 1.0, 6.0, -6.0, -1.0, -0.5, 0.0, -0.0, 1.5, 3.0, 2.0, 4.0]
    assert unpack_fp4(packed).tolist() == [want]
    assert unpack_fp4(packed.view(torch.int8)).tolist() == [want]        # I8 is the released dtype (§16.3)


def test_fp4_dequantize_applies_one_scale_per_32_inputs_of_a_row():
    packed = torch.zeros(2, 32, dtype=torch.uint8)          # [2, 64] weights
    packed[0, :6] = u8([0x21, 0xF7, 0x9A, 0x80, 0x53, 0x64])
    packed[0, 16] = 0x21                                     # elements 32, 33: the second block
    packed[1, 31] = 0x60                                     # element 62 = 0, 63 = 4.0 * row 1's second scale
    scale = u8([[128, 125], [127, 131]]).view(torch.float8_e8m0fnu)   # x2, x1/4 ; x1, x16
    got = dequantize_fp4(packed.view(torch.int8), scale)
    assert got.shape == (2, 64)
    assert got[0, :12].tolist() == [1.0, 2.0, 12.0, -12.0, -2.0, -1.0, 0.0, -0.0, 3.0, 6.0, 4.0, 8.0]
    assert got[0, 32:34].tolist() == [0.125, 0.25]
    assert got[1, 63].item() == 64.0
    assert got.count_nonzero().item() == 10 + 2 + 1


def test_fp4_round_trip_is_exact_on_representable_values():
    gen = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (9, 48), generator=gen, dtype=torch.uint8)   # 48 inputs: a partial block
    exponents = torch.randint(115, 140, (9, 2), generator=gen, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    values = dequantize_fp4(pack_fp4(codes), exponents)
    packed, scale = quantize_fp4(values)
    assert packed.dtype == torch.int8 and packed.shape == (9, 24) and scale.shape == (9, 2)
    assert torch.equal(dequantize_fp4(packed, scale), values)


def test_fp4_quantize_rounds_to_the_nearest_value_ties_to_even():
    # Block max 6 -> scale 1. Midpoints 0.25, 1.25, 2.5, 5 go down (to codes 0, 2, 4, 6), 0.75, 1.75, 3.5 up.
    row = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.3, 5.1, -0.74, -2.6]
    want = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 6.0, -0.5, -3.0]
    packed, scale = quantize_fp4(torch.tensor([row]))
    assert e8m0_to_float(scale).tolist() == [[1.0]]
    assert dequantize_fp4(packed, scale).tolist() == [want]


def test_fp4_quantize_picks_the_nearest_grid_point_of_each_block():
    weight = torch.randn(6, 64, generator=torch.Generator().manual_seed(3))
    packed, scale = quantize_fp4(weight)
    s = e8m0_to_float(scale).repeat_interleave(32, dim=1)
    got = dequantize_fp4(packed, scale)
    # Brute force over the 16 codes: no grid point of the block's scale is closer than the chosen one.
    nearest = (weight[..., None] - torch.tensor(E2M1) * s[..., None]).abs().amin(-1)
    assert torch.allclose((got - weight).abs(), nearest, rtol=0, atol=1e-7)
    assert (weight.abs() <= 6 * s).all() and (weight.abs() > 3 * s).view(6, 2, 32).any(-1).all()


# ================================================================================================ the reader


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(tiny V4.1 checkpoint dir, the dequantized weights the tool wrote, the config)."""
    path = str(tmp_path_factory.mktemp("v41"))
    real = write_deepseek_v41(path, "mixed", seed=0)
    with open(os.path.join(path, "config.json")) as f:
        config = DeepseekV41Config.from_hf_dict(json.load(f))
    return path, real, config


def reference(config: DeepseekV41Config, dtype=torch.float32) -> DeepseekV41Reference:
    return DeepseekV41Reference(config, dtype=dtype)


def test_checkpoint_round_trips_exactly(checkpoint):
    path, real, config = checkpoint
    model = reference(config)
    loaded = load_state_dict(path, model.state_dict())
    assert list(loaded) == list(model.state_dict())                 # every parameter, in the model's order
    for name, value in real.items():
        assert loaded[name].dtype == torch.float32
        assert torch.equal(loaded[name], value), name
    # Several shards, and all three encodings among the tensors read.
    stored = read_checkpoint(path)
    assert len({t.shard for t in stored.values()}) >= 2
    assert {t.dtype for t in stored.values()} >= {"F8_E4M3", "F8_E8M0", "I8", "BF16", "F32"}


def test_fp4_expert_bytes_decode_by_hand_to_what_the_reader_yields(checkpoint):
    """Independent of deepserve's codec: decode one stored expert row with the e2m1 table, low nibble first."""
    path, _, config = checkpoint
    name = "layers.2.ffn.experts.5.w2.weight"
    entry, scale_entry = read_checkpoint(path)[name], read_checkpoint(path)["layers.2.ffn.experts.5.w2.scale"]
    with safe_open(entry.shard, "pt") as f:
        row = f.get_tensor(name)[3].view(torch.uint8).tolist()
    with safe_open(scale_entry.shard, "pt") as f:
        exponent = f.get_tensor("layers.2.ffn.experts.5.w2.scale")[3].view(torch.uint8).tolist()
    values = [E2M1[nibble] for byte in row for nibble in (byte & 0xF, byte >> 4)]
    want = [v * 2.0 ** (exponent[i // 32] - 127) for i, v in enumerate(values)]
    got = load_state_dict(path, reference(config).state_dict())[name][3]
    assert got.tolist() == want


def test_strict_load_into_the_reference_model_and_run(checkpoint):
    path, real, config = checkpoint
    model = reference(config)
    model.load_state_dict(load_state_dict(path, model.state_dict()), strict=True)
    expected = reference(config)
    expected.load_state_dict(real, strict=True)
    ids = torch.arange(3, 40)
    with torch.inference_mode():
        logits = model(ids)
        assert logits.isfinite().all()
        assert torch.equal(logits, expected(ids))


def test_quantized_weights_are_near_the_original_ones(checkpoint):
    """The checkpoint stores the reference's random weights, not something else that round-trips."""
    _, real, config = checkpoint
    original = init_tiny_weights(reference(config), seed=0).state_dict()
    for name, value in original.items():
        error = (real[name] - value).norm() / value.norm().clamp(min=1e-30)
        if name.endswith("hc_attn_fn") or name.endswith("attn_sink") or name.endswith("gate.bias"):
            assert torch.equal(real[name], value), name                        # F32: untouched
        elif ".experts." in name:
            assert 0 < error < 0.2, (name, error)                             # FP4
        elif name.endswith("attn.wq_a.weight"):
            assert 0 < error < 0.06, (name, error)                            # FP8
        elif name.endswith("norm.weight") or name == "embed.weight":
            assert torch.equal(real[name], value.bfloat16().float()), name    # BF16


def test_bf16_model_loads_with_exact_dtypes(checkpoint):
    """§3 "each target's dtype must match exactly": a BF16 model (F32 HC / sinks / biases) matches the release;
    an F32 model does not, and the error names a BF16 tensor."""
    path, real, config = checkpoint
    model = reference(config, torch.bfloat16)
    loaded = load_state_dict(path, targets_of(model.state_dict(), exact_dtypes=True))
    assert loaded["layers.0.attn.wq_a.weight"].dtype == torch.bfloat16
    assert loaded["layers.0.hc_attn_fn"].dtype == torch.float32
    model.load_state_dict(loaded, strict=True)
    assert all(torch.equal(loaded[n].float(), v) for n, v in real.items())   # FP8/FP4 values fit in BF16
    with pytest.raises(CheckpointFormatError, match=r"embed\.weight: stored BF16.*float32"):
        plan_weights(path, targets_of(reference(config).state_dict(), exact_dtypes=True))


def test_gate_up_merge(checkpoint):
    path, real, config = checkpoint
    targets = merge_gate_up_targets(targets_of(reference(config).state_dict()))
    assert targets["layers.1.ffn.experts.3.w13.weight"].shape == (2 * 16, 32)
    assert "layers.1.ffn.experts.3.w1.weight" not in targets
    loaded = load_state_dict(path, targets, merge_gate_up=True)
    for prefix in ("layers.1.ffn.experts.3", "layers.4.ffn.shared_experts", "mtp.0.ffn.experts.2"):
        want = torch.cat((real[f"{prefix}.w1.weight"], real[f"{prefix}.w3.weight"]))
        assert torch.equal(loaded[f"{prefix}.w13.weight"], want), prefix
    assert torch.equal(loaded["layers.1.ffn.experts.3.w2.weight"], real["layers.1.ffn.experts.3.w2.weight"])


def test_engram_tables_are_fp8_rows_and_pad_rows_are_dropped(tmp_path):
    real = write_deepseek_v41(str(tmp_path), "engram", seed=1)
    config = DeepseekV41Config.from_hf_dict(tiny_config("engram"))
    table = read_checkpoint(str(tmp_path))["layers.3.engram.embed.weight"]
    rows, dim = real["layers.3.engram.embed.weight"].shape
    assert table.dtype == "F8_E4M3" and read_checkpoint(str(tmp_path))["layers.3.engram.embed.scale"].shape == (
        rows, 1)
    # Pad the table with zero rows (scale 1), as a checkpoint padded for row sharding would be.
    edit(str(tmp_path), lambda t: t.update({
        "layers.3.engram.embed.weight": torch.cat((t["layers.3.engram.embed.weight"],
                                                   torch.zeros(5, dim, dtype=torch.float8_e4m3fn))),
        "layers.3.engram.embed.scale": torch.cat((t["layers.3.engram.embed.scale"],
                                                  u8([[127]] * 5).view(torch.float8_e8m0fnu)))}))
    loaded = load_state_dict(str(tmp_path), reference(config).state_dict())
    assert all(torch.equal(loaded[n], v) for n, v in real.items())


def test_names_may_carry_the_model_prefix(checkpoint, tmp_path):
    path, real, config = checkpoint
    copy = copy_checkpoint(path, tmp_path)
    edit(copy, lambda t: t.update({"model." + n: t.pop(n) for n in list(t)}))
    assert all(n.startswith("model.") for n in json.load(open(os.path.join(copy, INDEX_FILE)))["weight_map"])
    loaded = load_state_dict(copy, reference(config).state_dict())
    assert all(torch.equal(loaded[n], v) for n, v in real.items())


# ------------------------------------------------------------------------------------------------ corruptions


def copy_checkpoint(path: str, tmp_path) -> str:
    copy = str(tmp_path / "ckpt")
    shutil.copytree(path, copy)
    return copy


def stored_tensors(path: str) -> dict[str, torch.Tensor]:
    weight_map = json.load(open(os.path.join(path, INDEX_FILE)))["weight_map"]
    tensors = {}
    for shard in sorted(set(weight_map.values())):
        with safe_open(os.path.join(path, shard), "pt") as f:
            tensors.update({n: f.get_tensor(n) for n in f.keys()})
    return {n: tensors[n] for n in weight_map}


def edit(path: str, change) -> None:
    """Rewrite the checkpoint (shards and index) after `change(tensors)` edits the stored-name dict in place."""
    tensors = stored_tensors(path)
    change(tensors)
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            os.remove(os.path.join(path, name))
    write_shards(path, tensors, 2)


def fails(path: str, config, *patterns: str, **kwargs) -> str:
    with pytest.raises(CheckpointFormatError) as info:
        list(load_weights(path, reference(config).state_dict(), **kwargs))
    for pattern in patterns:
        assert re.search(pattern, str(info.value)), (pattern, str(info.value))
    return str(info.value)


def test_index_entry_missing_from_its_shard(checkpoint, tmp_path):
    path, _, config = checkpoint
    copy = copy_checkpoint(path, tmp_path)
    index_path = os.path.join(copy, INDEX_FILE)
    index = json.load(open(index_path))
    weight_map = index["weight_map"]
    moved = "mtp.0.confidence_head.proj.weight"          # the last tensor: in the last shard, not the first
    assert weight_map[moved] != weight_map["embed.weight"]
    weight_map[moved] = weight_map["embed.weight"]
    weight_map["layers.9.attn.ghost.weight"] = "model-00003-of-00002.safetensors"  # no such shard
    json.dump(index, open(index_path, "w"))
    fails(copy, config, r"mtp\.0\.confidence_head\.proj\.weight: listed in the index under model-00001",
          r"layers\.9\.attn\.ghost\.weight: its shard model-00003-of-00002\.safetensors .* does not exist")


@pytest.mark.parametrize("name", ["layers.2.hc_ffn_fn", "layers.0.hc_attn_base", "mtp.0.hc_ffn_scale",
                                  "layers.3.attn.attn_sink", "layers.1.ffn.gate.bias"])
def test_hc_sink_and_bias_tensors_must_be_f32(checkpoint, tmp_path, name):
    path, _, config = checkpoint
    copy = copy_checkpoint(path, tmp_path)
    edit(copy, lambda t: t.update({name: t[name].bfloat16()}))
    fails(copy, config, re.escape(name) + r": dtype BF16, must be F32")


def test_separate_hc_norm_tensor_is_rejected(checkpoint, tmp_path):
    path, _, config = checkpoint
    copy = copy_checkpoint(path, tmp_path)
    edit(copy, lambda t: t.update({"layers.1.hc_attn_norm.weight": torch.ones(128)}))
    fails(copy, config, r"layers\.1\.hc_attn_norm\.weight: a separate HC norm tensor")


def test_missing_parameter_is_named(checkpoint, tmp_path):
    path, _, config = checkpoint
    copy = copy_checkpoint(path, tmp_path)
    edit(copy, lambda t: [t.pop(n) for n in ("layers.4.attn.wo_b.weight", "layers.4.attn.wo_b.scale",
                                             "layers.0.ffn.experts.6.w3.weight", "layers.0.ffn.experts.6.w3.scale")])
    fails(copy, config, r"2 model parameter\(s\) not in the checkpoint: .*layers\.0\.ffn\.experts\.6\.w3\.weight",
          r"layers\.4\.attn\.wo_b\.weight")


def test_wrong_shapes_are_named(checkpoint, tmp_path):
    path, _, config = checkpoint
    copy = copy_checkpoint(path, tmp_path)

    def change(t):
        t["layers.0.attn.kv_norm.weight"] = torch.ones(33, dtype=torch.bfloat16)
        # An expert packed for 16 inputs where the model has 32: consistent scale, wrong logical shape.
        packed, scale = quantize_fp4(torch.randn(16, 16))
        t["layers.2.ffn.experts.1.w1.weight"], t["layers.2.ffn.experts.1.w1.scale"] = packed, scale
    edit(copy, change)
    fails(copy, config, r"layers\.0\.attn\.kv_norm\.weight: shape \[33\], the model expects \[32\]",
          r"layers\.2\.ffn\.experts\.1\.w1\.weight: shape \[16, 16\] \(stored \[16, 8\]\), the model expects "
          r"\[16, 32\]")


def test_scale_problems_are_named(checkpoint, tmp_path):
    path, _, config = checkpoint
    copy = copy_checkpoint(path, tmp_path)

    def change(t):
        t["layers.1.attn.wq_b.scale"] = t["layers.1.attn.wq_b.scale"][:2]          # [4, 1] -> [2, 1]
        del t["layers.3.attn.wo_a.scale"]                                          # FP8 without its scale
        t["layers.5.attn.orphan.scale"] = u8([[127]]).view(torch.float8_e8m0fnu)
        t["layers.2.ffn.experts.0.w2.scale"] = t["layers.2.ffn.experts.0.w2.scale"].float()
        t["layers.4.attn.wq_a.weight"] = t["layers.4.attn.wq_a.weight"].bfloat16()   # scale kept, not FP8
    edit(copy, change)
    fails(copy, config,
          r"layers\.1\.attn\.wq_b\.scale: shape \[2, 1\], a fp8 scale .* must be \[4, 1\]",
          r"layers\.3\.attn\.wo_a\.weight: dtype F8_E4M3, must be BF16 or F32 \(a quantized weight needs",
          r"layers\.5\.attn\.orphan\.scale: a scale without its weight",
          r"layers\.2\.ffn\.experts\.0\.w2\.scale: dtype F32, must be F8_E8M0",
          r"layers\.4\.attn\.wq_a\.weight: quantized \(has layers\.4\.attn\.wq_a\.scale\) with dtype BF16")


def test_fp8_routed_expert_is_rejected(checkpoint, tmp_path):
    path, _, config = checkpoint
    copy = copy_checkpoint(path, tmp_path)
    name = "layers.1.ffn.experts.2.w3.weight"
    q, s = quantize_block_fp8_e8m0(torch.randn(16, 32))
    edit(copy, lambda t: t.update({name: q, "layers.1.ffn.experts.2.w3.scale": s}))
    fails(copy, config, re.escape(name) + r": quantized .* with dtype F8_E4M3; must be a routed expert: packed FP4")


def test_unexpected_tensor_is_named_unless_allowed(checkpoint, tmp_path):
    path, real, config = checkpoint
    copy = copy_checkpoint(path, tmp_path)
    # Layer 2 shares layer 1's compressed KV (§2.2): it holds no compressor, so a checkpoint one has no home.
    extra = {"layers.2.attn.compressor.norm.weight": torch.ones(32, dtype=torch.bfloat16),
             "mtp.0.embed.weight": torch.zeros(96, 32, dtype=torch.bfloat16),        # tied copies: skipped (§3)
             "vision.patch.weight": torch.zeros(4, 4, dtype=torch.bfloat16)}
    edit(copy, lambda t: t.update(extra))
    message = fails(copy, config, r"1 checkpoint tensor\(s\) the model has no parameter for: "
                                  r"layers\.2\.attn\.compressor\.norm\.weight")
    assert "mtp.0.embed" not in message and "vision" not in message
    loaded = load_state_dict(copy, reference(config).state_dict(), allow_unexpected=True)
    assert set(loaded) == set(real)


def test_nan_scale_is_named_when_loading(checkpoint, tmp_path):
    path, _, config = checkpoint
    copy = copy_checkpoint(path, tmp_path)
    edit(copy, lambda t: t.update({"layers.0.attn.wkv.scale": u8([[255]]).view(torch.float8_e8m0fnu)}))
    plan_weights(copy, targets_of(reference(config).state_dict()))       # headers are fine
    fails(copy, config, r"layers\.0\.attn\.wkv\.scale: E8M0 byte 255 \(NaN\)")


def test_targets_need_not_be_a_model(checkpoint):
    """Shapes alone are enough to validate, e.g. for an engine whose parameters do not exist yet."""
    path, _, config = checkpoint
    shapes = {n: tuple(p.shape) for n, p in reference(config).state_dict().items()}
    plan = plan_weights(path, targets_of(shapes))
    assert len(plan) == len(shapes)
    shapes["layers.0.attn.wq_a.weight"] = (24, 31)
    with pytest.raises(CheckpointFormatError, match=r"layers\.0\.attn\.wq_a\.weight: shape \[24, 32\]"):
        plan_weights(path, {n: Target(s) for n, s in shapes.items()})
