"""DeepSeek FP8 block-quantized weights: dequantization, stream pairing, and a tiny FP8 checkpoint end to end."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deepserve.loader.fp8 import dequantize_block_fp8, dequantize_weights, quantize_block_fp8

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "models"))
from hf_compare import check_alone, engine_logits, load_hf, random_prompt, save_tiny


def test_dequantize_uses_one_scale_per_block_including_partial_edges():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(200, 130, generator=gen)
    q, scale_inv = quantize_block_fp8(weight, (128, 128))
    assert q.dtype == torch.float8_e4m3fn and scale_inv.shape == (2, 2)
    got = dequantize_block_fp8(q, scale_inv, (128, 128))
    for bi, rows in enumerate((slice(0, 128), slice(128, 200))):
        for bj, cols in enumerate((slice(0, 128), slice(128, 130))):
            torch.testing.assert_close(got[rows, cols], q[rows, cols].float() * scale_inv[bi, bj], rtol=0, atol=0)
    # e4m3 keeps 3 mantissa bits (relative error <= 1/16), and steps of 2^-9 x scale among subnormals.
    assert ((got - weight).abs() <= weight.abs() / 16 + scale_inv.max() * 2**-9).all()


def test_scale_shape_must_fit_the_blocks():
    q, scale_inv = quantize_block_fp8(torch.randn(64, 64), (32, 32))
    with pytest.raises(ValueError, match="blocks"):
        dequantize_block_fp8(q, scale_inv, (16, 16))


def test_stream_pairs_weights_and_scales_in_any_order():
    a, sa = quantize_block_fp8(torch.randn(20, 20), (16, 16))
    b, sb = quantize_block_fp8(torch.randn(20, 20), (16, 16))
    norm = torch.ones(20)
    stream = [("a.weight", a), ("norm.weight", norm), ("b.weight_scale_inv", sb), ("a.weight_scale_inv", sa),
              ("b.weight", b)]
    out = dict(dequantize_weights(stream, (16, 16)))
    assert set(out) == {"a.weight", "b.weight", "norm.weight"}
    assert out["norm.weight"] is norm
    torch.testing.assert_close(out["b.weight"], dequantize_block_fp8(b, sb, (16, 16)))
    with pytest.raises(ValueError, match="without scales"):
        list(dequantize_weights([("a.weight", a)], (16, 16)))


BLOCK = [16, 16]


def _is_quantized(name: str, tensor: torch.Tensor) -> bool:
    """What DeepSeek quantizes: the linear layers of attention and FFN; not embeddings, head, router, norms."""
    return (tensor.dim() == 2 and name.endswith(".weight") and "embed_tokens" not in name
            and "lm_head" not in name and not name.endswith("mlp.gate.weight"))


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """(FP8 checkpoint dir, HF model holding the dequantized weights, those weights by HF name)."""
    import transformers

    cfg = transformers.DeepseekV3Config(
        vocab_size=512, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=256, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_group=2, topk_group=1)
    ref_dir = save_tiny(tmp_path_factory.mktemp("ref"), cfg, transformers.DeepseekV3ForCausalLM, bias_std=0.1)
    fp8_dir = str(tmp_path_factory.mktemp("fp8"))
    with safe_open(os.path.join(ref_dir, "model.safetensors"), framework="pt") as f:
        original = {name: f.get_tensor(name) for name in f.keys()}
    quantized, dequantized = {}, {}
    for name, tensor in original.items():
        if _is_quantized(name, tensor):
            q, scale_inv = quantize_block_fp8(tensor, BLOCK)
            quantized[name], quantized[name + "_scale_inv"] = q, scale_inv
            dequantized[name] = dequantize_block_fp8(q, scale_inv, BLOCK)
        else:
            quantized[name] = dequantized[name] = tensor
    # A V3 checkpoint's MTP module sits after the last layer; the engine skips it for now.
    mtp_q, mtp_s = quantize_block_fp8(torch.randn(64, 128), BLOCK)
    quantized.update({"model.layers.3.eh_proj.weight": mtp_q, "model.layers.3.eh_proj.weight_scale_inv": mtp_s,
                      "model.layers.3.enorm.weight": torch.ones(64)})
    save_file(quantized, os.path.join(fp8_dir, "model.safetensors"))
    with open(os.path.join(ref_dir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": BLOCK}
    with open(os.path.join(fp8_dir, "config.json"), "w") as f:
        json.dump(config, f)
    # The reference: the same model with the dequantized weights, in the ordinary layout.
    save_file(dequantized, os.path.join(ref_dir, "model.safetensors"))
    return fp8_dir, load_hf(ref_dir), dequantized


def test_fp8_checkpoint_loads_the_dequantized_weights(fp8_checkpoint):
    fp8_dir, hf, dequantized = fp8_checkpoint
    llm = check_alone(fp8_dir, hf)          # logits within 1e-4 and 32 greedy tokens vs HF on dequantized weights
    model = llm.engine.runner.model
    attn = model.layers[1].self_attn
    torch.testing.assert_close(attn.kv_b_proj.weight, dequantized["model.layers.1.self_attn.kv_b_proj.weight"],
                               rtol=0, atol=0)
    moe = model.layers[2].mlp
    torch.testing.assert_close(moe.w13[5, 32:], dequantized["model.layers.2.mlp.experts.5.up_proj.weight"],
                               rtol=0, atol=0)
    torch.testing.assert_close(moe.w2[7], dequantized["model.layers.2.mlp.experts.7.down_proj.weight"], rtol=0, atol=0)
    assert engine_logits(llm, random_prompt(9, seed=2)).isfinite().all()
