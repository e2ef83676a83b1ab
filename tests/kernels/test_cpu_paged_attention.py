"""The C paged decode attention kernel (deepserve/kernels/cpu) against attention written from its definition,
its use by TorchPagedAttention, its fallback, and the build cache it is compiled into."""

from __future__ import annotations

import math
import sys
import threading
from pathlib import Path

import pytest
import torch

from deepserve.kernels import cpu
import deepserve.kernels.cpu.build as cpu_build
from deepserve.layers.attention import TorchPagedAttention
from deepserve.layers.forward_batch import ForwardBatch

requires_kernel = pytest.mark.skipif(cpu.library() is None, reason="no C compiler, or DEEPSERVE_CPU_KERNELS=0")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def reference_decode(q, kv_cache, block_tables, seq_lens, scale, window: int = 0):
    """softmax(q k^T * scale) v over each sequence's first seq_len keys (the last `window` of them, window > 0), in
    float64, slot by slot."""
    _, _, block_size, hkv, _ = kv_cache.shape
    group = q.shape[1] // hkv
    out = torch.empty(q.shape, dtype=torch.float64)
    for b, length in enumerate(seq_lens.tolist()):
        pos = torch.arange(max(0, length - window) if window > 0 else 0, length)
        blocks = block_tables[b][pos // block_size]
        k = kv_cache[0, blocks, pos % block_size].double().repeat_interleave(group, dim=1)   # [L, H, D]
        v = kv_cache[1, blocks, pos % block_size].double().repeat_interleave(group, dim=1)
        probs = torch.softmax(torch.einsum("hd,lhd->hl", q[b].double(), k) * scale, dim=-1)
        out[b] = torch.einsum("hl,lhd->hd", probs, v)
    return out


def random_case(seq_lens, hkv, group, head_dim, block_size=16, seed=0, spare_blocks=5):
    """q [B, H, D], a random fp32 cache, and block tables drawn from a shuffled pool (padded with block 0)."""
    gen = torch.Generator().manual_seed(seed)
    needed = [cdiv(n, block_size) for n in seq_lens]
    num_blocks = sum(needed) + spare_blocks
    kv_cache = torch.randn(2, num_blocks, block_size, hkv, head_dim, generator=gen)
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seq_lens), max(needed) + 1, dtype=torch.int64)
    for b, n in enumerate(needed):
        tables[b, :n] = torch.tensor([pool.pop() for _ in range(n)])
    q = torch.randn(len(seq_lens), hkv * group, head_dim, generator=gen)
    return q, kv_cache, tables, torch.tensor(seq_lens)


def run_kernel(q, kv_cache, tables, seq_lens, scale, rows=None, out=None, window=0):
    rows = torch.arange(len(seq_lens)) if rows is None else rows
    out = torch.full_like(q, float("nan")) if out is None else out
    assert cpu.DecodePlan(rows, tables, seq_lens).run(q, kv_cache, out, scale, window)
    return out


