"""Write a tiny random checkpoint in a model's released on-disk format, for tests and for trying the engine.

    python -m deepserve.tools.make_tiny_checkpoint --arch deepseek_v41 OUT_DIR [--variant mixed] [--seed 0]
    python -m deepserve.tools.make_tiny_checkpoint --arch deepseek_v4 OUT_DIR

deepseek_v41 (spec §2.14, §3, §16.3): config.json from the reference module's tiny_config plus the released
quantization_config, weights from DeepseekV41Reference + init_tiny_weights quantized the way the released model
stores them (FP8 e4m3 with E8M0 32x32 block scales, routed experts packed FP4 e2m1 with E8M0 per-32 scales, Engram
tables FP8 with per-row scales, F32 for HC / sinks / gate biases, BF16 for the rest), sharded safetensors with
model.safetensors.index.json, and a tiny tokenizer (tokenizer.json + tokenizer_config.json with a chat template)
with the release's BOS / EOS / PAD at ids 0 / 1 / 2. Quantization loses precision, so the weights the model
"really" has are the dequantized ones: write_deepseek_v41 returns them.

deepseek_v4: transformers' DeepseekV4ForCausalLM, random, in the released V4 layout as transformers reads it:
the inverse of its "deepseek_v4" checkpoint conversion (conversion_mapping.py) for the names (`embed.weight`,
`layers.0.attn.wq_a.weight`, `layers.0.ffn.experts.3.w1.weight`, ...) and FP8 / FP4 with `.scale` E8M0 tensors as
its FP8 integration reads them (`expert_dtype: fp4`). transformers' own save_pretrained is not used: its reverse
conversion is lossy for V4 (it keeps `model.embed_tokens`, `model.hc_head.*`, and names the attention kv_norm
`attn.norm`).

--unquantized writes BF16 / F32 only (experts unpacked to [out, in]) and no quantization_config (§16.1, §16.3).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import string
import sys
from collections.abc import Mapping, Sequence

import torch
from safetensors.torch import save_file

from deepserve.loader.deepseek_v41_weights import (
    ENGRAM_ROW_BLOCK, F32, FP4, FP8, FP8_ROWS, INDEX_FILE, PLAIN, released_format, scale_name)
from deepserve.loader.fp4 import dequantize_fp4, quantize_fp4
from deepserve.loader.fp8 import E8M0_BLOCK, dequantize_block_fp8_e8m0, quantize_block_fp8_e8m0

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"     # ids 0, 1, 2 (§2.1)
UNK, USER, ASSISTANT = "<unk>", "<｜User｜>", "<｜Assistant｜>"
SPECIAL_TOKENS = (BOS, EOS, PAD, UNK, USER, ASSISTANT)
TEXT_CHARS = " " + string.ascii_lowercase + string.ascii_uppercase + string.digits + string.punctuation + "\n"
# A DeepSeek-style prompt: BOS, system text, then alternating user / assistant turns; assistant turns end in EOS.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}" + USER + "{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}" + ASSISTANT + "{{ message['content'] }}{{ eos_token }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}")


# ================================================================================================ weights


def to_released(name: str, value: torch.Tensor, quantize: bool = True
                ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One model tensor -> (the checkpoint tensors that store it, the float32 value they decode to)."""
    fmt = released_format(name)
    if not quantize and fmt != F32:
        fmt = PLAIN
    if fmt == F32:
        value = value.float()
        return {name: value}, value
    if fmt == PLAIN:
        stored = value.to(torch.bfloat16)
        return {name: stored}, stored.float()
    if fmt == FP4:
        packed, scale = quantize_fp4(value)
        return {name: packed, scale_name(name): scale}, dequantize_fp4(packed, scale)
    block = ENGRAM_ROW_BLOCK if fmt == FP8_ROWS else E8M0_BLOCK
    assert fmt in (FP8, FP8_ROWS), fmt
    weight, scale = quantize_block_fp8_e8m0(value, block)
    return {name: weight, scale_name(name): scale}, dequantize_block_fp8_e8m0(weight, scale, block)


