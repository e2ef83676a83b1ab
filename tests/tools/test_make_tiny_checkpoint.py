"""`python -m deepserve.tools.make_tiny_checkpoint`: the files it writes are the released format (deepinfer.md §2.1,
§2.14, §3, §16.3), checked from the raw files against literal expectations; the tokenizer works; the
deepseek_v4 checkpoint is read back by transformers' own loader into the same weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from deepserve.loader.deepseek_v41_weights import load_state_dict
from deepserve.models.deepseek_v41_config import DeepseekV41Config
from deepserve.models.reference.deepseek_v41 import DeepseekV41Reference
from deepserve.tokenizer import Tokenizer
from deepserve.tools.make_tiny_checkpoint import write_deepseek_v4, write_deepseek_v41, write_shards

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def v41_dir(tmp_path_factory) -> str:
    """Written through the command line, as a user would."""
    out = str(tmp_path_factory.mktemp("v41") / "tiny")
    result = subprocess.run([sys.executable, "-m", "deepserve.tools.make_tiny_checkpoint", "--arch", "deepseek_v41",
                             out], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "wrote a tiny deepseek_v41 checkpoint" in result.stdout
    return out


def headers(path: str) -> dict[str, tuple[str, list[int]]]:
    """name -> (safetensors dtype, shape), from every shard named by the index."""
    weight_map = json.load(open(os.path.join(path, "model.safetensors.index.json")))["weight_map"]
    found = {}
    for shard in set(weight_map.values()):
        with safe_open(os.path.join(path, shard), "pt") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                found[name] = (piece.get_dtype(), piece.get_shape())
    return found


def test_config_is_the_released_one(v41_dir):
    config = json.load(open(os.path.join(v41_dir, "config.json")))
    assert config["model_type"] == "deepseek_v41"
    assert config["architectures"] == ["DeepseekV41ForCausalLM"]
    assert config["dtype"] == "bfloat16"
    assert config["quantization_config"] == {"quant_method": "fp8", "expert_dtype": "fp4",
                                             "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                                             "scale_fmt": "ue8m0"}                              # §2.1
    assert DeepseekV41Config.from_hf_dict(config).vocab_size == 96


def test_shards_and_index_agree(v41_dir):
    index = json.load(open(os.path.join(v41_dir, "model.safetensors.index.json")))
    weight_map = index["weight_map"]
    shards = sorted(set(weight_map.values()))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    in_shards = {}
    for shard in shards:
        with safe_open(os.path.join(v41_dir, shard), "pt") as f:
            in_shards.update(dict.fromkeys(f.keys(), shard))
    assert in_shards == weight_map
    # total_size is the bytes of all tensor data: the shard files less their headers.
    assert index["metadata"]["total_size"] == sum(
        os.path.getsize(os.path.join(v41_dir, s)) - header_bytes(v41_dir, s) for s in shards)


def header_bytes(path: str, shard: str) -> int:
    with open(os.path.join(path, shard), "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


# The released dtype and shape of one tensor of each kind in the tiny "mixed" config (H=32, nH=4, D=32, Lq=24,
# G=2, Lo=16, I=16, E=8, Hi=2, Di=16, m=4, V=96), written out from §2.14 / §16.3.
RELEASED = {
    "embed.weight": ("BF16", [96, 32]),
    "head.weight": ("BF16", [96, 32]),
    "norm.weight": ("BF16", [32]),
    "layers.0.hc_attn_fn": ("F32", [24, 128]),
    "layers.0.hc_attn_base": ("F32", [24]),
    "layers.0.hc_ffn_scale": ("F32", [3]),
    "layers.0.attn_norm.weight": ("BF16", [32]),
    "layers.1.attn.wq_a.weight": ("F8_E4M3", [24, 32]),
    "layers.1.attn.wq_a.scale": ("F8_E8M0", [1, 1]),
    "layers.1.attn.wq_b.weight": ("F8_E4M3", [128, 24]),
    "layers.1.attn.wq_b.scale": ("F8_E8M0", [4, 1]),
    "layers.1.attn.wo_a.weight": ("F8_E4M3", [32, 64]),
    "layers.1.attn.wo_a.scale": ("F8_E8M0", [1, 2]),
    "layers.1.attn.attn_sink": ("F32", [4]),
    "layers.1.attn.compressor.wkv.weight": ("BF16", [32, 32]),
    "layers.1.attn.compressor.wgate.weight": ("BF16", [32, 32]),
    "layers.1.attn.indexer.wq_b.weight": ("F8_E4M3", [32, 24]),
    "layers.1.attn.indexer.weights_proj.weight": ("BF16", [2, 32]),
    "layers.1.attn.indexer.wk.weight": ("BF16", [16, 32]),
    "layers.1.ffn.gate.weight": ("BF16", [8, 32]),
    "layers.1.ffn.gate.bias": ("F32", [8]),
    "layers.1.ffn.shared_experts.w1.weight": ("F8_E4M3", [16, 32]),
    "layers.1.ffn.shared_experts.w2.scale": ("F8_E8M0", [1, 1]),
    "layers.1.ffn.experts.7.w1.weight": ("I8", [16, 16]),       # [I, H/2]
    "layers.1.ffn.experts.7.w1.scale": ("F8_E8M0", [16, 1]),    # [I, H/32]
    "layers.1.ffn.experts.7.w2.weight": ("I8", [32, 8]),        # [H, I/2]
    "layers.1.ffn.experts.7.w2.scale": ("F8_E8M0", [32, 1]),    # [H, ceil(I/32)]
    "mtp.0.main_proj.weight": ("F8_E4M3", [32, 64]),
    "mtp.0.markov_head.embed.weight": ("BF16", [96, 8]),
}


def test_tensors_have_the_released_dtypes_and_shapes(v41_dir):
    found = headers(v41_dir)
    for name, want in RELEASED.items():
        assert found.get(name) == want, (name, found.get(name))
    assert not any(n.startswith("model.") for n in found)
    # Layer 2 shares layer 1's compressed KV and index (§2.2): no compressor or indexer of its own.
    assert not any(n.startswith("layers.2.attn.compressor") or n.startswith("layers.2.attn.indexer") for n in found)
    # Every FP8 / FP4 weight has its scale, and nothing else does.
    for name, (dtype, _) in found.items():
        if dtype in ("F8_E4M3", "I8"):
            assert found[name[: -len(".weight")] + ".scale"][0] == "F8_E8M0", name
        if name.endswith(".scale"):
            assert found[name[: -len(".scale")] + ".weight"][0] in ("F8_E4M3", "I8"), name


def test_cli_checkpoint_loads_strictly(v41_dir):
    config = DeepseekV41Config.from_hf_dict(json.load(open(os.path.join(v41_dir, "config.json"))))
    model = DeepseekV41Reference(config)
    model.load_state_dict(load_state_dict(v41_dir, model.state_dict()), strict=True)
    with torch.inference_mode():
        assert model(torch.tensor([0, 10, 20, 30])).isfinite().all()


def test_tokenizer(v41_dir):
    tok = Tokenizer.from_pretrained(v41_dir)
    assert tok.vocab_size == 96
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)
    assert tok.token_to_id("<｜▁pad▁｜>") == 2                          # §2.1: BOS 0, EOS 1, PAD 2
    ids = tok.encode("hello World 42")
    assert ids[0] == 0 and len(ids) == 1 + len("hello World 42")      # BOS, then one id per character
    assert max(ids) < 96 and tok.decode(ids) == "hello World 42"
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert prompt == "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜>"
    assert tok.encode(prompt, add_special_tokens=False)[:2] == [0, tok.token_to_id("<｜User｜>")]
    config = json.load(open(os.path.join(v41_dir, "tokenizer_config.json")))
    assert config["eos_token"] == "<｜end▁of▁sentence｜>" and config["chat_template"]


def test_unquantized_v41_stores_bf16_and_unpacked_experts(tmp_path):
    real = write_deepseek_v41(str(tmp_path), "window", seed=3, num_shards=3, quantize=False)
    config = json.load(open(tmp_path / "config.json"))
    assert "quantization_config" not in config
    found = headers(str(tmp_path))
    assert found["layers.0.ffn.experts.1.w1.weight"] == ("BF16", [16, 32])
    assert found["layers.0.attn.wq_a.weight"] == ("BF16", [24, 32])
    assert found["layers.0.hc_attn_fn"][0] == "F32" and not any(n.endswith(".scale") for n in found)
    assert len({s for s in json.load(open(tmp_path / "model.safetensors.index.json"))["weight_map"].values()}) == 3
    model = DeepseekV41Reference(DeepseekV41Config.from_hf_dict(config))
    loaded = load_state_dict(str(tmp_path), model.state_dict())
    assert all(torch.equal(loaded[n], v) for n, v in real.items())


def test_write_shards_fills_every_shard(tmp_path):
    tensors = {f"t{i}": torch.full((100 if i == 0 else 1,), float(i)) for i in range(4)}
    weight_map = write_shards(str(tmp_path), tensors, 3)
    assert sorted(set(weight_map.values())) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert list(weight_map) == list(tensors)


# ================================================================================================ deepseek_v4


@pytest.mark.parametrize("quantize", [True, False])
def test_deepseek_v4_checkpoint_reads_back_through_transformers(tmp_path, quantize):
    """transformers reads the released V4 format through its own conversion (names) and FP8 integration
    (`.scale` E8M0, FP4 experts low nibble first, dequantize=True on CPU): it must get exactly our weights."""
    import transformers

    real = write_deepseek_v4(str(tmp_path), seed=0, quantize=quantize)
    found = headers(str(tmp_path))
    assert found["embed.weight"][0] == "BF16" and found["layers.0.hc_attn_fn"][0] == "F32"
    assert found["layers.3.ffn.experts.5.w1.weight"] == (("I8", [16, 16]) if quantize else ("BF16", [16, 32]))
    assert found["layers.3.attn.wq_a.weight"][0] == ("F8_E4M3" if quantize else "BF16")
    kwargs = {}
    if quantize:
        kwargs["quantization_config"] = transformers.FineGrainedFP8Config(
            dequantize=True, weight_block_size=[32, 32], scale_fmt="ue8m0", expert_dtype="fp4")
    model, info = transformers.DeepseekV4ForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32,
                                                                     output_loading_info=True, **kwargs)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    state = model.state_dict()
    assert set(state) == set(real)
    for name, value in real.items():
        assert torch.equal(state[name].to(value.dtype), value), name
    assert not torch.equal(real["model.layers.3.mlp.gate.e_score_correction_bias"], torch.zeros(8))
