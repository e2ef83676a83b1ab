"""DeepSeek-V3 MTP drafting: a tiny V3 checkpoint with an MTP layer (`model.layers.{N}.*`, as V3 releases hold it),
against a plain reference written from the formula in deepserve/models/deepseek_mtp.py with HF transformers' own
modules: the trunk's final hidden states from HF's DeepseekV3 model, the MTP block run by HF's DeepseekV3DecoderLayer.
Every draft the engine makes (paged MTP cache, chunked prefill, verification steps, batching) equals the reference's
argmax at its position with the reference's probability, and greedy output equals HF's greedy decoding."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from deepserve import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
              max_position_embeddings=256, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
              num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=32,
              qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_group=4, topk_group=2, q_lora_rank=48,
              routed_scaling_factor=2.5, tie_word_embeddings=False)
LAYERS = 2


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class Reference:
    """HF's trunk (LAYERS layers) + the MTP layer through HF's decoder layer, whole sequence, no cache."""

    def __init__(self, trunk, block, rotary, mtp: dict[str, torch.Tensor]) -> None:
        self.trunk, self.block, self.rotary, self.w = trunk, block, rotary, mtp

    @torch.no_grad()
    def greedy(self, ids: list[int], steps: int) -> list[int]:
        tokens = list(ids)
        for _ in range(steps):
            tokens.append(int(self.trunk(torch.tensor([tokens])).logits[0, -1].argmax()))
        return tokens[len(ids):]

    @torch.no_grad()
    def mtp_probs(self, tokens: list[int]) -> torch.Tensor:
        """Row q: the MTP distribution of token q + 2 given tokens[: q + 2]."""
        ids = torch.tensor([tokens])
        h = self.trunk.model(ids).last_hidden_state[0, :-1]                  # final (normed) hidden, q = 0..L-2
        e = self.trunk.model.embed_tokens(ids)[0, 1:]                         # token q + 1
        x = torch.cat([rms(e, self.w["enorm.weight"]), rms(h, self.w["hnorm.weight"])], -1) @ self.w["eh_proj.weight"].T
        n = x.shape[0]
        pos = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        y = self.block(x[None], attention_mask=mask, position_ids=pos, position_embeddings=self.rotary(x[None], pos))
        y = y[0] if isinstance(y, tuple) else y
        logits = rms(y[0], self.w["shared_head.norm.weight"]) @ self.w["shared_head.head.weight"].T
        return torch.softmax(logits.float(), -1)


@pytest.fixture(scope="module")
def tiny_v3_mtp(tmp_path_factory):
    import transformers
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**CONFIG, num_hidden_layers=LAYERS + 1)
    config._attn_implementation = "eager"
    full = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in full.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    path = str(tmp_path_factory.mktemp("v3_mtp"))
    full.save_pretrained(path)
    hidden = CONFIG["hidden_size"]
    mtp = {"enorm.weight": 1 + 0.1 * torch.randn(hidden), "hnorm.weight": 1 + 0.1 * torch.randn(hidden),
           "eh_proj.weight": torch.randn(hidden, 2 * hidden) * 0.2,
           "shared_head.norm.weight": 1 + 0.1 * torch.randn(hidden),
           "shared_head.head.weight": torch.randn(CONFIG["vocab_size"], hidden) * 0.3}
    save_file({f"model.layers.{LAYERS}.{k}": v.contiguous() for k, v in mtp.items()}, os.path.join(path, "mtp.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(num_hidden_layers=LAYERS, num_nextn_predict_layers=1)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    trunk_config = transformers.DeepseekV3Config(**CONFIG, num_hidden_layers=LAYERS)
    trunk_config._attn_implementation = "eager"
    trunk = transformers.DeepseekV3ForCausalLM(trunk_config).eval()
    trunk.load_state_dict({k: v for k, v in full.state_dict().items() if f"layers.{LAYERS}." not in k})
    return path, Reference(trunk, full.model.layers[LAYERS], full.model.rotary_emb, mtp)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_mtp_drafts_match_the_reference_and_greedy_matches_hf(tiny_v3_mtp, device):
    path, ref = tiny_v3_mtp
    extra = {"kv_cache_memory_bytes": 1 << 26} if device == "cuda" else {}
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=8, max_num_batched_tokens=24, device=device,
              speculative_config={"method": "mtp", "num_speculative_tokens": 1}, **extra)
    drafts: list[tuple[int, int, int, float]] = []          # (seq_id, position, token, confidence)
    take = llm.engine.speculator.take_model_drafts

    def record(made):
        drafts.extend((seq_id, d.position, d.token_id, d.confidence) for seq_id, d in made.items())
        take(made)
    llm.engine.speculator.take_model_drafts = record
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, CONFIG["vocab_size"], (n,), generator=gen).tolist() for n in (13, 30, 7)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for o, p in zip(outs, prompts):
        assert o.outputs[0].token_ids == ref.greedy(p, 20)
    # Drafts by sequence: seq ids are 1, 2, 3 in request order (one sequence each).
    finals = {i + 1: p + o.outputs[0].token_ids for i, (p, o) in enumerate(zip(prompts, outs))}
    checked = 0
    for seq_id, position, token, confidence in drafts:
        tokens = finals[seq_id]
        if position >= len(tokens):
            continue                                  # drafted past the last token kept (max_tokens)
        probs = ref.mtp_probs(tokens[:position])[position - 2]
        assert token == int(probs.argmax()), (seq_id, position)
        assert confidence == pytest.approx(float(probs.max()), abs=1e-4)
        checked += 1
    assert checked >= 40
    stats = llm.engine.get_stats()
    assert stats.spec_decode_num_draft_tokens > 0


def test_mtp_needs_an_mtp_checkpoint_and_one_draft(tiny_v3_mtp, tiny_llama):
    path, _ = tiny_v3_mtp
    with pytest.raises(ValueError, match="num_speculative_tokens must be 1"):
        LLM(path, skip_tokenizer_init=True, speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="MTP layers"):
        LLM(tiny_llama, skip_tokenizer_init=True, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