def released_checkpoint(state_dict: Mapping[str, torch.Tensor], quantize: bool = True
                        ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(stored tensors in checkpoint order, the dequantized state dict the model really has)."""
    stored, real = {}, {}
    for name, value in state_dict.items():
        tensors, real[name] = to_released(name, value.detach(), quantize)
        stored.update(tensors)
    return stored, real


def shard_names(count: int) -> list[str]:
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_shards(out_dir: str, tensors: Mapping[str, torch.Tensor], num_shards: int) -> dict[str, str]:
    """Contiguous runs of about equal bytes, one per shard, plus the index; the weight map it wrote."""
    names = list(tensors)
    if not 1 <= num_shards <= len(names):
        raise ValueError(f"num_shards must be in [1, {len(names)}], got {num_shards}")
    sizes = [tensors[n].numel() * tensors[n].element_size() for n in names]
    total, files = sum(sizes), shard_names(num_shards)
    weight_map, shard, running = {}, 0, 0
    for i, (name, size) in enumerate(zip(names, sizes)):
        # Move on once this shard has its share, keeping a tensor for every shard still to come.
        if shard < num_shards - 1 and (running >= total * (shard + 1) / num_shards
                                       or len(names) - i == num_shards - 1 - shard):
            shard += 1
        weight_map[name] = files[shard]
        running += size
    for file in files:
        part = {n: tensors[n].contiguous() for n in names if weight_map[n] == file}
        save_file(part, os.path.join(out_dir, file), metadata={"format": "pt"})
    with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return weight_map


# ================================================================================================ tokenizer


def tokenizer_vocab(vocab_size: int) -> list[str]:
    """The special tokens, then single characters in TEXT_CHARS order up to vocab_size (filler tokens beyond
    them): a smaller vocabulary drops the last punctuation marks, which then encode as <unk>."""
    vocab = list(SPECIAL_TOKENS) + list(TEXT_CHARS)
    if vocab_size < len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"vocab_size {vocab_size} leaves no room for text tokens")
    if vocab_size > len(vocab):
        vocab += [f"<｜extra_{i}｜>" for i in range(vocab_size - len(vocab))]
    return vocab[:vocab_size]


def build_tokenizer(vocab_size: int):
    """A character-level BPE (no merges) over tokenizer_vocab, BOS prepended on encode (§2.1), specials skipped
    on decode."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    vocab = tokenizer_vocab(vocab_size)
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(vocab)}, merges=[], unk_token=UNK))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.decoder = decoders.Fuse()
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B",
                                                             special_tokens=[(BOS, 0)])
    return tokenizer


def write_tokenizer(out_dir: str, vocab_size: int, model_max_length: int) -> None:
    build_tokenizer(vocab_size).save(os.path.join(out_dir, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
              "unk_token": UNK, "add_bos_token": True, "add_eos_token": False,
              "model_max_length": model_max_length, "chat_template": CHAT_TEMPLATE}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)


# ================================================================================================ architectures


def write_json(path: str, value: Mapping) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=2)


def write_deepseek_v41(out_dir: str, variant: str = "mixed", seed: int = 0, num_shards: int = 2,
                       quantize: bool = True, **overrides) -> dict[str, torch.Tensor]:
    """The tiny V4.1 checkpoint in the released format; returns the dequantized state dict (the model's real
    weights, in DeepseekV41Reference's names). `overrides` go to tiny_config."""
    from deepserve.models.deepseek_v41_config import QUANTIZATION_CONFIG, DeepseekV41Config
    from deepserve.models.reference.deepseek_v41 import DeepseekV41Reference
    from deepserve.models.reference.tiny import init_tiny_weights, tiny_config

    if quantize:
        overrides.setdefault("quantization_config", dict(QUANTIZATION_CONFIG))
    config = tiny_config(variant, **overrides)
    model = init_tiny_weights(DeepseekV41Reference(DeepseekV41Config.from_hf_dict(config)), seed)
    stored, real = released_checkpoint(model.state_dict(), quantize)
    os.makedirs(out_dir, exist_ok=True)
    write_json(os.path.join(out_dir, "config.json"), config)
    write_shards(out_dir, stored, num_shards)
    text = config["text_config"]
    write_tokenizer(out_dir, text["vocab_size"], text["max_position_embeddings"])
    return real


