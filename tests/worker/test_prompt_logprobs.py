"""Prompt logprobs are computed a slice of rows at a time (worker/prompt_logprobs.PROMPT_LOGPROB_ROWS bounds a
step's largest buffer): the values must still be HF transformers' log-softmax at every prompt position, across slice and
prefill-chunk boundaries."""

from __future__ import annotations

import pytest
import torch

from deepserve import LLM, SamplingParams
from deepserve.worker import prompt_logprobs


@pytest.mark.parametrize("slice_rows", [7, 512])
def test_prompt_logprobs_match_hf_across_slices_and_chunks(tiny_llama, monkeypatch, slice_rows):
    import transformers

    monkeypatch.setattr(prompt_logprobs, "PROMPT_LOGPROB_ROWS", slice_rows)
    prompt = [(7 * i + 3) % 500 + 1 for i in range(40)]
    # 16-token steps: the prompt arrives in three chunks, and a 7-row slice crosses each chunk's end.
    llm = LLM(tiny_llama, skip_tokenizer_init=True, dtype="float32", max_num_batched_tokens=16,
              enable_chunked_prefill=True, enable_prefix_caching=False)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2),
                       use_tqdm=False)[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        want = expected[pos - 1]
        assert entry[prompt[pos]].logprob == pytest.approx(want[prompt[pos]].item(), abs=1e-4)
        top = want.topk(2).indices.tolist()
        assert set(top) <= set(entry), f"position {pos}: top-2 {top} missing from {sorted(entry)}"
