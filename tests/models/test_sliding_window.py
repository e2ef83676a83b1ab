"""Sliding-window attention (Mistral v0.1, Qwen2 / Qwen3 with `use_sliding_window`, Mixtral and Qwen3-MoE configs with
a window) against HF transformers, which masks key j from query i unless i - window < j <= i. The windows here (12
keys) are far shorter than the contexts (up to 69 tokens), cross block boundaries (blocks of 8) and the prompt chunks,
so every path that reads the cache is covered: prefill whole and chunked over a cached prefix, batched decode beside
prompt chunks, preemption and prefix-cache hits, the CPU's C decode kernel, its fused decode stack, the PyTorch
fallback, batch-invariant mode, speculative decoding's verify rows, and the GPU backend's dispatch (its kernels'
PyTorch twins)."""

import pytest
import torch
import transformers

from deepserve import LLM, SamplingParams
from deepserve.models.base import layer_windows
from tests.conftest import TINY
from tests.models.hf_compare import (check_alone, check_mixed_batch, hf_greedy, hf_logits, load_hf, random_prompt,
                                     save_tiny)

WINDOW = 12
# 32-wide heads: the CPU's C decode kernel (and its fused decode stack) take them; TINY's 16-wide ones go to PyTorch.
WIDE = {**TINY, "hidden_size": 128, "head_dim": 32}


def _config(config_cls, **overrides) -> dict:
    return config_cls(**TINY, **overrides).to_dict()


@pytest.mark.parametrize("config, windows", [
    (_config(transformers.MistralConfig, sliding_window=16), [16, 16]),                     # v0.1
    (_config(transformers.MistralConfig, sliding_window=None), [0, 0]),                     # v0.2 on
    (_config(transformers.Qwen2Config), [0, 0]),                                            # use_sliding_window False
    (_config(transformers.Qwen2Config, use_sliding_window=True, sliding_window=16, max_window_layers=1), [0, 16]),
    (_config(transformers.Qwen2Config, use_sliding_window=True, sliding_window=16, max_window_layers=2), [0, 0]),
    (_config(transformers.Qwen3Config, use_sliding_window=True, sliding_window=16, max_window_layers=0), [16, 16]),
    (_config(transformers.MixtralConfig, sliding_window=16), [16, 16]),
    (_config(transformers.Qwen3MoeConfig, use_sliding_window=True, sliding_window=16), [16, 16]),
])
def test_each_layer_s_window_as_transformers_reads_it(config, windows):
    assert layer_windows(config) == windows
    # The same reading without transformers' per-layer list (configs written before it existed).
    assert layer_windows({k: v for k, v in config.items() if k != "layer_types"}) == windows


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    path = save_tiny(tmp_path_factory.mktemp("mistral_window"),
                     transformers.MistralConfig(**WIDE, sliding_window=WINDOW), transformers.MistralForCausalLM)
    return path, load_hf(path)


def test_the_window_changes_the_reference(mistral):
    """Not a vacuous comparison: with the same weights and no window, HF's logits past the window differ."""
    path, hf = mistral
    unwindowed = transformers.MistralForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                 sliding_window=None).eval()
    ids = random_prompt(40, seed=1)
    a, b = hf_logits(hf, ids), hf_logits(unwindowed, ids)
    assert torch.allclose(a[:WINDOW], b[:WINDOW], atol=1e-4)
    assert (a[WINDOW + 4:] - b[WINDOW + 4:]).abs().max() > 0.1 * a.abs().max()


@pytest.mark.parametrize("env", [{}, {"DEEPSERVE_CPU_FUSED_DECODE": "0"}, {"DEEPSERVE_CPU_KERNELS": "0"}],
                         ids=["fused-decode-stack", "c-decode-kernel", "pytorch"])
def test_mistral_prompt_logits_and_greedy_tokens_match_transformers(mistral, monkeypatch, env):
    path, hf = mistral
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    llm = check_alone(path, hf)
    assert [layer.self_attn.attn.sliding_window for layer in llm.engine.runner.model.layers] == [WINDOW, WINDOW]
    fused = llm.engine.runner.model.cpu_decode
    assert (fused.enabled and fused.stack is not None) == (not env)     # the fused stack ran the decodes where on


def test_mistral_mixed_batch_with_preemption_and_prefix_hits(mistral):
    path, hf = mistral
    check_mixed_batch(path, hf, kv_bytes_per_token=2 * WIDE["num_hidden_layers"] * 2 * 32 * 4)


def test_batch_invariant_mode_reads_the_window(mistral):
    """Every row through the decode path (its own keys only): the same greedy tokens as HF's."""
    path, hf = mistral
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=8, batch_invariant=True)
    prompts = [random_prompt(n, seed=s) for n, s in ((37, 1), (9, 2))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for ids, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, 24)[0]


def test_speculative_decoding_verifies_drafts_through_the_window(mistral):
    """n-gram drafts over a repetitive prompt: the verify rows (decodes of their own lengths) read each one's window;
    the greedy tokens are HF's."""
    path, hf = mistral
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=8,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    prompt = random_prompt(10, seed=8) * 4
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 24)[0]
    assert llm.engine.get_stats().spec_decode_num_draft_tokens > 0


def test_the_gpu_backend_dispatch_passes_each_layer_s_window(mistral):
    """TritonPagedAttention's metadata and dispatch on the CPU, its kernels' PyTorch twins reading the window it
    passes (tests/gpu/test_paged_attention.py checks the kernels against those twins): HF's greedy tokens."""
    from tests.worker.eager_graphs import install_twin_triton_attention
    path, hf = mistral
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=8, max_num_batched_tokens=16,
              enable_chunked_prefill=True)
    install_twin_triton_attention(llm)
    prompts = [random_prompt(n, seed=s) for n, s in ((37, 3), (5, 4), (21, 5))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    for ids, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, 20)[0]


def test_qwen2_windows_only_its_upper_layers(tmp_path):
    """Qwen2 with use_sliding_window: layers from max_window_layers on are windowed, the ones below see every key."""
    config = transformers.Qwen2Config(**WIDE, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    path = save_tiny(tmp_path, config, transformers.Qwen2ForCausalLM)
    llm = check_alone(path, load_hf(path))
    assert [layer.self_attn.attn.sliding_window for layer in llm.engine.runner.model.layers] == [0, WINDOW]


def test_mixtral_with_a_window_matches_transformers(tmp_path):
    config = transformers.MixtralConfig(**TINY, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2)
    path = save_tiny(tmp_path, config, transformers.MixtralForCausalLM)
    hf = load_hf(path)
    check_alone(path, hf)
    check_mixed_batch(path, hf, kv_bytes_per_token=2 * TINY["num_hidden_layers"] * 2 * 16 * 4)
