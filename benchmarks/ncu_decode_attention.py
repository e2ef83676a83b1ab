"""Drive the decode-attention kernels at small batch for Nsight Compute (decode_attention_ncu_b8_h200.json): the MLA
kernel at DeepSeek-V2-Lite's shape (16 heads, 512 + 64 latent) at batch 8 and 1, and the paged GQA kernel at
Qwen3-MoE's, Llama-3-8B's and Llama-3.2-1B's head layouts at batch 8; 1k context, bf16, block size 16, shuffled
blocks, four calls per case (ncu profiles each launch).

Run (GPU machine):
  ncu --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
      --section MemoryWorkloadAnalysis --section SchedulerStats \
      -k regex:'_decode_kernel|_mla_decode_kernel|_mla_reduce_kernel|_decode_reduce_kernel' \
      python benchmarks/ncu_decode_attention.py            (--large: Llama-3-8B batch 64, Qwen3-MoE batch 128 at 1k;
                                                            --mla-large: the MLA kernel at batch 256, 1k, over a
                                                            bf16 and an E4M3 cache, two calls each;
                                                            --gqa-large: the GQA kernel at Qwen3-MoE batch 256 over
                                                            bf16 and E4M3, Llama-3.2-1B batch 64 over bf16, 1k;
                                                            --values-t: Qwen3-MoE batch 256 over E4M3, values
                                                            stored as the cache's or transposed in each block)
"""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from deepserve.kernels.mla_decode import mla_decode  # noqa: E402
from deepserve.kernels.paged_attention import decode_attention  # noqa: E402
from tune_decode_attention import paged_inputs  # noqa: E402


def mla(batch, ctx, reps=4, cache_dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    nb, table, lens = paged_inputs(batch, ctx, g)
    cache = torch.randn(nb, 16, 576, dtype=torch.bfloat16, device="cuda").to(cache_dtype)
    ql = torch.randn(batch, 16, 512, dtype=torch.bfloat16, device="cuda")
    qp = torch.randn(batch, 16, 64, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(ql)
    for _ in range(reps):
        mla_decode(ql, qp, cache, table, lens, 0.1, out=out, max_seq_len=ctx)
    torch.cuda.synchronize()


def gqa(batch, ctx, h, hkv, d, reps=4, cache_dtype=torch.bfloat16, tiles=None):
    g = torch.Generator().manual_seed(0)
    nb, table, lens = paged_inputs(batch, ctx, g)
    cache = torch.randn(2, nb, 16, hkv, d, dtype=torch.bfloat16, device="cuda").to(cache_dtype)
    if tiles is not None and tiles.values_t:     # each block's values stored [KV heads, head_dim, slots]
        cache[1] = cache[1].permute(0, 2, 3, 1).contiguous().view(cache[1].shape)
    q = torch.randn(batch, h, d, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    for _ in range(reps):
        decode_attention(q, cache, table, lens, 0.1, out=out, max_seq_len=ctx, tiles=tiles)
    torch.cuda.synchronize()


def main() -> None:
    if sys.argv[1:] == ["--large"]:      # the no-split launches of 512 programs (decode_attention_in_step.py)
        gqa(64, 1046, 32, 8, 128)      # Llama-3-8B batch 64
        gqa(128, 1046, 32, 4, 128)     # Qwen3-30B-A3B batch 128
        return
    if sys.argv[1:] == ["--gqa-large"]:  # no split: 1024 programs at Qwen3-MoE batch 256, 512 at the 1B's batch 64
        gqa(256, 1024, 32, 4, 128, reps=2)
        gqa(256, 1024, 32, 4, 128, reps=2, cache_dtype=torch.float8_e4m3fn)
        gqa(64, 1024, 32, 8, 64, reps=2)
        return
    if sys.argv[1:] == ["--values-t"]:   # Qwen3-MoE batch 256 over E4M3: the engine's tiles, then values transposed
        from deepserve.kernels.decode_launch import DecodeTiles
        gqa(256, 1024, 32, 4, 128, reps=2, cache_dtype=torch.float8_e4m3fn,
            tiles=DecodeTiles(num_stages=3, heads_first=True))
        gqa(256, 1024, 32, 4, 128, reps=2, cache_dtype=torch.float8_e4m3fn,
            tiles=DecodeTiles(num_stages=3, heads_first=True, values_t=True))
        return
    if sys.argv[1:] == ["--mla-large"]:  # one split, 256 programs: V2-Lite's batch-256 step, bf16 against fp8 KV
        mla(256, 1024, reps=2)
        mla(256, 1024, reps=2, cache_dtype=torch.float8_e4m3fn)
        return
    mla(8, 1024)
    mla(1, 1024)
    gqa(8, 1024, 32, 4, 128)   # Qwen3-30B-A3B
    gqa(8, 1024, 32, 8, 128)   # Llama-3-8B
    gqa(8, 1024, 32, 8, 64)    # Llama-3.2-1B


if __name__ == "__main__":
    main()