def deepseek_v4_tiny_config(vocab_size: int = 96):
    """A tiny transformers DeepseekV4Config: window-free V4 layer types (HCA and CSA), hash-routed MoE in the
    first layers, no MTP layer (transformers does not build one, so the checkpoint could not hold its weights)."""
    import transformers

    return transformers.DeepseekV4Config(
        vocab_size=vocab_size, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
        head_dim=32, qk_rope_head_dim=8, q_lora_rank=24, o_lora_rank=16, o_groups=2, moe_intermediate_size=16,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, hc_mult=4, sliding_window=4,
        index_n_heads=2, index_head_dim=16, index_topk=3, max_position_embeddings=256, num_nextn_predict_layers=0,
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"], bos_token_id=0, eos_token_id=1, pad_token_id=2)


def deepseek_v4_layer_mix_config(layer_types: Sequence[str], compress_rates: Mapping[str, int], **extra):
    """A tiny transformers DeepseekV4Config of the given layer types and compress rates (small rates make both
    compressors fire on short prompts), hash routing in layer 0, 8 index heads (with 2, exact ties in the indexer's
    top-k make transformers' own forwards disagree: docs/deepseek_v4.md §3)."""
    import transformers

    kw = dict(vocab_size=96, hidden_size=32, num_hidden_layers=len(layer_types), num_attention_heads=4,
              num_key_value_heads=1, head_dim=32, partial_rotary_factor=0.25, q_lora_rank=24, o_lora_rank=16,
              o_groups=2, moe_intermediate_size=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
              hc_mult=4, sliding_window=4, index_n_heads=8, index_head_dim=16, index_topk=3,
              max_position_embeddings=512, num_nextn_predict_layers=0, layer_types=list(layer_types),
              compress_rates=dict(compress_rates), mlp_layer_types=["hash_moe"] + ["moe"] * (len(layer_types) - 1),
              bos_token_id=0, eos_token_id=1, pad_token_id=2)
    kw.update(extra)
    return transformers.DeepseekV4Config(**kw)


def randomize_deepseek_v4(model, seed: int = 0, gain: float = 1.0):
    """Weights under which every part of a transformers DeepseekV4 decides something (it inits position biases,
    sinks and router biases to zero and the hash table to expert 0): sharp, position-biased pooling gates, sinks,
    biases, norms near 1, a random hash table, projections ~gain/sqrt(in). Returns the model."""
    g = torch.Generator().manual_seed(seed)
    E = model.config.n_routed_experts
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if "rotary_emb" in name:
                continue
            if name.endswith("tid2eid"):
                t.copy_(torch.randint(0, E, t.shape, generator=g))
            elif name.endswith("position_bias"):
                t.copy_(torch.randn(t.shape, generator=g))
            elif "compressor" in name and name.endswith("gate_proj.weight"):
                t.copy_(torch.randn(t.shape, generator=g) * 3 / t.shape[-1] ** 0.5)
            elif name.endswith(("sinks", "e_score_correction_bias", ".base", "hc_base")):
                t.copy_(torch.randn(t.shape, generator=g) * 0.5)
            elif name.endswith(("norm.weight", ".scale", "hc_scale")):
                t.copy_(1 + 0.1 * torch.randn(t.shape, generator=g))
            elif t.is_floating_point() and t.dim() >= 2:
                t.copy_(torch.randn(t.shape, generator=g) * gain / t.shape[-1] ** 0.5)
    return model


# transformers name -> released name: the inverse of transformers' "deepseek_v4" checkpoint conversion
# (conversion_mapping.py), which is how transformers reads a released V4 checkpoint. Applied in order.
V4_RELEASED_NAMES = (
    (r"^model\.embed_tokens\.weight$", "embed.weight"),
    (r"^lm_head\.weight$", "head.weight"),
    (r"^model\.hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"^model\.", ""),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.compressor\.position_bias$", ".compressor.ape"),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.attn_hc\.(fn|base|scale)$", r".hc_attn_\1"),
    (r"\.ffn_hc\.(fn|base|scale)$", r".hc_ffn_\1"),
    (r"\.attn\.sinks$", ".attn.attn_sink"),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.attn\.q_b_proj\.", ".attn.wq_b."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.kv_proj\.", ".wkv."),
    (r"\.gate_proj\.", ".wgate."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.shared_experts\.wgate\.", ".shared_experts.w1."),     # gate_proj became wgate two rules up
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
)
# Stored FP8 in the release: the attention projections, the indexer query and the shared experts (transformers'
# FP8 integration converts every nn.Linear but the compressor / indexer / router / head ones it keeps in BF16).
V4_FP8 = re.compile(r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)\.weight$|\.shared_experts\.w[123]\.weight$")
# Kept in float32 by transformers (_keep_in_fp32_modules_strict): stored F32.
V4_F32 = re.compile(r"hc_|attn_sink$|\.ape$|gate\.bias$|norm\.weight$")


def deepseek_v4_released_name(name: str) -> str:
    for pattern, replacement in V4_RELEASED_NAMES:
        name = re.sub(pattern, replacement, name)
    return name


def deepseek_v4_released(state_dict: Mapping[str, torch.Tensor], quantize: bool
                         ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(released tensors, transformers' state dict with the values they decode to)."""
    stored, real = {}, {}
    for name, value in state_dict.items():
        expert = re.match(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$", name)
        if expert is None:
            tensors, real[name] = v4_tensor(deepseek_v4_released_name(name), value.detach(), quantize)
        else:
            tensors, real[name] = v4_experts(int(expert.group(1)), expert.group(2), value.detach(), quantize)
        stored.update(tensors)
    return stored, real


def v4_experts(layer: int, kind: str, stacked: torch.Tensor, quantize: bool
               ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """transformers stacks the experts (gate_up_proj [E, 2I, H] = w1 over w3, down_proj [E, H, I] = w2); the
    release stores `layers.{l}.ffn.experts.{e}.w1 / w3 / w2` one by one."""
    names = ("w1", "w3") if kind == "gate_up_proj" else ("w2",)
    stored, decoded = {}, []
    for e, matrix in enumerate(stacked):
        parts = []
        for w, part in zip(names, matrix.chunk(len(names))):
            tensors, value = v4_expert(f"layers.{layer}.ffn.experts.{e}.{w}.weight", part, quantize)
            stored.update(tensors)
            parts.append(value)
        decoded.append(torch.cat(parts))
    return stored, torch.stack(decoded)


def v4_tensor(name: str, value: torch.Tensor, quantize: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    if value.is_floating_point() and V4_F32.search(name):
        return {name: value.float()}, value.float()
    if not value.is_floating_point():                      # hash routing table (tid2eid): stored as is
        return {name: value}, value
    if quantize and V4_FP8.search(name):
        weight, scale = quantize_block_fp8_e8m0(value, E8M0_BLOCK)
        return {name: weight, scale_name(name): scale}, dequantize_block_fp8_e8m0(weight, scale, E8M0_BLOCK)
    stored = value.to(torch.bfloat16)
    return {name: stored}, stored.float()


def v4_expert(name: str, value: torch.Tensor, quantize: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    if not quantize:
        stored = value.to(torch.bfloat16)
        return {name: stored}, stored.float()
    packed, scale = quantize_fp4(value)
    return {name: packed, scale_name(name): scale}, dequantize_fp4(packed, scale)


V4_QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                          "weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4"}


def write_deepseek_v4(out_dir: str, seed: int = 0, num_shards: int = 2, quantize: bool = True, config=None,
                      randomize=None) -> dict[str, torch.Tensor]:
    """transformers' tiny DeepseekV4ForCausalLM, random, in the released V4 layout (see V4_RELEASED_NAMES):
    FP8 + E8M0 32x32 scales and FP4 experts when `quantize`, else BF16 / F32. Returns the state dict, in
    transformers' names, holding the values the checkpoint decodes to."""
    import transformers

    torch.manual_seed(seed)
    config = config or deepseek_v4_tiny_config()
    model = transformers.DeepseekV4ForCausalLM(config).eval()
    if randomize is not None:               # the caller's own weight recipe (a test's)
        randomize(model)
    else:
        with torch.no_grad():
            # transformers inits sinks and router biases to zero and the hash table to expert 0: make them matter.
            for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
                if name.endswith("e_score_correction_bias") or name.endswith("sinks"):
                    tensor.normal_(0.0, 0.3)
                elif name.endswith("tid2eid"):
                    tensor.copy_(torch.randint(0, config.n_routed_experts, tensor.shape))
    stored, real = deepseek_v4_released(model.state_dict(), quantize)
    os.makedirs(out_dir, exist_ok=True)
    hf_config = config.to_dict()
    hf_config["dtype"] = "bfloat16"
    hf_config["architectures"] = ["DeepseekV4ForCausalLM"]
    if quantize:
        hf_config["quantization_config"] = dict(V4_QUANTIZATION_CONFIG)
    write_json(os.path.join(out_dir, "config.json"), hf_config)
    write_shards(out_dir, stored, num_shards)
    write_tokenizer(out_dir, config.vocab_size, config.max_position_embeddings)
    return real


# ================================================================================================ command line


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m deepserve.tools.make_tiny_checkpoint", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--arch", choices=("deepseek_v41", "deepseek_v4"), required=True)
    parser.add_argument("--variant", default="mixed", help="deepseek_v41: a tiny_config variant (default mixed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shards", type=int, default=2, help="number of safetensors shards (default 2)")
    parser.add_argument("--unquantized", action="store_true", help="BF16 / F32 weights, no quantization_config")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.arch == "deepseek_v41":
        weights = write_deepseek_v41(args.out_dir, args.variant, args.seed, args.shards, not args.unquantized)
    else:
        weights = write_deepseek_v4(args.out_dir, args.seed, args.shards, not args.unquantized)
    print(f"wrote a tiny {args.arch} checkpoint ({len(weights)} tensors) to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
