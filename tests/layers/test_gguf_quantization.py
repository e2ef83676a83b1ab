"""quantization="gguf" on the default model (SmolLM2-135M Q4_1, its tied embedding Q8_0): every matrix stays packed,
and greedy decoding gives the fp32 model's tokens (numeric option (a): the same weights, sums in another order)."""

import pytest
import torch
from torch import nn

from deepserve import LLM, SamplingParams
from deepserve.config import EngineArgs
from deepserve.kernels.cpu import gguf_linear as kernel
from deepserve.layers.gguf_linear import GGUFEmbedding, GGUFLinear
from deepserve.loader.gguf_loader import default_model_path, load_gguf

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def engines():
    fp32 = LLM(max_model_len=512, seed=0)
    packed = LLM(max_model_len=512, seed=0, quantization="gguf")
    yield fp32, packed
    del fp32, packed


def test_every_matrix_is_packed(engines):
    model = engines[1].engine.runner.model
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    linears = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    assert len(linears) == 30 * 4 + 1                     # qkv, o, gate_up, down per layer; the LM head
    assert isinstance(model.embed_tokens, GGUFEmbedding) and model.embed_tokens.qtype == kernel.Q8_0
    assert model.lm_head.blocks.data_ptr() == model.embed_tokens.blocks.data_ptr()    # tied: one copy
    qkv = model.layers[0].self_attn.qkv_proj
    assert (qkv.qtype, qkv.out_features, qkv.in_features) == (kernel.Q4_1, 576 + 2 * 192, 576)


def test_packed_rows_match_the_fp32_load(engines):
    """Fused qkv (with the Q/K row un-permutation) and gate_up dequantize to exactly the fp32 model's weights."""
    fp32, packed = (e.engine.runner.model for e in engines)
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        a = fp32.layers[3].get_submodule(name).weight
        b = packed.layers[3].get_submodule(name).dequantized_weight()
        assert torch.equal(a, b), name
    ids = torch.tensor([0, 7, 49151])
    assert torch.equal(packed.embed_tokens(ids), fp32.embed_tokens(ids))


def test_greedy_tokens_equal_fp32(engines):
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    fp32, packed = (e.generate(PROMPTS, params, use_tqdm=False) for e in engines)
    for a, b in zip(fp32, packed):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_logprobs_close_to_fp32(engines):
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    a, b = (e.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0] for e in engines)
    for tok, lp in a.logprobs[0].items():
        assert abs(lp.logprob - b.logprobs[0][tok].logprob) < 1e-3


def test_gguf_needs_a_gguf_model_on_the_cpu(tmp_path, tiny_llama):
    with pytest.raises(ValueError, match="not a .gguf"):
        EngineArgs(model=tiny_llama, quantization="gguf").create_engine_config()
    args = EngineArgs(quantization="gguf")
    with pytest.raises(ValueError, match="CPU only"):
        args._check_gguf(default_model_path(), torch.device("cuda"), False)
    with pytest.raises(ValueError, match="batch-invariant"):
        args._check_gguf(default_model_path(), torch.device("cpu"), True)
    with pytest.raises(ValueError, match="quantization must be"):
        EngineArgs(quantization="q4")


def test_packed_tensors_unpermute_qk_rows():
    ckpt = load_gguf(default_model_path())
    packed = ckpt.packed_tensors((kernel.Q4_1,))
    q = packed["model.layers.0.self_attn.q_proj.weight"]
    dense = next(t for name, t in ckpt.tensors() if name == "model.layers.0.self_attn.q_proj.weight")
    assert torch.equal(kernel.dequantize(q.blocks, q.qtype, q.in_features), dense)
    assert "model.embed_tokens.weight" not in packed        # Q8_0, not asked for
