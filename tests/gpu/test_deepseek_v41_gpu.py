"""DeepSeek-V4.1 and V4 on a CUDA GPU against the plain reference forward on the CPU (same weights, fp32): the
engine's GPU path (its Triton kernels where they apply, decode steps replayed from CUDA graphs) computes the same
logits and greedy tokens."""

from __future__ import annotations

import pytest
import torch

from deepserve import LLM, SamplingParams
from deepserve.models.deepseek_v41_config import DeepseekV41Config
from deepserve.models.reference.deepseek_v41 import DeepseekV41Reference
from deepserve.models.reference.tiny import tiny_config
from deepserve.tools.make_tiny_checkpoint import write_deepseek_v41

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("variant", ["mixed", "shared", "engram", "unshifted", "c2"])
def test_gpu_matches_reference(tmp_path, variant):
    real = write_deepseek_v41(str(tmp_path), variant, quantize=True)
    ref = DeepseekV41Reference(DeepseekV41Config.from_hf_dict(tiny_config(variant))).eval()
    ref.load_state_dict(real)
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, device="cuda", dtype="float32", block_size=8,
              kv_cache_memory_bytes=1 << 26, enable_prefix_caching=True)
    prompts = [torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (37, 9, 21)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for ids, out in zip(prompts, outs):
        tokens = list(ids)
        with torch.inference_mode():
            for _ in range(24):
                tokens.append(int(ref(torch.tensor(tokens))[-1].argmax()))
        assert out.outputs[0].token_ids == tokens[len(ids):]
    assert llm.engine.runner.cuda_graphs is not None and llm.engine.runner.cuda_graphs.num_replays > 0


def _reference_greedy(ref: DeepseekV41Reference, ids: list[int], steps: int) -> list[int]:
    tokens = list(ids)
    with torch.inference_mode():
        for _ in range(steps):
            tokens.append(int(ref(torch.tensor(tokens))[-1].argmax()))
    return tokens[len(ids):]


@pytest.mark.parametrize("variant", ["mixed", "engram", "unshifted"])
def test_decode_graphs_across_context_buckets_match_reference(tmp_path, monkeypatch, variant):
    """Context buckets of 32 / 64 / 128 keys (the later two captured when a step first needs them): three sequences
    padded to a captured size of 4 cross them while decoding; every token equals the reference's, and the
    padding rows' writes (the scratch block) leave every block free."""
    import deepserve.worker.cuda_graph as cuda_graph
    monkeypatch.setattr(cuda_graph, "context_buckets", lambda max_model_len: [32, 64, max_model_len])
    real = write_deepseek_v41(str(tmp_path), variant, quantize=True)
    ref = DeepseekV41Reference(DeepseekV41Config.from_hf_dict(tiny_config(variant))).eval()
    ref.load_state_dict(real)
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, device="cuda", dtype="float32", block_size=8,
              max_model_len=128, max_num_seqs=8, kv_cache_memory_bytes=1 << 26)
    graphs = llm.engine.runner.cuda_graphs
    assert graphs is not None and graphs.buckets == [32, 64, 128]
    prompts = [torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (37, 9, 21)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    for ids, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == _reference_greedy(ref, ids, 30)
    assert graphs.num_replays >= 25
    assert {bucket for _, bucket in graphs.graphs} == {32, 64, 128}
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
