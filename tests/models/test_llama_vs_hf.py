"""Engine logits and greedy tokens against HF transformers on the same weights."""

from __future__ import annotations


import pytest
import torch

from hf_compare import assert_close_relative, engine_logits, hf_greedy

from deepserve import LLM, SamplingParams


@pytest.mark.parametrize("kind", ["tiny_llama", "tiny_qwen3", "tiny_qwen2"])
def test_tiny_models_match_hf(kind, request):
    import transformers

    path = request.getfixturevalue(kind)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=8)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (37,), generator=gen).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert_close_relative(engine_logits(llm, ids), ref, 1e-4)
    assert_close_relative(engine_logits(llm, ids, chunk=5), ref, 1e-4)   # paged prefix + chunks

    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, ids, 32)[0]


def test_default_gguf_model_matches_hf(smollm, hf_smollm):
    tok = smollm.get_tokenizer()
    ids = tok.encode("The capital of France is Paris. The capital of Germany is")
    with torch.no_grad():
        ref = hf_smollm(torch.tensor([ids])).logits[0]
    assert_close_relative(engine_logits(smollm, ids), ref, 1e-4)
    out = smollm.generate({"prompt_token_ids": ids},
                          SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf_smollm, ids, 32)[0]
