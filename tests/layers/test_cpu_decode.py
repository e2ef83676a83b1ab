"""CPU decode steps of the default model in one C call (layers/cpu_decode.py), GGUF-packed and dequantized (fp32),
against the layer-by-layer module path: the same greedy tokens, logprobs within float noise; where the kernel does
not apply, the module path."""

import pytest
import torch

from deepserve import LLM, SamplingParams
from deepserve.kernels.cpu import llama_decode
from deepserve.layers.cpu_decode import build_stack

pytestmark = pytest.mark.skipif(llama_decode.library() is None, reason="no C compiler or DEEPSERVE_CPU_KERNELS=0")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def packed():
    llm = LLM(max_model_len=512, seed=0, quantization="gguf")
    yield llm
    del llm


def generate(llm, enabled, **params):
    fused = llm.engine.runner.model.cpu_decode
    fused.enabled = enabled
    try:
        return llm.generate(PROMPTS, SamplingParams(temperature=0.0, ignore_eos=True, **params), use_tqdm=False)
    finally:
        fused.enabled = True


def test_decode_steps_take_one_call(packed):
    fused = packed.engine.runner.model.cpu_decode
    generate(packed, True, max_tokens=2)
    stack, calls = fused.stack, []
    assert stack is not None
    real = stack.run
    stack.run = lambda *a: calls.append(a[0].shape[0]) or real(*a)
    try:
        generate(packed, True, max_tokens=9)
    finally:
        del stack.run
    assert calls == [3] * 8                 # the prefill steps go layer by layer, the 8 decode steps of 3 rows don't


def test_same_tokens_as_layer_by_layer(packed):
    one_call, by_layer = (generate(packed, on, max_tokens=24, logprobs=3) for on in (True, False))
    for a, b in zip(one_call, by_layer):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for tok, lp in step_b.items():
                assert abs(step_a[tok].logprob - lp.logprob) < 1e-4


def test_rebuilt_for_new_caches(packed):
    fused = packed.engine.runner.model.cpu_decode
    first = fused.stack
    attn = packed.engine.runner.model.layers[0].self_attn.attn
    old = attn.kv_cache
    attn.kv_cache = old.clone()
    try:
        second = fused.stack
        assert second is not None and second is not first
        assert second.layers[0].kv_cache is attn.kv_cache
    finally:
        attn.kv_cache = old
    assert fused.stack.layers[0].kv_cache is old


@pytest.mark.parametrize("rows", [1, 3, 6])          # 6: llama_decode.c's f32_gemv takes inputs four at a time
def test_float32_model_same_tokens_as_layer_by_layer(smollm, rows):
    """The dequantized (fp32) default model: its float32 Linears go to the stack too (f32_gemv), with the module
    path's greedy tokens and its logprobs within float noise."""
    fused = smollm.engine.runner.model.cpu_decode
    calls = []
    generate(smollm, True, max_tokens=2)
    stack = fused.stack
    assert stack is not None and stack.layers[0].qkv.qtype == llama_decode.F32
    real = stack.run
    stack.run = lambda *a: calls.append(a[0].shape[0]) or real(*a)
    try:
        prompts = (PROMPTS * 2)[:rows]
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=16, logprobs=3)
        outs = {}
        for on in (True, False):
            fused.enabled = on
            outs[on] = smollm.generate(prompts, params, use_tqdm=False)
    finally:
        fused.enabled = True
        del stack.run
    assert calls and set(calls) == {rows}
    for a, b in zip(outs[True], outs[False]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for tok, lp in step_b.items():
                assert abs(step_a[tok].logprob - lp.logprob) < 1e-4


def test_int8_model_equals_its_fp32_path(default_model_path):
    """quantization="int8": its Int8Linears go to the stack (i8_gemv, fp32 activations). The module path computes
    the same with the layers' few-row path set to fp32 (the dequantized int8 weight, exact activations; the LM head
    too, in both runs): same greedy tokens, logprobs within float noise."""
    from deepserve.layers.quantization import FP32_PLAN, Int8Linear
    llm = LLM(default_model_path, max_model_len=512, seed=0, quantization="int8")
    for m in llm.engine.runner.model.modules():
        if isinstance(m, Int8Linear):
            m.set_plan(FP32_PLAN)
    stack = llm.engine.runner.model.cpu_decode
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12, logprobs=3)
    one_call = llm.generate(PROMPTS, params, use_tqdm=False)
    assert stack.stack is not None and stack.stack.layers[0].qkv.qtype == llama_decode.I8
    stack.enabled = False
    by_layer = llm.generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(one_call, by_layer):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for tok, lp in step_b.items():
                assert abs(step_a[tok].logprob - lp.logprob) < 1e-4


def test_refused_where_it_does_not_apply(packed, smollm):
    float_layers = list(smollm.engine.runner.model.layers)
    assert isinstance(build_stack(float_layers), llama_decode.DecodeStack)      # float32 Linears: taken
    o_proj = float_layers[2].self_attn.o_proj
    o_proj.batch_invariant = True                       # batch-invariant mode's product: not the kernel's
    try:
        with pytest.raises(ValueError, match="layer 2: .*not GGUF-packed, a float32 Linear or an Int8Linear"):
            build_stack(float_layers)
    finally:
        o_proj.batch_invariant = False
    layers = list(packed.engine.runner.model.layers)
    mlp = layers[5].mlp
    mlp.swiglu_limit = 7.0                                              # not what the C step computes
    try:
        with pytest.raises(ValueError, match="layer 5: .*SwiGLU limit"):
            build_stack(layers)
    finally:
        mlp.swiglu_limit = None
    assert isinstance(build_stack(layers), llama_decode.DecodeStack)
    assert torch.is_tensor(layers[0].self_attn.attn.kv_cache)
