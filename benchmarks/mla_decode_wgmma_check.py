"""A GPU check of the wgmma MLA decode kernels against the float32 reference: the max error of four cases (one
tile, one key, two sequences, splits) with DEEPSERVE_MLA_WGMMA_REG_OUT off and on; where the REG_OUT kernel's
output is wrong, which columns and heads are, and which reference column each output column matches best (a wrong
row mapping in kernels/mla_decode_wgmma_regs.py shows as a permutation). On an sm_90 GPU, from the repository root:
`python benchmarks/mla_decode_wgmma_check.py`."""

import math
import os
import sys

sys.path.insert(0, "tests/gpu")
import torch
from kernel_testing import make_batch
from deepserve.kernels.mla_decode import mla_decode, mla_decode_ref

torch.manual_seed(0)
dev = "cuda"
for lens, heads, bs in (([64], 16, 16), ([1], 16, 16), ([100, 7], 16, 64), ([1030, 300], 20, 16)):
    nb = sum(-(-n // bs) for n in lens) + 8
    batch = make_batch([(n - 1, 1) for n in lens], bs, nb, dev)
    cache = (torch.randn(nb, bs, 576, device=dev) * 2).to(torch.float8_e4m3fn)
    q_lat = torch.randn(len(lens), heads, 512, device=dev).to(torch.bfloat16)
    q_pe = torch.randn(len(lens), heads, 64, device=dev).to(torch.bfloat16)
    ref = mla_decode_ref(q_lat, q_pe, cache, batch.block_tables, batch.seq_lens, 1 / math.sqrt(576)).float()
    outs = {}
    for flag in ("0", "1"):
        os.environ["DEEPSERVE_MLA_WGMMA_REG_OUT"] = flag
        outs[flag] = mla_decode(q_lat, q_pe, cache, batch.block_tables, batch.seq_lens, 1 / math.sqrt(576),
                                max_seq_len=max(lens), num_splits=1 if len(lens) < 2 else 3).float()
    for flag, out in outs.items():
        err = (out - ref).abs()
        print(lens, heads, bs, "REG_OUT", flag, "max err", err.max().item(), "ref max", ref.abs().max().item(),
              "nan", out.isnan().any().item())
    out = outs["1"]
    err = (out - ref).abs()
    bad_cols = (err.amax((0, 1)) > 0.05 * ref.abs().max()).nonzero().flatten().tolist()
    bad_heads = (err.amax((0, 2)) > 0.05 * ref.abs().max()).nonzero().flatten().tolist()
    print("  bad columns", len(bad_cols), bad_cols[:24], "bad heads", bad_heads)
    if bad_cols:
        o = out.reshape(-1, 512)
        r = ref.reshape(-1, 512)
        d = torch.cdist(o.t(), r.t())        # [512 out cols, 512 ref cols]
        best = d.argmin(1).tolist()
        print("  best-matching ref column for out columns 0..47:", best[:48])
        print("  out col 0 vs ref col 0:", o[:4, 0].tolist(), r[:4, 0].tolist())
