"""DecoderLayer's one-row path (the batch-1 GPU decode: norms in the projections' prologues, residual adds in their
epilogues, the stream itself passed from layer to layer) against its usual path, on the CPU: forced on, every fused
kernel declines and each step falls back to the module calls, so the two paths must give the same tokens and the
same logprobs. Kernels that do fuse are tested on the GPU (tests/gpu/test_gemv.py, test_qkv_rotary.py)."""

import pytest

from deepserve import LLM, SamplingParams
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
