"""Batch-invariant mode on a CUDA GPU: the CPU suite's checks (tests/engine/test_batch_invariant_mode.py) on the GPU
path: the fixed-tiling Triton matmul for every Linear and expert GEMM, no batch-1 GEMV fusions, every attention row
through the unsplit Triton decode kernel."""

from __future__ import annotations

import pytest
import torch

from deepserve import LLM
from tests.engine.test_batch_invariant_mode import alone, in_batch, targets, tiny_mixtral_d32  # noqa: F401 (a fixture)

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


def test_gpu_mixture_of_experts(tiny_mixtral_d32):
    """Expert GEMMs on the GPU through the fixed-tiling Triton matmul (the reference expert backend is kept in the
    mode): alone equals among 40 companions and in chunks."""
    engine = {**GPU_ENGINE, "dtype": "float32"}
    llm = LLM(tiny_mixtral_d32, **engine)
    assert all(type(m.backend).__name__ == "TorchMoE" for m in llm.engine.runner.model.moe_layers())
    expected = alone(LLM(tiny_mixtral_d32, **engine, enable_prefix_caching=False), *targets())
    assert in_batch(llm, *targets(), 40, seed=40) == expected
    chunked = LLM(tiny_mixtral_d32, **engine, enable_chunked_prefill=True, max_num_batched_tokens=29)
    assert in_batch(chunked, *targets(), 9, seed=29) == expected
