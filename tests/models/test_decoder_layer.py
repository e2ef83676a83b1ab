"""DecoderLayer's one-row path (the batch-1 GPU decode: norms in the projections' prologues, residual adds in their
epilogues, the stream itself passed from layer to layer) against its usual path, on the CPU: forced on, every fused
kernel declines and each step falls back to the module calls, so the two paths must give the same tokens and the
same logprobs. Kernels that do fuse are tested on the GPU (tests/gpu/test_gemv.py, test_qkv_rotary.py).

Also a MoE layer's output handed on uncombined (DEEPSERVE_MOE_COMBINE_IN_NORM): the next layer's norm, the final norm
after the rows to sample are picked, and a dense layer between MoE layers all take it; the GPU kernel that sums it
inside the norm is tested in tests/gpu/test_elementwise_kernels.py and through the engine in
tests/gpu/test_engine_gpu.py."""

import pytest
import torch

from deepserve import LLM, SamplingParams
from deepserve.kernels.reference.moe import PairRows, expert_swiglu
from deepserve.models import base


def _greedy(path, **kw):
    llm = LLM(path, dtype="float32", device="cpu", skip_tokenizer_init=True, max_model_len=128, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    out = llm.generate([{"prompt_token_ids": [3, 17, 99, 5]}], params)[0].outputs[0]
    return out.token_ids, list(out.logprobs)


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen3"])
def test_one_row_path_equals_the_usual_path(model, request, monkeypatch):
    path = request.getfixturevalue(model)
    tokens, logprobs = _greedy(path)
    taken = []

    def one_row(x):
        if x.shape[0] == 1:
            taken.append(1)
        return x.shape[0] == 1

    monkeypatch.setattr(base, "one_row_on_gpu", one_row)
    tokens_fused, logprobs_fused = _greedy(path)
    assert taken, "the one-row path was never taken"
    assert tokens_fused == tokens
    assert logprobs_fused == logprobs


class UncombinedTorchMoE:
    """The CPU stand-in for TritonMoE's combine=False: each (token, slot) pair's expert output times its weight,
    rounded to the activation dtype (as the GPU kernels write them), handed back as PairRows when asked, combined
    (PairRows.combined, the combine kernel's twin) when not."""

    defers_combine = True

    def __init__(self) -> None:
        self.calls = {True: 0, False: 0}       # combine -> calls

    def forward(self, x, w13, w2, topk_weights, topk_ids, swiglu_limit=None, shared_out=None, shared_experts=None,
                combine=True):
        if shared_experts is not None:
            shared_out = shared_experts(x)
        k = topk_ids.shape[1]
        rows = torch.cat([expert_swiglu(x[p // k:p // k + 1], w13[e], w2[e], swiglu_limit)
                          for p, e in enumerate(topk_ids.reshape(-1).tolist())]) if topk_ids.numel() else x[:0]
        pairs = PairRows((rows.float() * topk_weights.reshape(-1, 1).float()).to(x.dtype), k, shared_out)
        self.calls[combine] += 1
        return pairs.combined() if combine else pairs


def _moe_greedy(path, backend):
    llm = LLM(path, dtype="float32", device="cpu", skip_tokenizer_init=True, max_model_len=128, block_size=8)
    for layer in llm.engine.runner.model.moe_layers():
        layer.backend = backend
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": [3, 17, 99, 5]}, {"prompt_token_ids": list(range(20, 39))}]
    return [(o.outputs[0].token_ids, list(o.outputs[0].logprobs)) for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v2"])
def tiny_moe_path(request, tmp_path_factory):
    """Qwen3-MoE with a dense layer between two MoE layers; DeepSeek-V2 with shared experts after a dense layer.
    Both end in a MoE layer, so the final norm takes the uncombined rows too."""
    import transformers
    from tests.models.hf_compare import save_tiny, save_tiny_deepseek
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "deepseek_v2":
        return save_tiny_deepseek(path, 2, vocab_size=512)
    cfg = transformers.Qwen3MoeConfig(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=16, max_position_embeddings=256, num_hidden_layers=3,
                                      intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                                      num_experts_per_tok=2, mlp_only_layers=[1])
    return save_tiny(path, cfg, transformers.Qwen3MoeForCausalLM)


def test_moe_output_handed_on_uncombined_equals_the_combined_one(tiny_moe_path, monkeypatch):
    combined_backend = UncombinedTorchMoE()
    want = _moe_greedy(tiny_moe_path, combined_backend)
    assert combined_backend.calls[False] == 0 and combined_backend.calls[True] > 0
    monkeypatch.setenv("DEEPSERVE_MOE_COMBINE_IN_NORM", "1")
    deferring = UncombinedTorchMoE()
    got = _moe_greedy(tiny_moe_path, deferring)
    assert deferring.calls[True] == 0 and deferring.calls[False] == combined_backend.calls[True]
    assert got == want
