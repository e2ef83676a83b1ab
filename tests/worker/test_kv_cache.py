"""worker/kv_cache.py's block moves (copy-on-write copies, blocks read out for the KV store and written back) on
8-bit float caches (kv_cache_dtype "fp8" / "fp8_e5m2"): they move as raw bytes, every bit kept, NaN codes too."""

from __future__ import annotations

import pytest
import torch

from deepserve import LLM


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2", "auto"])
def test_blocks_move_bit_for_bit(tiny_llama, kv):
    llm = LLM(tiny_llama, device="cpu", skip_tokenizer_init=True, max_model_len=256, kv_cache_dtype=kv,
              kv_cache_memory_bytes=1 << 20)
    runner = llm.engine.runner
    caches = runner.kv_caches
    gen = torch.Generator().manual_seed(0)
    for cache in caches:          # every byte pattern, NaN codes included
        raw = cache.view(torch.uint8) if cache.element_size() == 1 else cache.view(torch.int8)
        raw.copy_(torch.randint(-128, 128, raw.shape, generator=gen, dtype=torch.int16).to(raw.dtype))
    before = [c.clone() for c in caches]

    def block(cache, i):
        return cache.select(1, i).contiguous().view(torch.uint8)

    runner.copy_blocks([(3, 5), (4, 9)])
    for c, b in zip(caches, before):
        assert torch.equal(block(c, 5), block(b, 3)) and torch.equal(block(c, 9), block(b, 4))
        assert torch.equal(block(c, 3), block(b, 3))
    out = runner.read_kv_blocks([1, 2])
    assert [t.dtype for t in out[0]] == [c.dtype for c in caches]
    runner.write_kv_block(7, out[1])
    for c, b in zip(caches, before):
        assert torch.equal(block(c, 7), block(b, 2))
