"""Batch-invariant mode on a CUDA GPU (written without a GPU at hand: first run pending). The CPU suite's checks
(tests/engine/test_batch_invariant_mode.py) on the GPU path: fixed 32-row cuBLAS tiles for every Linear, no
batch-1 GEMV fusions, every attention row through the unsplit Triton decode kernel."""

from __future__ import annotations

import pytest
import torch

from deepserve import LLM
from tests.engine.test_batch_invariant_mode import alone, in_batch, targets

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GPU_ENGINE = dict(skip_tokenizer_init=True, device="cuda", block_size=16, seed=0, batch_invariant=True,
                  kv_cache_memory_bytes=1 << 26)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_alone_equals_batches_and_chunks(tiny_llama, dtype):
    engine = {**GPU_ENGINE, "dtype": dtype}
    expected = alone(LLM(tiny_llama, **engine, enable_prefix_caching=False), *targets())
    llm = LLM(tiny_llama, **engine)
    assert llm.engine.runner.attn_backend.rows_as_decodes
    for companions in (1, 6, 63):
        assert in_batch(llm, *targets(), companions, seed=companions) == expected
    for budget in (13, 50):
        chunked = LLM(tiny_llama, **engine, enable_chunked_prefill=True, max_num_batched_tokens=budget)
        assert in_batch(chunked, *targets(), 9, seed=budget) == expected


def test_gpu_eager_and_cuda_graphs_agree(tiny_llama):
    """Decode steps replayed from captured graphs (batches padded to a graph size) give the eager steps' bits."""
    engine = {**GPU_ENGINE, "dtype": "bfloat16"}
    eager = in_batch(LLM(tiny_llama, **engine, enforce_eager=True), *targets(), 20, seed=3)
    graphs = in_batch(LLM(tiny_llama, **engine), *targets(), 20, seed=3)
    assert graphs == eager
