"""DSpark drafting (DeepSeek-V4.1's draft blocks) on a CUDA GPU: greedy output with drafts equals the GPU engine's
output without them, and drafts are both accepted and rejected (the tiny model's Markov head is made a bigram table
of the target's own continuations, as in tests/spec_decode/test_dspark.py); the target's decode steps replay CUDA
graphs, and their drafts equal those of the same engine run eagerly."""

from __future__ import annotations

import pytest
import torch

from deepserve import LLM, SamplingParams
from tests.spec_decode.draft_recording import recording
from tests.spec_decode.test_dspark import bigram_drafter, prompts, tiny_dspark  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_dspark_greedy_on_the_gpu_equals_plain_decoding(tiny_dspark):  # noqa: F811
    path, _ = tiny_dspark("mixed")
    ps = [{"prompt_token_ids": p} for p in prompts()]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(skip_tokenizer_init=True, device="cuda", dtype="float32", block_size=8, kv_cache_memory_bytes=1 << 26)
    want = [o.outputs[0].token_ids for o in LLM(path, **kw).generate(ps, params, use_tqdm=False)]
    drafts = []
    for eager in (False, True):
        llm = LLM(path, speculative_config={"method": "dspark", "num_speculative_tokens": 4}, enforce_eager=eager,
                  **kw)
        bigram_drafter(llm.engine.runner.model, [p["prompt_token_ids"] + w for p, w in zip(ps, want)])
        drafts.append(recording(llm))
        got = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
        assert got == want
        stats = llm.engine.get_stats()
        assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
        graphs = llm.engine.runner.cuda_graphs
        assert (graphs is None) if eager else (graphs is not None and graphs.num_replays > 5)
    replayed, eager_made = ({(seq_id, pos): tokens for seq_id, pos, tokens, _ in made} for made in drafts)
    assert replayed == eager_made