def assert_matches_reference(out, ref):
    # 1e-5 relative to the output's scale (values near zero make elementwise relative error meaningless).
    torch.testing.assert_close(out, ref.float(), rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


SEQ_LENS = [[1], [15], [16], [17], [300], [1, 15, 16, 17, 300, 33, 2, 64]]


@pytest.fixture(params=[8, 16], ids=["lanes8", "lanes16"])
def lanes(request, monkeypatch):
    """Every cache dtype's kernel built with 8-float vectors (one AVX register, the build of CPUs without AVX-512)
    and with 16-float ones (AVX-512's), whatever this CPU's own width: both are correct anywhere, only slower off
    their own ISA, so both are tested on every CPU."""
    for dtype, defines in list(cpu._VARIANTS.items()):
        monkeypatch.setitem(cpu._VARIANTS, dtype, defines + (f"ATTN_LANES={request.param}",))
    cpu._load.cache_clear()
    yield request.param
    cpu._load.cache_clear()


@requires_kernel
@pytest.mark.parametrize("seq_lens", SEQ_LENS, ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("group", [1, 3, 4, 5])
@pytest.mark.parametrize("head_dim", [64, 128, 96, 256])      # 96: the path for head sizes without a special case
def test_kernel_matches_reference(seq_lens, group, head_dim, lanes):
    q, kv_cache, tables, lens = random_case(seq_lens, hkv=3, group=group, head_dim=head_dim)
    scale = 1 / math.sqrt(head_dim)
    assert_matches_reference(run_kernel(q, kv_cache, tables, lens, scale),
                             reference_decode(q, kv_cache, tables, lens, scale))


# Around PART_KEYS (1024 keys) of paged_attention.c: one partition, two, several; with short ones in the batch.
LONG_SEQ_LENS = [[1024], [1025], [2049], [3000, 5, 1024, 1040]]


@requires_kernel
@pytest.mark.parametrize("seq_lens", LONG_SEQ_LENS, ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("block_size", [16, 48])       # 48: partitions of 21 blocks (1008 keys)
def test_long_sequences_fold_in_partitions(seq_lens, block_size, lanes):
    """Sequences longer than PART_KEYS fold in partitions (several work items each) merged afterwards."""
    q, kv_cache, tables, lens = random_case(seq_lens, hkv=3, group=3, head_dim=64, block_size=block_size)
    kv_cache[0] *= 2.0                  # a wider spread of scores: partitions' maxes differ
    assert_matches_reference(run_kernel(q, kv_cache, tables, lens, 0.125),
                             reference_decode(q, kv_cache, tables, lens, 0.125))


@requires_kernel
@pytest.mark.parametrize("window", [1, 5, 16, 33, 1100, 2100])
@pytest.mark.parametrize("block_size", [16, 48])
def test_a_sliding_window_reads_each_row_s_last_keys(window, block_size, lanes):
    """window > 0: each row attends to its last `window` keys. Windows inside one block, starting mid-block, as long
    as a row (or longer), and across PART_KEYS partitions (rows of 3000 keys: the partitions count from the
    window's first block); rows shorter than the window see all their keys."""
    q, kv_cache, tables, lens = random_case([3000, 5, 16, 300, 1040, 1], hkv=3, group=3, head_dim=64,
                                            block_size=block_size)
    kv_cache[0] *= 2.0
    out = run_kernel(q, kv_cache, tables, lens, 0.125, window=window)
    assert_matches_reference(out, reference_decode(q, kv_cache, tables, lens, 0.125, window))
    if window < 300:      # not the unwindowed result: the window was read
        assert not torch.allclose(out[0], reference_decode(q, kv_cache, tables, lens, 0.125)[0].float(), atol=1e-3)


@requires_kernel
@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_other_block_sizes(block_size, lanes):
    q, kv_cache, tables, lens = random_case([1, 7, 8, 9, 31, 32, 33, 100], hkv=2, group=2, head_dim=32,
                                            block_size=block_size)
    assert_matches_reference(run_kernel(q, kv_cache, tables, lens, 0.25),
                             reference_decode(q, kv_cache, tables, lens, 0.25))


@requires_kernel
def test_peaked_scores(lanes):
    """Scores spread over ~200: most probabilities underflow, and the running max changes within the sequence."""
    q, kv_cache, tables, lens = random_case([300, 40], hkv=1, group=2, head_dim=64)
    kv_cache[0] *= torch.linspace(0.5, 3.0, kv_cache.shape[1])[:, None, None, None]
    scale = 3.0
    assert_matches_reference(run_kernel(q, kv_cache, tables, lens, scale),
                             reference_decode(q, kv_cache, tables, lens, scale))


@requires_kernel
def test_strided_rows_of_a_mixed_batch():
    """q and out as the model has them (strided views, decode rows among other rows): only decode rows are
    written."""
    q_dense, kv_cache, tables, lens = random_case([5, 40, 17], hkv=2, group=3, head_dim=64)
    t, h, d = 7, 6, 64
    fused = torch.randn(t, h + 2, d)                 # q heads, then the step's own k and v
    rows = torch.tensor([4, 0, 6])
    fused[rows, :h] = q_dense
    q = fused[:, :h]
    out = torch.full((t, h, d), 7.0)
    run_kernel(q, kv_cache, tables, lens, 0.125, rows=rows, out=out)
    assert_matches_reference(out[rows], reference_decode(q_dense, kv_cache, tables, lens, 0.125))
    others = [r for r in range(t) if r not in rows.tolist()]
    assert torch.all(out[others] == 7.0)


@requires_kernel
def test_rows_do_not_depend_on_the_batch_or_threads(lanes):
    """Bitwise: a sequence alone, in a batch, and with 1 or 2 threads (which changes how work is split)."""
    lens = [300, 17, 1, 64, 15, 128, 16, 99, 5, 250, 2100]     # 2100: three partitions
    q, kv_cache, tables, seq_lens = random_case(lens, hkv=3, group=3, head_dim=64)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(run_kernel(q, kv_cache, tables, seq_lens, 0.125))
        torch.set_num_threads(1)
        alone = [run_kernel(q[b:b + 1], kv_cache, tables[b:b + 1], seq_lens[b:b + 1], 0.125)
                 for b in range(len(lens))]
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0], results[1])
    assert torch.equal(torch.cat(alone), results[0])


def test_plan_refuses_what_it_cannot_take(monkeypatch):
    if cpu.library() is None:
        pytest.skip("no kernel library")
    q, kv_cache, tables, lens = random_case([20], hkv=2, group=2, head_dim=64)
    plan = cpu.DecodePlan(torch.tensor([0]), tables, lens)
    out = torch.empty_like(q)
    assert not plan.run(q.double(), kv_cache.double(), out.double(), 0.1)             # fp32 only
    assert not plan.run(q, kv_cache[:, :1], out, 0.1)                                 # block id out of range
    assert not plan.run(q[:0], kv_cache, out[:0], 0.1)                                # row out of range
    assert not plan.run(q[..., :48], kv_cache[..., :48].contiguous(), out[..., :48], 0.1)   # D % 32
    assert plan.run(q, kv_cache, out, 0.1)
    wide_q, wide_cache, _, _ = random_case([20], hkv=2, group=2, head_dim=288)
    assert not plan.run(wide_q, wide_cache, torch.empty_like(wide_q), 0.1)                  # D > 256


# --- in the attention backend ----------------------------------------------------------------------------


def make_batch(seqs, block_size, num_blocks, seed=0):
    """ForwardBatch for sequences given as (cached tokens, new tokens), on shuffled non-contiguous blocks."""
    pool = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, positions, slots, q_lens, s_lens = [], [], [], [], []
    for cached, new in seqs:
        table = [pool.pop() for _ in range(cdiv(cached + new, block_size))]
        pos = list(range(cached, cached + new))
        tables.append(table)
        positions += pos
        slots += [table[p // block_size] * block_size + p % block_size for p in pos]
        q_lens.append(new)
        s_lens.append(cached + new)
    block_tables = torch.zeros(len(seqs), max(map(len, tables)) + 1, dtype=torch.int64)
    for b, table in enumerate(tables):
        block_tables[b, :len(table)] = torch.tensor(table)
    starts = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    starts[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    return ForwardBatch(input_ids=torch.zeros(sum(q_lens), dtype=torch.int64), positions=torch.tensor(positions),
                        slot_mapping=torch.tensor(slots), block_tables=block_tables, query_start_loc=starts,
                        seq_lens=torch.tensor(s_lens), query_lens_cpu=q_lens, seq_lens_cpu=s_lens,
                        logits_indices=torch.zeros(0, dtype=torch.int64), block_size=block_size)


MIXED_STEP = [(0, 23), (40, 1), (7, 1), (130, 70), (0, 1), (300, 1), (64, 64), (5, 2)]


def backend_step(seed=0, dtype=torch.float32):
    """One mixed step (prefills, a chunk over a cached prefix, decodes) through TorchPagedAttention, with q, k, v
    as strided views of one projection output. Returns the output and the cache after the step."""
    hkv, h, d, bs, num_blocks = 2, 6, 64, 16, 60
    gen = torch.Generator().manual_seed(seed)
    batch = make_batch(MIXED_STEP, bs, num_blocks, seed)
    t = batch.num_tokens
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=gen).to(dtype)
    q = qkv[:, :h * d].view(t, h, d)
    k = qkv[:, h * d:(h + hkv) * d].view(t, hkv, d)
    v = qkv[:, (h + hkv) * d:].view(t, hkv, d)
    cache = torch.randn(2, num_blocks, bs, hkv, d, generator=gen).to(dtype)
    backend = TorchPagedAttention()
    batch.attn_metadata = backend.build_metadata(batch)
    return backend.forward(q, k, v, cache, batch, 1 / math.sqrt(d)), cache, batch


@requires_kernel
def test_backend_kernel_matches_torch_path(monkeypatch):
    out, cache, batch = backend_step()
    assert batch.attn_metadata.decode_plan is not None
    monkeypatch.setenv("DEEPSERVE_CPU_KERNELS", "0")
    ref, ref_cache, ref_batch = backend_step()
    assert ref_batch.attn_metadata.decode_plan is None
    assert torch.equal(cache, ref_cache)
    decode_rows = batch.attn_metadata.decode_rows
    assert_matches_reference(out[decode_rows], ref[decode_rows].double())
    prefill = torch.ones(out.shape[0], dtype=torch.bool)
    prefill[decode_rows] = False
    assert torch.equal(out[prefill], ref[prefill])          # prefill rows take the same path either way


def test_disabled_by_env_var(monkeypatch):
    monkeypatch.setenv("DEEPSERVE_CPU_KERNELS", "0")
    assert not cpu.enabled() and cpu.library() is None
    with pytest.raises(RuntimeError):
        cpu.DecodePlan(torch.tensor([0]), torch.zeros(1, 1, dtype=torch.int64), torch.tensor([1]))
    out, _, batch = backend_step()
    assert batch.attn_metadata.decode_plan is None and torch.isfinite(out).all()


def test_other_dtypes_take_the_torch_path():
    out, _, batch = backend_step(dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


# --- build cache --------------------------------------------------------------------------------------------

requires_compiler = pytest.mark.skipif(cpu_build.find_compiler() is None, reason="no C compiler")
TINY_SOURCE = "int answer(void) { return 42; }\n"


def count_compiles(monkeypatch):
    calls = []
    real = cpu_build.compile_library

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_build, "compile_library", counting)
    return calls


@requires_compiler
def test_second_build_reuses_the_cached_library(tmp_path, monkeypatch):
    source = tmp_path / "tiny.c"
    source.write_text(TINY_SOURCE)
    calls = count_compiles(monkeypatch)
    first = cpu_build.build(source, tmp_path / "cache")
    second = cpu_build.build(source, tmp_path / "cache")
    assert first == second and first.exists() and len(calls) == 1
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [first.name]     # no temporary files left
    source.write_text(TINY_SOURCE.replace("42", "43"))                         # a changed source: a new file
    third = cpu_build.build(source, tmp_path / "cache")
    assert third != first and len(calls) == 2


@requires_compiler
def test_a_changed_included_file_gives_a_new_library(tmp_path, monkeypatch):
    """A source that includes another by a quoted name (llama_decode.c includes gguf_linear.c): a change in the
    included file alone is a new build, not the stale cached one."""
    (tmp_path / "part.c").write_text(TINY_SOURCE)
    source = tmp_path / "whole.c"
    source.write_text('#include "part.c"\nint twice(void) { return 2 * answer(); }\n')
    calls = count_compiles(monkeypatch)
    first = cpu_build.build(source, tmp_path / "cache")
    (tmp_path / "part.c").write_text(TINY_SOURCE.replace("42", "43"))
    second = cpu_build.build(source, tmp_path / "cache")
    assert first != second and len(calls) == 2
    import ctypes
    assert ctypes.CDLL(str(second)).twice() == 86


@requires_compiler
def test_concurrent_builds_do_not_break_each_other(tmp_path):
    source = tmp_path / "tiny.c"
    source.write_text(TINY_SOURCE)
    results = [None] * 4

    def one(i):
        results[i] = cpu_build.build(source, tmp_path / "cache")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and results[0] is not None
    import ctypes
    assert ctypes.CDLL(str(results[0])).answer() == 42


def test_no_compiler_means_no_library(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(cpu_build, "find_compiler", lambda: None)
    source = tmp_path / "tiny.c"
    source.write_text(TINY_SOURCE)
    assert cpu_build.build(source, tmp_path / "cache") is None
    assert "no C compiler" in caplog.text


@requires_compiler
def test_failed_build_means_no_library(tmp_path, caplog):
    source = tmp_path / "broken.c"
    source.write_text("this is not C\n")
    assert cpu_build.build(source, tmp_path / "cache") is None
    assert "failed" in caplog.text
    assert not list((tmp_path / "cache").iterdir())


def test_cache_dir_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPSERVE_CACHE_DIR", str(tmp_path))
    assert cpu_build.cache_dir() == Path(tmp_path)


@requires_kernel
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_one_openmp_runtime_in_the_process():
    """Our library must bind to the libgomp torch already loaded, not bring a second OpenMP runtime."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        q, kv_cache, tables, lens = random_case([100] * 16, hkv=2, group=2, head_dim=64)
        run_kernel(q, kv_cache, tables, lens, 0.1)
        torch.matmul(torch.randn(256, 256), torch.randn(256, 256))    # torch's own OpenMP pool still works
    finally:
        torch.set_num_threads(before)
    maps = Path("/proc/self/maps").read_text().splitlines()
    runtimes = {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line}
    assert len(runtimes) <= 1, runtimes


# --- a bf16 KV cache (kv_cache_dtype="bfloat16"): the KV_BF16 build widens each key/value exactly ---------------
requires_bf16_kernel = pytest.mark.skipif(cpu.library(torch.bfloat16) is None, reason="no C compiler")


@requires_bf16_kernel
@pytest.mark.parametrize("seq_lens", SEQ_LENS, ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("head_dim", [64, 128, 96])
def test_bf16_cache_kernel_matches_reference(seq_lens, group, head_dim, lanes):
    q, kv_cache, tables, lens = random_case(seq_lens, hkv=3, group=group, head_dim=head_dim)
    cache16 = kv_cache.bfloat16()
    # The reference reads the same bf16 values (widened to float64): only the arithmetic differs.
    assert_matches_reference(run_kernel(q, cache16, tables, lens, 0.125),
                             reference_decode(q, cache16, tables, lens, 0.125))


@requires_bf16_kernel
def test_engine_with_bf16_kv_cache_matches_the_torch_path(tiny_llama):
    """kv_cache_dtype='bfloat16' on an fp32 model: the C kernel and the PyTorch fallback read the same bf16
    cache and give the same greedy tokens; the cache really is bf16 (half the bytes per token)."""
    from deepserve import LLM, SamplingParams
    prompts = [{"prompt_token_ids": [5 + i, 9, 17 + 2 * i, 3] * (3 + i)} for i in range(4)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = LLM(tiny_llama, device="cpu", kv_cache_dtype="bfloat16", max_model_len=256, skip_tokenizer_init=True)
    runner = llm.engine.runner
    assert all(c.dtype == torch.bfloat16 for c in runner.kv_caches)
    fp32 = LLM(tiny_llama, device="cpu", max_model_len=256, skip_tokenizer_init=True)
    assert runner.kv_bytes_per_token() * 2 == fp32.engine.runner.kv_bytes_per_token()
    with_kernel = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    cpu._load.cache_clear()
    try:
        import os
        os.environ["DEEPSERVE_CPU_KERNELS"] = "0"
        without = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        del os.environ["DEEPSERVE_CPU_KERNELS"]
    assert with_kernel == without


def test_kv_cache_dtype_is_validated():
    from deepserve import EngineArgs
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineArgs(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="fp8_e5m2"):      # the message lists the choices
        EngineArgs(kv_cache_dtype="fp4")


# --- fp8 KV caches (kv_cache_dtype="fp8" / "fp8_e5m2"): the KV_FP8_* builds widen each code exactly --------------
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.fixture(params=[None, "KV_FP8_F16C_ONLY", "KV_FP8_PORTABLE"], ids=["native", "f16c", "portable"])
def fp8_build(request, monkeypatch):
    """The fp8 builds as the engine loads them (AVX-512's fp16 conversion where the CPU has it), then built with
    -DKV_FP8_F16C_ONLY (the 8-wide F16C conversions of an AVX2 CPU) and with -DKV_FP8_PORTABLE (the integer-only
    widening of CPUs without either)."""
    if request.param:
        for dtype, defines in list(cpu._VARIANTS.items()):
            if dtype in FP8:
                monkeypatch.setitem(cpu._VARIANTS, dtype, defines + (request.param,))
    cpu._load.cache_clear()
    yield request.param
    cpu._load.cache_clear()


@requires_kernel
@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_fp8_cache_widens_every_code_exactly(dtype, fp8_build, lanes):
    """A sequence of one key attends with weight exactly 1, so the output is its value as the kernel widened it: every
    one of the 256 codes (NaN codes included) in value rows, against torch's own widening."""
    head_dim, hkv = 64, 2
    codes = torch.arange(256, dtype=torch.uint8)
    b = 256 // head_dim // hkv * 2          # sequences of one key; each (sequence, head) row holds 64 codes
    kv_cache = torch.zeros(2, b + 1, 16, hkv, head_dim, dtype=torch.uint8)
    kv_cache[1, 1:, 0] = codes.repeat(2).view(b, hkv, head_dim)
    kv_cache = kv_cache.view(dtype)
    tables = torch.arange(1, b + 1).view(b, 1)
    q = torch.randn(b, hkv, head_dim)
    out = run_kernel(q, kv_cache, tables, torch.ones(b, dtype=torch.int64), 0.125)
    torch.testing.assert_close(out, kv_cache[1, 1:, 0].float(), rtol=0, atol=0, equal_nan=True)


@requires_kernel
@pytest.mark.parametrize("dtype", FP8, ids=str)
@pytest.mark.parametrize("seq_lens", SEQ_LENS[-2:], ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fp8_cache_kernel_matches_reference(dtype, seq_lens, group, head_dim, fp8_build, lanes):
    q, kv_cache, tables, lens = random_case(seq_lens, hkv=2, group=group, head_dim=head_dim)
    cache8 = kv_cache.to(dtype)
    assert_matches_reference(run_kernel(q, cache8, tables, lens, 0.125), reference_decode(q, cache8, tables, lens, 0.125))
