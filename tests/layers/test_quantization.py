"""Weight-only int8: close to the fp32 layer on both of its paths (int8 kernel for few rows, dequant for many)."""

import pytest
import torch
from torch import nn

from deepserve.layers.quantization import Int8Linear, quantize_model


@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("activations", [False, True])
def test_int8_linear_close_to_fp32(rows, activations):
    torch.manual_seed(0)
    lin = nn.Linear(96, 160, bias=True)
    q = Int8Linear(lin.weight, lin.bias, quantize_activations=activations)
    x = torch.randn(rows, 96)
    ref = lin(x)
    err = (q(x) - ref).norm() / ref.norm()
    assert err < 0.03, err      # int8 weights (+ bf16 or per-token int8 activations)


def test_quantize_model_replaces_linears_and_ties_lm_head(tiny_qwen3):
    from deepserve import LLM, SamplingParams

    exact = LLM(tiny_qwen3, skip_tokenizer_init=True)
    quant = LLM(tiny_qwen3, skip_tokenizer_init=True, quantization="int8")
    model = quant.engine.runner.model
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.lm_head, Int8Linear)
    prompt = {"prompt_token_ids": list(range(3, 40))}
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    a = exact.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    b = quant.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert a.token_ids == b.token_ids
    for tok, lp in a.logprobs[0].items():
        assert abs(lp.logprob - b.logprobs[0].get(tok, lp).logprob) < 0.1


def test_unknown_quantization_rejected():
    with pytest.raises(ValueError, match="quantization"):
        quantize_model(nn.Linear(2, 2), "int4")
