"""Steps with prompt work replayed from mixed-step CUDA graphs (worker/mixed_graph.py) give the eager engine's greedy
tokens (fp32, same weights): a dense model and a MoE one, chunked prompts beside decodes, prefix-cache hits, in-flight
decode tokens (overlapped scheduling, the GPU default)."""

from __future__ import annotations

import pytest
import torch

from deepserve import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _workload():
    g = torch.Generator().manual_seed(9)
    shared = torch.randint(3, 500, (40,), generator=g).tolist()
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (7, 130, 300)]
    prompts += [shared + torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 60, 200)]
    params = [SamplingParams(temperature=0, max_tokens=20 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    return [{"prompt_token_ids": p} for p in prompts], params


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen3_moe"])
def test_mixed_graphs_match_eager(model, request):
    path = request.getfixturevalue(model)
    prompts, params = _workload()
    kw = dict(skip_tokenizer_init=True, device="cuda", dtype="float32", kv_cache_memory_bytes=1 << 26,
              max_num_batched_tokens=512, enable_chunked_prefill=True)
    eager = LLM(path, enforce_eager=True, **kw)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    del eager
    llm = LLM(path, **kw)
    graphs = llm.engine.runner.cuda_graphs
    assert graphs is not None and sorted(graphs.mixed_graphs) == [256, 512]
    # One at a time first (each prompt's steps alone), then all at once (prompt chunks beside decodes).
    alone = [llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert alone == want and together == want
    assert graphs.num_mixed_replays >= 6 and llm.engine.block_manager.prefix_hits > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
