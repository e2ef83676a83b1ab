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


# quantization="gguf_a8": the same blocks, repacked, times int8 activations (kernels/cpu/gguf_a8.c). The int8
# rounding makes a step's output move in steps: an input 1e-7 away can give logits ~1% apart (measured on this model),
# so the checks below hold it to the fp32 model's quality, not to its bits.
A8_PROMPT = "The quick brown fox jumps over the lazy dog. Then it ran into the forest, where"    # under 32 tokens


@pytest.fixture(scope="module")
def a8_engine():
    llm = LLM(max_model_len=512, seed=0, quantization="gguf_a8")
    yield llm
    del llm


def test_a8_keeps_the_files_weights_repacked(engines, a8_engine):
    fp32, a8 = engines[0].engine.runner.model, a8_engine.engine.runner.model
    linears = [m for m in a8.modules() if isinstance(m, GGUFLinear)]
    assert len(linears) == 30 * 4 + 1 and all(m.int8_activations for m in linears)
    for name in ("self_attn.qkv_proj", "mlp.down_proj"):
        a, b = fp32.layers[7].get_submodule(name).weight, a8.layers[7].get_submodule(name)
        assert torch.equal(b.dequantized_weight(), a), name
        assert not torch.equal(b.blocks, engines[1].engine.runner.model.layers[7].get_submodule(name).blocks)
    assert a8.lm_head.blocks.data_ptr() != a8.embed_tokens.blocks.data_ptr()     # the embedding keeps the file's
    assert torch.equal(a8.lm_head.dequantized_weight(), fp32.lm_head.weight if fp32.lm_head is not None
                       else fp32.embed_tokens.weight)
    stack = a8.cpu_decode.stack
    assert stack is not None and all(w.qkv.int8_activations and w.down.int8_activations for w in stack.layers)


def prompt_nll(llm, prompt):
    out = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ids = out.prompt_token_ids
    lps = [entry[ids[i]].logprob for i, entry in enumerate(out.prompt_logprobs) if entry is not None]
    return -sum(lps) / len(lps), len(ids)


def test_a8_quality_close_to_fp32(engines, a8_engine):
    """Teacher-forced mean NLL of a short prompt (every row through the int8 kernel) within 0.05 nats of the fp32
    model's, and not equal to it; greedy decoding keeps the fp32 model's first tokens."""
    (fp32_nll, n), (a8_nll, _) = prompt_nll(engines[0], A8_PROMPT), prompt_nll(a8_engine, A8_PROMPT)
    assert n < 32 and abs(a8_nll - fp32_nll) < 0.05 and a8_nll != fp32_nll
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    fp32_out, a8_out = (e.generate(PROMPTS, params, use_tqdm=False) for e in (engines[0], a8_engine))
    for a, b in zip(fp32_out, a8_out):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_a8_decode_steps_take_one_call(a8_engine):
    stack, calls = a8_engine.engine.runner.model.cpu_decode.stack, []
    real = stack.run
    stack.run = lambda *a: calls.append(a[0].shape[0]) or real(*a)
    try:
        a8_engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    finally:
        del stack.run
    assert calls == [3] * 4


TINY_HIDDEN, TINY_FFN, TINY_VOCAB = 96, 160, 64        # 3 and 5 blocks a row: odd counts, a block without a partner


def write_quantized_qwen2(path: str) -> str:
    """A 2-layer Qwen2 GGUF of random weights: Q4_1 projections (o_proj Q8_0), q/k/v biases, Q8_0 embedding and LM
    head, head_dim 32 (so the one-call decode stack applies)."""
    gguf = pytest.importorskip("gguf")
    import numpy as np
    q = gguf.GGMLQuantizationType
    rng = np.random.default_rng(0)

    def rand(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    writer = gguf.GGUFWriter(path, "qwen2")
    for add, value in ((writer.add_block_count, 2), (writer.add_context_length, 128),
                       (writer.add_embedding_length, TINY_HIDDEN), (writer.add_feed_forward_length, TINY_FFN),
                       (writer.add_head_count, 3), (writer.add_head_count_kv, 1), (writer.add_rope_freq_base, 1e4),
                       (writer.add_layer_norm_rms_eps, 1e-6), (writer.add_vocab_size, TINY_VOCAB),
                       (writer.add_bos_token_id, 1), (writer.add_eos_token_id, 2)):
        add(value)

    def matrix(name, value, qtype):
        writer.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)

    matrix("token_embd.weight", rand(TINY_VOCAB, TINY_HIDDEN) * 4, q.Q8_0)
    matrix("output.weight", rand(TINY_VOCAB, TINY_HIDDEN) * 4, q.Q8_0)
    writer.add_tensor("output_norm.weight", np.ones(TINY_HIDDEN, np.float32))
    for layer in range(2):
        p = f"blk.{layer}."
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(p + norm + ".weight", np.ones(TINY_HIDDEN, np.float32))
        for name, rows, cols, qtype in (("attn_q", 96, TINY_HIDDEN, q.Q4_1), ("attn_k", 32, TINY_HIDDEN, q.Q4_1),
                                        ("attn_v", 32, TINY_HIDDEN, q.Q4_1), ("attn_output", TINY_HIDDEN, 96, q.Q8_0),
                                        ("ffn_gate", TINY_FFN, TINY_HIDDEN, q.Q4_1),
                                        ("ffn_up", TINY_FFN, TINY_HIDDEN, q.Q4_1),
                                        ("ffn_down", TINY_HIDDEN, TINY_FFN, q.Q4_1)):
            matrix(p + name + ".weight", rand(rows, cols), qtype)
        for name, rows in (("attn_q", 96), ("attn_k", 32), ("attn_v", 32)):
            writer.add_tensor(p + name + ".bias", rand(rows) * 0.1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a8_on_odd_block_counts_biases_and_q8_0(tmp_path):
    """gguf_a8 on a model of odd block counts, q/k/v biases and Q8_0 projections: its decode steps run in the one C
    call, and its prompt NLL and greedy tokens stay the fp32 model's (NLL within 0.05 nats, not equal)."""
    path = write_quantized_qwen2(str(tmp_path / "tiny.gguf"))
    ids = [3, 17, 5, 40, 22, 9, 11, 30, 7]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    results = {}
    for quantization in (None, "gguf_a8"):
        llm = LLM(path, quantization=quantization, skip_tokenizer_init=True, max_model_len=128, seed=0)
        model, calls = llm.engine.runner.model, []
        if quantization:
            stack = model.cpu_decode.stack
            assert stack is not None and stack.layers[0].qkv.bias is not None
            assert all(w.int8_activations for layer in stack.layers for w in (layer.qkv, layer.o, layer.down))
            real = stack.run
            stack.run = lambda *a: calls.append(a[0].shape[0]) or real(*a)
        out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
        lps = [entry[ids[i]].logprob for i, entry in enumerate(out.prompt_logprobs) if entry is not None]
        results[quantization] = (-sum(lps) / len(lps), out.outputs[0].token_ids, calls)
        del llm
    (fp32_nll, fp32_tokens, _), (a8_nll, a8_tokens, a8_calls) = results[None], results["gguf_a8"]
    assert abs(a8_nll - fp32_nll) < 0.05 and a8_nll != fp32_nll
    assert a8_tokens == fp32_tokens
    assert a8_calls == [1] * 7                  # the 7 decode steps after the prefill's token
