"""kv_cache_dtype="fp8" / "fp8_e5m2" against HF transformers whose attention reads its keys and values rounded the
same way (after the rotary embedding; clamped to the format's largest value, then cast): prompt logits whole and in
chunks over the paged fp8 prefix, and greedy tokens, through the C decode kernel and through the PyTorch path. The
reference's rounding is written here, not taken from the engine."""

from __future__ import annotations

import pytest
import torch

from hf_compare import assert_close_relative, engine_logits, hf_greedy, hf_logits, random_prompt, save_tiny

from deepserve import LLM, SamplingParams
from deepserve.kernels import cpu

FORMATS = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    limit = torch.finfo(dtype).max
    return x.clamp(-limit, limit).to(dtype).to(x.dtype)


@pytest.fixture(scope="module")
def llama_head_dim_32(tmp_path_factory) -> str:
    """A tiny Llama whose 32-wide heads the C decode kernel takes (it needs head_dim % 32 == 0)."""
    import transformers
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      max_position_embeddings=1024, rms_norm_eps=1e-6)
    return save_tiny(tmp_path_factory.mktemp("llama_hd32"), config, transformers.LlamaForCausalLM)


def hf_with_rounded_kv(path: str, dtype: torch.dtype):
    """HF's model with an attention function that rounds keys and values into `dtype` before SDPA (HF's cache keeps
    them in fp32, so a decode step re-rounds the cached ones: the same values, rounding is idempotent)."""
    import transformers
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attend(module, query, key, value, attention_mask, **kwargs):
        return sdpa_attention_forward(module, query, rounded(key, dtype), rounded(value, dtype), attention_mask,
                                      **kwargs)

    name = f"deepserve_test_kv_{str(dtype).removeprefix('torch.')}"
    AttentionInterface.register(name, attend)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation=name).eval()


@pytest.mark.parametrize("kv", list(FORMATS))
@pytest.mark.parametrize("kind", ["llama_head_dim_32", "tiny_qwen3"])
def test_fp8_kv_cache_matches_hf_with_rounded_keys_and_values(kind, kv, request, monkeypatch):
    import transformers
    path = request.getfixturevalue(kind)
    hf = hf_with_rounded_kv(path, FORMATS[kv])
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=8, kv_cache_dtype=kv)
    assert all(c.dtype == FORMATS[kv] for c in llm.engine.runner.kv_caches)
    ids = random_prompt(37, seed=1)
    ref = hf_logits(hf, ids)
    assert_close_relative(engine_logits(llm, ids), ref, 1e-4)
    assert_close_relative(engine_logits(llm, ids, chunk=5), ref, 1e-4)    # the chunks read the fp8 prefix
    # The rounding matters at this tolerance: the plain fp32 model is far off.
    plain = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with pytest.raises(AssertionError):
        assert_close_relative(engine_logits(llm, ids), hf_logits(plain, ids), 1e-3)

    want = hf_greedy(hf, ids, 24)[0]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kernel_runs = []
    run = cpu.DecodePlan.run
    monkeypatch.setattr(cpu.DecodePlan, "run", lambda *a: kernel_runs.append(run(*a)) or kernel_runs[-1])
    for kernels in ("1", "0"):          # the C decode kernel's fp8 build (where it takes the heads), the PyTorch path
        monkeypatch.setenv("DEEPSERVE_CPU_KERNELS", kernels)
        out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == want, kernels
    if kind == "llama_head_dim_32" and cpu.library(FORMATS[kv]) is not None:
        assert kernel_runs and all(kernel_runs)
