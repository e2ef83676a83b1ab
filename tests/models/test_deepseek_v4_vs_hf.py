"""DeepSeek-V4 (`DeepseekV4ForCausalLM`) in the engine against HF transformers' own implementation, on tiny random
configs built here (several layer-type mixes; compress rates small enough that both compressors fire on short
prompts; hash-routed first layer), written in the released V4 layout (FP8 + UE8M0, FP4 experts) and loaded back.

The reference is HF's full, no-cache forward: its cached generation agrees with it except where the indexer's
top-k meets exact ties (torch.topk orders equal scores arbitrarily, and relu makes many index scores exactly 0 when
there are few index heads). 8 index heads keep such ties away from the selections here (docs/deepseek_v4.md §3, §8)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("this transformers has no DeepseekV4ForCausalLM (needs 5.24+)", allow_module_level=True)

from deepserve import LLM, SamplingParams  # noqa: E402
from deepserve.tools.make_tiny_checkpoint import write_deepseek_v4  # noqa: E402

from hf_compare import assert_close_relative, check_mixed_batch, engine_logits, random_prompt  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

W, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
VOCAB = 96
MIXES = {
    "window_csa4_hca8": ([W, CSA, HCA, CSA], {CSA: 4, HCA: 8}, dict(rope_scaling=dict(
        type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=32, beta_slow=1))),
    "hca4_csa2": ([HCA, CSA, W], {CSA: 2, HCA: 4}, {}),
}


def hf_config(layer_types, rates, **extra):
    kw = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=len(layer_types), num_attention_heads=4,
              num_key_value_heads=1, head_dim=32, partial_rotary_factor=0.25, q_lora_rank=24, o_lora_rank=16,
              o_groups=2, moe_intermediate_size=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
              hc_mult=4, sliding_window=4, index_n_heads=8, index_head_dim=16, index_topk=3,
              max_position_embeddings=512, num_nextn_predict_layers=0, layer_types=layer_types,
              compress_rates=rates, mlp_layer_types=["hash_moe"] + ["moe"] * (len(layer_types) - 1),
              bos_token_id=0, eos_token_id=1, pad_token_id=2)
    kw.update(extra)
    return transformers.DeepseekV4Config(**kw)


def randomize(model, seed: int = 0) -> None:
    """Weights under which every part decides something (transformers inits position biases, sinks and router
    biases to zero and the hash table to expert 0): sharp pooling gates, position biases, sinks, biases, norms
    near 1, a random hash table, projections ~1/sqrt(in)."""
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
                t.copy_(torch.randn(t.shape, generator=g) * 2 / t.shape[-1] ** 0.5)


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory):
    """mix -> (checkpoint dir, HF model holding the checkpoint's dequantized weights)."""
    made = {}

    def get(mix: str):
        if mix not in made:
            types, rates, extra = MIXES[mix]
            config = hf_config(types, rates, **extra)
            path = str(tmp_path_factory.mktemp(f"v4_{mix}"))
            real = write_deepseek_v4(path, quantize=True, config=config, randomize=randomize)
            hf = transformers.DeepseekV4ForCausalLM(config).eval()
            hf.load_state_dict(real)
            made[mix] = (path, hf)
        return made[mix]
    return get


def hf_full_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids]), use_cache=False).logits[0].float()


def hf_full_greedy(hf, ids: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy decoding by HF's full forward over the whole context each step (the reference; see the docstring)."""
    tokens, logits = list(ids), []
    for _ in range(steps):
        last = hf_full_logits(hf, tokens)[-1]
        logits.append(last)
        tokens.append(int(last.argmax()))
    return tokens[len(ids):], torch.stack(logits)


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_logits_and_greedy_match_hf_full_forward(tiny_v4, mix):
    path, hf = tiny_v4(mix)
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=8)
    ids = random_prompt(37, seed=1, vocab=VOCAB)
    want = hf_full_logits(hf, ids)
    for chunk in (None, 5, 3):                # chunks split compressor windows across steps
        assert_close_relative(engine_logits(llm, ids, chunk=chunk), want)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_full_greedy(hf, ids, 32)[0]


def test_batched_with_chunking_preemption_and_prefix_hits(tiny_v4):
    path, hf = tiny_v4("window_csa4_hca8")
    probe = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=8)
    check_mixed_batch(path, hf, probe.engine.runner.kv_bytes_per_token(), greedy=hf_full_greedy, vocab=VOCAB)


def test_hash_table_loaded(tiny_v4):
    path, hf = tiny_v4("hca4_csa2")
    model = LLM(path, skip_tokenizer_init=True, dtype="float32").engine.runner.model
    assert torch.equal(model.layers[0].ffn.gate.tid2eid, hf.model.layers[0].mlp.gate.tid2eid.long())
    assert not model.layers[1].hash_routed
