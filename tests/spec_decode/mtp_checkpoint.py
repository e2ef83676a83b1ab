"""Tiny DeepSeek-V3 checkpoints with an MTP layer (`model.layers.{N}.*`, as V3 releases hold it) for the MTP tests
(tests/spec_decode/test_spec_mtp*.py on the CPU, tests/gpu/test_spec_decode_gpu.py), and a way to make the MTP layer
draft what the target will say: a random MTP layer almost never guesses the target's argmax."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

CONFIG = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
              max_position_embeddings=256, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
              num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=32,
              qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_group=4, topk_group=2, q_lora_rank=48,
              routed_scaling_factor=2.5, tie_word_embeddings=False)
LAYERS = 2


def write_tiny_v3_mtp(path: str, seed: int = 0, **overrides):
    """A random V3 of LAYERS layers plus one MTP layer at `path`. Returns HF's model of LAYERS + 1 layers (its last
    one is the MTP layer's decoder block) and the MTP layer's own tensors (enorm, hnorm, eh_proj, shared_head)."""
    import transformers
    torch.manual_seed(seed)
    cfg = {**CONFIG, **overrides}
    config = transformers.DeepseekV3Config(**cfg, num_hidden_layers=LAYERS + 1)
    config._attn_implementation = "eager"
    full = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in full.parameters():
            if p.dim() == 2:
                p.mul_(3.0)         # logits far from uniform: greedy decoding is not decided by near-ties
    full.save_pretrained(path)
    hidden = cfg["hidden_size"]
    mtp = {"enorm.weight": 1 + 0.1 * torch.randn(hidden), "hnorm.weight": 1 + 0.1 * torch.randn(hidden),
           "eh_proj.weight": torch.randn(hidden, 2 * hidden) * 0.2,
           "shared_head.norm.weight": 1 + 0.1 * torch.randn(hidden),
           "shared_head.head.weight": torch.randn(cfg["vocab_size"], hidden) * 0.3}
    save_file({f"model.layers.{LAYERS}.{k}": v.contiguous() for k, v in mtp.items()},
              os.path.join(path, "mtp.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        saved = json.load(f)
    saved.update(num_hidden_layers=LAYERS, num_nextn_predict_layers=1)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(saved, f)
    return full, mtp


@torch.no_grad()
def bigram_mtp(model, sequences: list[list[int]], scale: float = 10.0) -> None:
    """Make a loaded model's MTP layer draft a bigram table of `sequences` (the last continuation of a token wins; a
    token the table lacks drafts itself).

    The MTP row takes (h, next token t) and drafts the token after t. eh_proj's token half maps enorm(embed(t)) to
    scale * e_t (one-hot: a pseudo-inverse of the embedding, so vocab_size <= hidden_size); its hidden half stays
    random (halved), so the target's hidden state and the block's attention over the MTP cache still move the
    confidences (from ~0.4 to ~1), but never the argmax off column t of the head, which picks next[t] (the top two
    logits stayed > 2 apart in the GPU test's run, done on the CPU: GPU rounding cannot swap them). Drafts are accepted where the
    target's greedy continuation follows the table and rejected elsewhere; drafts 2..k read the draft before them,
    so a chain drafts the table's next entries."""
    mtp = model.mtp
    vocab, hidden = model.embed_tokens.weight.shape
    assert vocab <= hidden, "the bigram MTP needs vocab_size <= hidden_size"
    nxt = {}
    for seq in sequences:
        nxt.update(zip(seq[:-1], seq[1:]))
    a = mtp.enorm(model.embed_tokens.weight.float())                    # [V, H]: row t = enorm(embed(t))
    mtp.eh_proj.weight[:, :hidden] = 0
    mtp.eh_proj.weight[:, hidden:] *= 0.5
    mtp.eh_proj.weight[:vocab, :hidden] = scale * torch.linalg.pinv(a.T)     # pinv(A^T) @ a_t = e_t
    mtp.shared_head.norm.weight.fill_(1.0)
    head = torch.zeros_like(mtp.shared_head.head.weight)
    for t in range(vocab):
        head[nxt.get(t, t), t] = 1.0      # a token the table lacks drafts itself
    mtp.shared_head.head.weight.copy_(head)

