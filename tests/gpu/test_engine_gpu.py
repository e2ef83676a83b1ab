"""The engine on a CUDA GPU gives the CPU engine's greedy tokens (same weights, fp32)."""

from __future__ import annotations

import pytest
import torch

from deepserve import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_gpu_greedy_equals_cpu(tiny_llama):
    prompts = [{"prompt_token_ids": list(range(5 + i, 40 + 3 * i))} for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    cpu = LLM(tiny_llama, skip_tokenizer_init=True, device="cpu", dtype="float32")
    gpu = LLM(tiny_llama, skip_tokenizer_init=True, device="cuda", dtype="float32")
    a = [o.outputs[0].token_ids for o in cpu.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in gpu.generate(prompts, params, use_tqdm=False)]
    assert a == b


def test_gpu_seeded_sampling_batch_invariant(tiny_llama):
    gpu = LLM(tiny_llama, skip_tokenizer_init=True, device="cuda", dtype="bfloat16")
    prompts = [{"prompt_token_ids": list(range(3, 20 + i))} for i in range(8)]
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=16, ignore_eos=True) for i in range(8)]
    batched = [o.outputs[0].token_ids for o in gpu.generate(prompts, params, use_tqdm=False)]
    alone = [gpu.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    assert batched == alone
    bm = gpu.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
