"""keys: the fingerprint names the model, dtype and layout; a different model never reads another's entries."""

from __future__ import annotations

from deepserve import LLM

ENGINE = {"skip_tokenizer_init": True, "max_model_len": 256, "kv_store": {"backend": "memory"}}


def fingerprint(model, **kwargs):
    return LLM(model, **{**ENGINE, **kwargs}).engine.kv_store.fingerprint


def test_fingerprint_is_stable_and_tells_models_and_layouts_apart(tiny_llama, tiny_llama_other):
    base = fingerprint(tiny_llama)
    assert fingerprint(tiny_llama) == base                                   # another engine, same model
    others = {fingerprint(tiny_llama_other),                                # same config, other weights
              fingerprint(tiny_llama, block_size=8),
              fingerprint(tiny_llama, dtype="bfloat16"), fingerprint(tiny_llama, kv_cache_dtype="bfloat16"),
              fingerprint(tiny_llama, batch_invariant=True)}                # other GEMM / attention orders
    assert base not in others and len(others) == 5
    assert fingerprint(tiny_llama, batch_invariant=False) == base


def test_other_model_misses_the_entries(tiny_llama, tiny_llama_other, tmp_path):
    store = {"backend": "disk", "path": str(tmp_path / "kv")}
    prompt = {"prompt_token_ids": list(range(3, 200))}
    first = LLM(tiny_llama, **{**ENGINE, "kv_store": store})
    first.generate(prompt, use_tqdm=False)
    first.engine.kv_store.flush()
    other = LLM(tiny_llama_other, **{**ENGINE, "kv_store": store})
    assert other.generate(prompt, use_tqdm=False)[0].num_cached_tokens == 0
