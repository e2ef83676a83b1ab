"""Prompt-lookup speculation on tiny DeepSeek-V4.1 checkpoints (paged compressed KV, indexer, YOCO split, sharing
maps): greedy tokens identical to the plain reference forward (deepserve/models/reference, the oracle, re-run on the
whole context each step), alone and batched. Rejected drafts write compressor and window state at positions the
next step overwrites; a wrong rewind would show here as a different token."""

from __future__ import annotations

import random

import pytest
import torch

from deepserve import LLM, SamplingParams
from deepserve.models.deepseek_v41_config import DeepseekV41Config
from deepserve.models.reference.deepseek_v41 import DeepseekV41Reference
from deepserve.models.reference.tiny import tiny_config
from deepserve.tools.make_tiny_checkpoint import write_deepseek_v41

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 96


def reference_greedy(ref: DeepseekV41Reference, ids: list[int], steps: int) -> list[int]:
    tokens = list(ids)
    with torch.inference_mode():
        for _ in range(steps):
            tokens.append(int(ref(torch.tensor(tokens))[-1].argmax()))
    return tokens[len(ids):]


def repetitive_prompt(seed: int, length: int = 29) -> list[int]:
    """Random tokens with a phrase repeated, so prompt lookup has matches to propose."""
    rng = random.Random(seed)
    phrase = [rng.randrange(VOCAB) for _ in range(6)]
    ids = [rng.randrange(VOCAB) for _ in range(length - 12)]
    return ids[:5] + phrase + ids[5:] + phrase


@pytest.mark.parametrize("variant", ["mixed", "c2"])
def test_greedy_matches_reference_with_drafts(tmp_path, variant):
    real = write_deepseek_v41(str(tmp_path), variant, quantize=True)
    ref = DeepseekV41Reference(DeepseekV41Config.from_hf_dict(tiny_config(variant))).eval()
    ref.load_state_dict(real)
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, dtype="float32", block_size=8,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    prompts = [repetitive_prompt(s) for s in range(3)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    alone = llm.generate({"prompt_token_ids": prompts[0]}, params, use_tqdm=False)[0]
    want = [reference_greedy(ref, p, 24) for p in prompts]
    assert [o.outputs[0].token_ids for o in batched] == want
    assert alone.outputs[0].token_ids == want[0]
    stats = llm.engine.get_stats()
    assert stats.spec_decode_num_draft_tokens > 0 and stats.spec_decode_num_accepted_tokens > 0
    assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens    # rejections happened too
