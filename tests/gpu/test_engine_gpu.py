"""The engine on a CUDA GPU gives the CPU engine's greedy tokens (same weights, fp32)."""

from __future__ import annotations

import pytest
import torch

from deepserve import LLM, SamplingParams

from tests.engine.near_tie import first_divergence_is_a_near_tie
from tests.worker.eager_graphs import record_carried_steps

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen3"])
def test_gpu_greedy_equals_cpu(model, request):
    """tiny_qwen3: its per-head q/k norms run inside the GPU's rotate-and-write kernel, apart on the CPU."""
    path = request.getfixturevalue(model)
    prompts = [{"prompt_token_ids": list(range(5 + i, 40 + 3 * i))} for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    cpu = LLM(path, skip_tokenizer_init=True, device="cpu", dtype="float32")
    gpu = LLM(path, skip_tokenizer_init=True, device="cuda", dtype="float32", kv_cache_memory_bytes=1 << 26)
    a = [o.outputs[0].token_ids for o in cpu.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in gpu.generate(prompts, params, use_tqdm=False)]
    assert a == b


def test_gpu_sliding_window_greedy_equals_cpu(tmp_path):
    """A Mistral with a 12-key window (tests/models/test_sliding_window.py holds the CPU engine to HF's tokens):
    prompts past the window in 16-token chunks beside decodes, CUDA graphs (decode and mixed steps) and the batch-1
    fused projection; the GPU's greedy tokens are the CPU's."""
    import transformers
    from tests.models.hf_compare import random_prompt, save_tiny
    from tests.conftest import TINY
    config = transformers.MistralConfig(**{**TINY, "hidden_size": 128, "head_dim": 32}, sliding_window=12)
    path = save_tiny(tmp_path, config, transformers.MistralForCausalLM)
    prompts = [{"prompt_token_ids": random_prompt(n, seed=n)} for n in (70, 5, 33, 90)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kw = dict(skip_tokenizer_init=True, dtype="float32", max_num_batched_tokens=16, enable_chunked_prefill=True)
    cpu = LLM(path, device="cpu", **kw)
    want = [o.outputs[0].token_ids for o in cpu.generate(prompts, params, use_tqdm=False)]
    gpu = LLM(path, device="cuda", kv_cache_memory_bytes=1 << 26, **kw)
    assert gpu.engine.runner.cuda_graphs is not None
    assert [o.outputs[0].token_ids for o in gpu.generate(prompts, params, use_tqdm=False)] == want
    alone = gpu.generate(prompts[0], params, use_tqdm=False)[0].outputs[0].token_ids     # batch 1: the fused path
    assert alone == want[0]


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen3"])
def test_gpu_fp8_kv_cache_greedy_equals_cpu(model, kv, request):
    """kv_cache_dtype fp8: the Triton kernels round keys and values into the cache and widen them back as the CPU path
    does (tests/models/test_fp8_kv_cache_vs_hf.py holds that one against HF): the GPU's greedy tokens are the CPU's,
    up to a near tie (tests/engine/near_tie.py) where they first part; CUDA graphs and eager steps alike; the cache holds a
    quarter of an fp32 cache's bytes."""
    path = request.getfixturevalue(model)
    prompts = [{"prompt_token_ids": list(range(5 + i, 40 + 3 * i))} for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    cpu = LLM(path, skip_tokenizer_init=True, device="cpu", dtype="float32", kv_cache_dtype=kv)
    cpu_out = [o.outputs[0] for o in cpu.generate(prompts, SamplingParams(temperature=0, max_tokens=32,
                                                                          ignore_eos=True, logprobs=2),
                                                  use_tqdm=False)]
    for eager in (True, False):
        gpu = LLM(path, skip_tokenizer_init=True, device="cuda", dtype="float32", kv_cache_dtype=kv,
                  kv_cache_memory_bytes=1 << 26, enforce_eager=eager)
        runner = gpu.engine.runner
        assert all(c.dtype == cpu.engine.runner.kv_caches[0].dtype for c in runner.kv_caches)
        assert (runner.cuda_graphs is None) == eager
        got = [o.outputs[0].token_ids for o in gpu.generate(prompts, params, use_tqdm=False)]
        parted = [i for i, (c, g) in enumerate(zip(cpu_out, got)) if c.token_ids != g]
        assert all(first_divergence_is_a_near_tie(cpu_out[i].token_ids, got[i], cpu_out[i].logprobs) for i in parted)
        assert len(parted) <= 1, parted        # rare: most prompts give the CPU's tokens exactly
        bm = gpu.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        del gpu
    fp32 = LLM(path, skip_tokenizer_init=True, device="cpu", dtype="float32")
    assert cpu.engine.runner.kv_bytes_per_token() * 4 == fp32.engine.runner.kv_bytes_per_token()


@pytest.fixture(scope="module")
def tiny_deepseek_v2(tmp_path_factory) -> str:
    """tests/models/test_deepseek_vs_hf.py's "v2": MLA over a 32-wide latent, DeepSeekMoE after a dense layer."""
    from tests.models.hf_compare import save_tiny_deepseek
    return save_tiny_deepseek(tmp_path_factory.mktemp("dsv2"), 2, vocab_size=512, topk_method="group_limited_greedy",
                              n_group=4, topk_group=2, routed_scaling_factor=1.5, q_lora_rank=None)


def test_gpu_fp8_latent_cache_greedy_equals_cpu(tiny_deepseek_v2):
    """kv_cache_dtype fp8 on MLA: the Triton latent writes, decode and prefill against the CPU path (itself held
    against HF in tests/models/test_deepseek_vs_hf.py), eager and in CUDA graphs."""
    prompts = [{"prompt_token_ids": list(range(5 + i, 40 + 3 * i))} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    cpu = LLM(tiny_deepseek_v2, skip_tokenizer_init=True, device="cpu", dtype="float32", kv_cache_dtype="fp8")
    want = [o.outputs[0].token_ids for o in cpu.generate(prompts, params, use_tqdm=False)]
    for eager in (True, False):
        gpu = LLM(tiny_deepseek_v2, skip_tokenizer_init=True, device="cuda", dtype="float32", kv_cache_dtype="fp8",
                  kv_cache_memory_bytes=1 << 26, enforce_eager=eager)
        assert all(c.dtype == torch.float8_e4m3fn for c in gpu.engine.runner.kv_caches)
        assert [o.outputs[0].token_ids for o in gpu.generate(prompts, params, use_tqdm=False)] == want
        del gpu


@pytest.mark.parametrize("model", ["tiny_qwen3_moe", "tiny_deepseek_v2"])
def test_moe_combine_in_norm_gives_the_same_bits(model, request, monkeypatch):
    """DEEPSERVE_MOE_COMBINE_IN_NORM: each MoE layer hands its pair rows on and the next add + RMSNorm kernel sums
    them (no combine launch): the same tokens and logprobs bit for bit as the combine kernel then the norm, eager and
    in CUDA graphs, in bf16; a prompt alone (pair mode) and six together (aligned mode); Qwen3-MoE has a dense layer
    between MoE layers, DeepSeek-V2 shared experts; both end in a MoE layer (the final norm takes the rows)."""
    import deepserve.kernels.fused_moe as fused_moe_module
    path = request.getfixturevalue(model)
    prompts = [{"prompt_token_ids": list(range(5 + i, 40 + 3 * i))} for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)

    def run(eager):
        llm = LLM(path, skip_tokenizer_init=True, device="cuda", dtype="bfloat16", kv_cache_memory_bytes=1 << 26,
                  enforce_eager=eager)
        out = [llm.generate(prompts[0], params, use_tqdm=False)[0]] + llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.outputs[0].cumulative_logprob) for o in out]

    combines = []
    real_combine = fused_moe_module.moe_combine
    monkeypatch.setattr(fused_moe_module, "moe_combine", lambda *a, **k: combines.append(1) or real_combine(*a, **k))
    want = {eager: run(eager) for eager in (True, False)}
    assert combines
    monkeypatch.setenv("DEEPSERVE_MOE_COMBINE_IN_NORM", "1")
    combines.clear()
    for eager in (True, False):
        assert run(eager) == want[eager]
    assert not combines


@pytest.mark.parametrize("combine_in_norm", ["0", "1"])
def test_shared_experts_on_the_side_stream_give_the_same_bits(tiny_deepseek_v2, monkeypatch, combine_in_norm):
    """DEEPSERVE_MOE_SHARED_STREAM (layers/side_stream.py, on by default): the shared experts on a side stream
    beside the router and the routed experts give the same tokens and logprobs bit for bit as the same launches in
    order on one stream (DEEPSERVE_MOE_SHARED_STREAM=0 with DEEPSERVE_MOE_FUSED_SHARED=0), eager and in CUDA graphs
    (the fork and join captured as edges), in bf16, a prompt alone (pair mode) and six together (aligned mode);
    with the combine in the next norm, the join comes before the norm reads the shared output."""
    from deepserve.layers import side_stream
    prompts = [{"prompt_token_ids": list(range(5 + i, 40 + 3 * i))} for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
    monkeypatch.setenv("DEEPSERVE_MOE_COMBINE_IN_NORM", combine_in_norm)

    def run(eager):
        llm = LLM(tiny_deepseek_v2, skip_tokenizer_init=True, device="cuda", dtype="bfloat16",
                  kv_cache_memory_bytes=1 << 26, enforce_eager=eager)
        out = [llm.generate(prompts[0], params, use_tqdm=False)[0]] + llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.outputs[0].cumulative_logprob) for o in out]

    forks = []
    real_fork = side_stream.fork
    monkeypatch.setattr(side_stream, "fork", lambda device: forks.append(1) or real_fork(device))
    monkeypatch.setenv("DEEPSERVE_MOE_SHARED_STREAM", "0")
    monkeypatch.setenv("DEEPSERVE_MOE_FUSED_SHARED", "0")
    want = {eager: run(eager) for eager in (True, False)}
    assert not forks
    monkeypatch.delenv("DEEPSERVE_MOE_SHARED_STREAM")
    for eager in (True, False):
        forks.clear()
        assert run(eager) == want[eager]
        assert forks
    torch.cuda.synchronize()


def test_gpu_seeded_sampling_batch_invariant(tiny_llama):
    gpu = LLM(tiny_llama, skip_tokenizer_init=True, device="cuda", dtype="bfloat16", kv_cache_memory_bytes=1 << 26)
    prompts = [{"prompt_token_ids": list(range(3, 20 + i))} for i in range(8)]
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=16, ignore_eos=True) for i in range(8)]
    batched = [o.outputs[0].token_ids for o in gpu.generate(prompts, params, use_tqdm=False)]
    alone = [gpu.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    assert batched == alone
    bm = gpu.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def _mixed_workload():
    """20 prompts of different lengths and output lengths: the decode batch shrinks step by step through
    sizes that pad to different captured graphs (20 -> 32, 16, 8, 4, 2, 1)."""
    prompts = [{"prompt_token_ids": [(7 * i + j) % 250 + 3 for j in range(4 + 3 * i)]} for i in range(20)]
    params = [SamplingParams(temperature=0, max_tokens=4 + 2 * i, ignore_eos=True) for i in range(20)]
    return prompts, params


def test_cuda_graphs_match_eager(tiny_llama):
    prompts, params = _mixed_workload()
    eager = LLM(tiny_llama, skip_tokenizer_init=True, device="cuda", dtype="float32", enforce_eager=True,
                kv_cache_memory_bytes=1 << 26)
    assert eager.engine.runner.cuda_graphs is None
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    del eager
    graphs = LLM(tiny_llama, skip_tokenizer_init=True, device="cuda", dtype="float32", max_num_seqs=32,
                 kv_cache_memory_bytes=1 << 26)
    runner = graphs.engine.runner
    assert runner.cuda_graphs is not None and runner.cuda_graph_capture_seconds > 0
    got = [o.outputs[0].token_ids for o in graphs.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert runner.cuda_graphs.num_replays >= max(p.max_tokens for p in params) - 2
    bm = graphs.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.gpu_alone
def test_profiled_kv_budget_fits_the_gpu(tiny_llama):
    """Without kv_cache_memory_bytes the KV cache is sized from a profiled max-size step. It needs the GPU to itself:
    the budget is a share of the total memory less what is in use, so other test processes' memory counts against
    it (session 36: failed beside 15 pytest-xdist workers, passed beside 7)."""
    llm = LLM(tiny_llama, skip_tokenizer_init=True, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3,
              max_num_seqs=8, cuda_graph_max_batch_size=8)
    runner = llm.engine.runner
    free, total = torch.cuda.mem_get_info()
    kv_bytes = sum(c.numel() * c.element_size() for c in runner.kv_caches)
    assert runner.profiled_peak_bytes > 0
    assert kv_bytes <= 0.3 * total
    out = llm.generate({"prompt_token_ids": list(range(3, 40))}, SamplingParams(temperature=0, max_tokens=8),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8


@pytest.mark.parametrize("switches", [
    {"DEEPSERVE_GRAPH_TOKENS": "1", "DEEPSERVE_COMPACT_BLOCK_TABLES": "0", "DEEPSERVE_MAPPED_STEP_IO": "0"},
    {"DEEPSERVE_GRAPH_TOKENS": "0", "DEEPSERVE_COMPACT_BLOCK_TABLES": "1", "DEEPSERVE_MAPPED_STEP_IO": "1"},
    {"DEEPSERVE_GRAPH_TOKENS": "1", "DEEPSERVE_COMPACT_BLOCK_TABLES": "1", "DEEPSERVE_MAPPED_STEP_IO": "0"},
    {"DEEPSERVE_GRAPH_TOKENS": "1", "DEEPSERVE_COMPACT_BLOCK_TABLES": "0", "DEEPSERVE_MAPPED_STEP_IO": "1"}])
def test_cuda_graphs_with_graph_input_switches_match_eager(tiny_llama, monkeypatch, switches):
    """DEEPSERVE_GRAPH_TOKENS: the decode graphs take the greedy argmax in the graph and patch the in-flight tokens
    themselves (overlapped scheduling), and the steps take the graphs' tokens; DEEPSERVE_COMPACT_BLOCK_TABLES: the
    block tables travel packed at the step's width and the graph unpacks them; DEEPSERVE_MAPPED_STEP_IO: the graphs
    read their inputs from pinned host memory and write the tokens there. The shrinking batch's tokens equal an
    eager engine's either way."""
    carry = switches["DEEPSERVE_GRAPH_TOKENS"] == "1"
    mapped = carry and switches["DEEPSERVE_MAPPED_STEP_IO"] == "1"     # (mapped graphs carry tokens)
    prompts, params = _mixed_workload()
    eager = LLM(tiny_llama, skip_tokenizer_init=True, device="cuda", dtype="float32", enforce_eager=True,
                kv_cache_memory_bytes=1 << 26)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    del eager
    for name, value in switches.items():
        monkeypatch.setenv(name, value)
    llm = LLM(tiny_llama, skip_tokenizer_init=True, device="cuda", dtype="float32", max_num_seqs=32,
              kv_cache_memory_bytes=1 << 26, async_scheduling=True)
    graphs = llm.engine.runner.cuda_graphs
    assert graphs is not None and (graphs.tokens is not None) == carry
    assert graphs.inputs.compact == (switches["DEEPSERVE_COMPACT_BLOCK_TABLES"] == "1" or mapped)
    assert graphs.mapped == mapped
    carried = record_carried_steps(llm)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert sum(carried) >= max(p.max_tokens for p in params) - 4 if carry else not any(carried)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_split_merge_in_the_decode_kernel_keeps_the_tokens(tiny_llama, monkeypatch):
    """DEEPSERVE_DECODE_SPLIT_MERGE=last (the default: the decode kernel's last split program of each row and KV head
    merges the splits; no reduce launch): eager steps and CUDA graphs (a graph's grid is sized for max_model_len, so
    most splits are empty) give the reduce launch's greedy tokens, every split launch merged in the kernel, and
    every merge counter ends at zero."""
    from deepserve.kernels import paged_attention
    prompts = [{"prompt_token_ids": [(11 * i + 3 * j) % 250 + 3 for j in range(40 + 45 * i)]} for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def tokens(**kw):
        llm = LLM(tiny_llama, skip_tokenizer_init=True, device="cuda", dtype="float32", max_num_seqs=8,
                  kv_cache_memory_bytes=1 << 26, **kw)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    monkeypatch.setattr(paged_attention, "SPLIT_MERGE", "reduce")
    want = tokens(enforce_eager=True)
    launches, reduces = [], []
    real_kernel, real_reduce = paged_attention._decode_kernel, paged_attention.decode_reduce

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launches.append((grid[2], kw["MERGE_LAST"]))
                return real_kernel[grid](*args, **kw)
            return launch

    monkeypatch.setattr(paged_attention, "_decode_kernel", Spy())
    monkeypatch.setattr(paged_attention, "decode_reduce", lambda *a, **k: reduces.append(1) or real_reduce(*a, **k))
    monkeypatch.setattr(paged_attention, "SPLIT_MERGE", "last")
    assert tokens(enforce_eager=True) == want
    assert tokens() == want
    split = [merged for splits, merged in launches if splits > 1]
    assert split and all(split) and not reduces
    assert not paged_attention.split_counters(torch.device("cuda")).any()
