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
from deepserve.tools.make_tiny_checkpoint import (deepseek_v4_layer_mix_config, randomize_deepseek_v4,  # noqa: E402
                                                 write_deepseek_v4)

from hf_compare import assert_close_relative, check_mixed_batch_two_pools, engine_logits, random_prompt  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

W, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
VOCAB = 96
MIXES = {
    "window_csa4_hca8": ([W, CSA, HCA, CSA], {CSA: 4, HCA: 8}, dict(rope_scaling=dict(
        type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=32, beta_slow=1))),
    "hca4_csa2": ([HCA, CSA, W], {CSA: 2, HCA: 4}, {}),
}


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory):
    """mix -> (checkpoint dir, HF model holding the checkpoint's dequantized weights)."""
    made = {}

    def get(mix: str):
        if mix not in made:
            types, rates, extra = MIXES[mix]
            config = deepseek_v4_layer_mix_config(types, rates, **extra)
            path = str(tmp_path_factory.mktemp(f"v4_{mix}"))
            # gain 2: logits far from uniform, so greedy decoding is not decided by near-ties.
            real = write_deepseek_v4(path, quantize=True, config=config,
                                     randomize=lambda m: randomize_deepseek_v4(m, gain=2.0))
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
    """Window 4, CSA 4 (span 8) and HCA 8: the window pool keeps 7 positions back; 9 window blocks (a 24-token step
    needs up to 6) and 16 main blocks both run out."""
    path, hf = tiny_v4("window_csa4_hca8")
    check_mixed_batch_two_pools(path, hf, hf_full_greedy, VOCAB, window_blocks=9)


def test_hash_table_loaded(tiny_v4):
    path, hf = tiny_v4("hca4_csa2")
    model = LLM(path, skip_tokenizer_init=True, dtype="float32").engine.runner.model
    assert torch.equal(model.layers[0].ffn.gate.tid2eid, hf.model.layers[0].mlp.gate.tid2eid.long())
    assert not model.layers[1].hash_routed
