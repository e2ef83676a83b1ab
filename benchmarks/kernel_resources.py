"""Registers, spills, shared memory and instruction mix of the decode path's big Triton kernels, compiled for an
H100 / H200 (sm_90) on any machine with Triton, GPU or not: Triton's compiler and the ptxas it ships build each
launch setting's cubin, `cuobjdump` reads its resource usage and SASS. From them, the programs of the launch that fit
an SM at once (by registers, shared memory and warps), the occupancy Nsight Compute calls "theoretical".

Why: at DeepSeek-V2-Lite's batch 256 the MLA decode kernel reads an E4M3 cache at 1.4 TB/s and a bf16 one at about
the copy bandwidth, in the same ~110 us (H100, session 30; Nsight Compute: 12.5% theoretical occupancy, "limited by
registers and shared memory"), and the MoE down GEMM reaches 75% of the copy bandwidth where gate/up reaches 94%.
This prices each candidate launch setting's registers and spills before any device time is spent on it.
Each case also lists its longest loop's instructions (`loop_counts`: a decode kernel's tile, a GEMM's K step).

Cases: the MLA decode kernel (V2-Lite: 16 heads, 512 + 64 latent; one split, as at batch 256) over a bf16 and an E4M3
cache at a grid of (tokens per tile, warps, stages, register cap); the paged GQA decode kernel over both caches
(128-wide heads in a split launch; 64-wide ones, Llama-3.2-1B's, split and in the unsplit deep pipeline); the fused
MoE gate/up and down GEMMs at the tiles the engine picks for batch 256 (the checked-in kernel_resources.json also
prices them with unmasked K loads, a switch timed in session 32 and removed in session 42); the skinny GEMM at 8 rows
on Llama-3.2-1B's weights (qkv, o_proj, gate/up with the SwiGLU, down split in 4 along K, the LM head).

Run (anywhere with Triton): python benchmarks/kernel_resources.py --output benchmarks/kernel_resources.json
  (--cases mla: the cases whose name holds one of these comma-separated words; --plot-only redraws the PNG.)
  The device machine's Triton and ptxas may allocate registers differently from another machine's: the JSON records
  both versions.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "kernels"))
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")     # Triton's default today; 3.9 warns when unset

# sm_90, per SM: 64K 32-bit registers allocated per warp in units of 256, 228 KB of shared memory of which 1 KB is
# reserved per resident block, 64 warps, 32 blocks.
SM_REGISTERS, REG_UNIT, SM_SHARED, BLOCK_RESERVED, SM_WARPS, SM_BLOCKS = 65536, 256, 228 * 1024, 1024, 64, 32

# SASS opcodes counted (prefix match on the mnemonic): spill traffic, tensor-core products (HMMA: a warp's mma.sync;
# HGMMA: Hopper's warpgroup MMA, which reads its operands from shared memory, so no LDSM), global loads (LDG) and
# asynchronous copies into shared memory (LDGSTS), barriers, fp8 -> fp16/bf16 conversions (F2FP).
OPCODES = ("LDL", "STL", "HMMA", "HGMMA", "LDG", "LDGSTS", "LDSM", "BAR", "F2FP", "MUFU")

# (keys per tile, warps, stages, register cap or None): DEEPSERVE_MLA_DECODE_TILES' values, the caps chosen for one
# more program per SM than the uncapped build holds.
MLA_TILES = [(16, 4, 3, None), (16, 4, 2, None), (32, 4, 3, None), (32, 4, 2, None), (32, 8, 3, None),
             (32, 8, 2, None), (64, 4, 2, None), (64, 8, 2, None), (16, 4, 3, 128), (32, 4, 2, 128), (32, 4, 2, 168)]


def mla_cases() -> dict:
    from deepserve.kernels.mla_decode import _mla_decode_kernel
    out = {}
    for cache in ("bf16", "fp8e4nv"):
        ptrs = {"cache_ptr": f"*{cache}", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
                "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32"}
        for block_n, warps, stages, cap in MLA_TILES:
            constexprs = dict(RANK=512, ROPE=64, CHUNK=128, BLOCK_P=64, BLOCK_H=16, BLOCK_N=block_n, SPLIT=False,
                              PRECISION="tf32", INPUTS_READY=True, USE_PDL=True)
            name = f"mla_decode {cache} {block_n}x{warps}x{stages}" + (f"r{cap}" if cap else "")
            out[name] = (_mla_decode_kernel, ptrs, constexprs, {"qk_scale": "fp32"}, warps, stages, cap)
    from deepserve.kernels import mla_decode_wgmma
    if mla_decode_wgmma.HAVE_GLUON:     # the warpgroup-MMA kernel over E4M3 (DEEPSERVE_MLA_WGMMA), unsplit and split
        for split in (False, True):
            out["mla_decode_wgmma fp8e4nv 64x4" + (" split" if split else "")] = (
                mla_decode_wgmma._mla_decode_wgmma_kernel, {**ptrs, "cache_ptr": "*fp8e4nv"},
                dict(RANK=512, SPLIT=split), {"qk_scale": "fp32"}, 4, 1, None)
    return out


def gqa_cases() -> dict:
    from dataclasses import replace
    from deepserve.kernels.decode_launch import DEEP_PIPELINE_TILES, DecodeTiles
    out = {}
    for cache in ("bf16", "fp8e4nv"):
        ptrs = {"cache_ptr": f"*{cache}", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
                **{n: "*i32" for n in ("block_tables_ptr", "seq_lens_ptr", "q_rows_ptr", "seq_ids_ptr")}}
        # 128-wide heads (Llama-3-8B, Qwen3-MoE) in a split launch; 64-wide (Llama-3.2-1B) split (batch 8-32) and
        # not (batch 64 at 4k: the deep pipeline).
        # Unsplit 128-wide launches too (Qwen3-MoE batch 256: 1024 programs), at two and three stages.
        # And two KV heads a program (DecodeTiles.kv_heads, DEEPSERVE_GQA_KV_HEADS_PER_PROGRAM=2): 64-wide heads, and
        # 128-wide ones unsplit (Qwen3-MoE batch 256 over E4M3).
        for head_dim, tiles, split in ((128, DecodeTiles(), True), (64, DecodeTiles(), True),
                                       (64, DEEP_PIPELINE_TILES, False), (128, DecodeTiles(), False),
                                       (128, DecodeTiles(num_stages=3), False), (64, DecodeTiles(kv_heads=2), True),
                                       (64, replace(DEEP_PIPELINE_TILES, kv_heads=2), False),
                                       (128, DecodeTiles(num_stages=3, heads_first=True, kv_heads=2), False),
                                       (128, DecodeTiles(32, 4, 3, heads_first=True, kv_heads=2), False)):
            out[_gqa_name(head_dim, cache, tiles, split)] = _gqa_case(ptrs, head_dim, tiles, split)
        # The split merge in the decode kernel (DEEPSERVE_DECODE_SPLIT_MERGE=last): its [heads, splits, head_dim]
        # merge tile beside the loop's registers, at the 1B's splits at 1k (9: a tile of 16, the largest it takes:
        # decode_launch.MERGE_MAX_ELEMENTS) and tiles of twice that (session 42's first limit): 64-wide heads
        # (Llama-3.2-1B at 4k), 128-wide of group 4 and 8 (Llama-3-8B, Qwen3-MoE).
        for head_dim, group, splits in ((64, 4, 16), (64, 4, 32), (128, 4, 16), (128, 8, 8)):
            tiles = DecodeTiles(heads_first=True)
            merge = dict(MERGE_LAST=True, MERGE_G=group, MERGE_S=splits, LATE_TRIGGER=True)
            out[_gqa_name(head_dim, cache, tiles, True) + f" merge-last g{group} s{splits}"] = \
                _gqa_case(ptrs, head_dim, tiles, True, merge)
    return out


def _gqa_name(head_dim: int, cache: str, tiles, split: bool) -> str:
    return f"gqa_decode d{head_dim} {cache} {tiles.block_n}x{tiles.num_warps}x{tiles.num_stages}" + \
        ("" if split else " unsplit") + (" kv-pairs" if tiles.kv_heads > 1 else "")


def _gqa_case(ptrs: dict, head_dim: int, tiles, split: bool, merge: dict | None = None) -> tuple:
    from deepserve.kernels.paged_attention import _decode_kernel
    constexprs = dict(HEAD_DIM=head_dim, BLOCK_D=head_dim * tiles.kv_heads, BLOCK_G=16, BLOCK_N=tiles.block_n,
                      SPLIT=split, EARLY_V=tiles.early_v, HEADS_FIRST=tiles.heads_first, VALUES_T=tiles.values_t,
                      KV_HEADS=tiles.kv_heads, INPUTS_READY=True, USE_PDL=True,
                      **(merge or dict(MERGE_LAST=False, MERGE_G=1, MERGE_S=1, LATE_TRIGGER=False)))
    return (_decode_kernel, {**ptrs, "count_ptr": "*i32"}, constexprs, {"qk_scale": "fp32"}, tiles.num_warps,
            tiles.num_stages, None)


# Llama-3.2-1B's weights (N x K) and whether the gate/up one runs the SwiGLU in its epilogue.
SKINNY_WEIGHTS = {"qkv": (3072, 2048, False), "o_proj": (2048, 2048, False), "gate_up": (16384, 2048, True),
                  "down": (2048, 8192, False), "lm_head": (128256, 2048, False)}


def skinny_cases() -> dict:
    """The skinny GEMM (kernels/skinny_gemm.py) on Llama-3.2-1B's weights at the engine's tiles: at 8 activation
    rows (`skinny_tiles`), the small-batch decode path of the dense 1B, whose steps read at 0.69-0.72 of the
    bandwidth roofline at batch 8-64 (H100, session 40); at 64 rows the weights `skinny_wide_tiles` takes (gate/up,
    down)."""
    from deepserve.kernels.skinny_gemm import _skinny_kernel, rows_tiles, skinny_tiles, skinny_wide_tiles
    out = {}
    for rows in (8, 64):
        for name, (n, k, swiglu) in SKINNY_WEIGHTS.items():
            wide = skinny_wide_tiles(n, k, swiglu)
            if rows > 32 and wide is None:
                continue                # cuBLAS's
            block_m, tiles = rows_tiles(rows, (wide if rows > 32 else None) or skinny_tiles(n, k))
            constexprs = dict(HAS_BIAS=False, SWIGLU=swiglu, HAS_LIMIT=False, TWO=False, ACCURATE_EXP=True,
                              EVEN_K=k % tiles.block_k == 0, BLOCK_M=block_m, BLOCK_N=tiles.block_n,
                              BLOCK_K=tiles.block_k, PREFETCH=tiles.prefetch, SPLIT_K=tiles.split_k, USE_PDL=True)
            tag = f" m{rows}" if rows > 8 else ""
            out[f"skinny {name} {n}x{k} n{tiles.block_n} k{tiles.block_k} split{tiles.split_k}{tag}"] = (
                _skinny_kernel, {"part_ptr": "*fp32", "counter_ptr": "*i32"}, constexprs,
                {"limit": "fp32"}, tiles.warps, tiles.stages, None, ("n_out", "k_len", "n_out2", "k_per_split"))
    return out


def moe_cases() -> dict:
    import torch
    from deepserve.kernels import fused_moe
    out = {}
    ints = {n: "*i32" for n in ("sorted_pairs_ptr", "block_expert_ptr")}
    for shape, (experts, top_k, inter) in {"qwen3-moe": (128, 8, 768), "deepseek-v2-lite": (64, 6, 1408)}.items():
        fused_moe.num_sms = lambda device: 132              # the H100's / H200's SMs (pick_config asks the device)
        cfg = fused_moe.pick_config(256 * top_k, experts, inter, 2048, torch.device("cpu"))
        tag = f"{shape} b256 m{cfg.block_m}"
        down_k, down_warps, down_stages = cfg.down_tiles()
        out[f"moe_gate_up {tag} n{cfg.block_n_up} k{cfg.block_k}"] = (
            fused_moe._gate_up_kernel, ints,
            dict(HAS_LIMIT=False, HAS_SHARED=False, SHARED_CHUNKS=1, PRECISION="tf32", BLOCK_M=cfg.block_m,
                 BLOCK_N=cfg.block_n_up, BLOCK_K=cfg.block_k, USE_PDL=True),
            {"limit": "fp32"}, cfg.num_warps, cfg.num_stages, None)
        out[f"moe_down {tag} n{cfg.block_n_down} k{down_k}"] = (
            fused_moe._down_kernel, {**ints, "weights_ptr": "*fp32"},
            dict(HAS_SHARED=False, PRECISION="tf32", BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n_down,
                 BLOCK_K=down_k, USE_PDL=True),
            {}, down_warps, down_stages, None)
    return out


def nvidia_tool(name: str, *args: str) -> str:
    """The stdout of one of the CUDA tools Triton ships (cuobjdump, ptxas)."""
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return subprocess.run([tool, *args], capture_output=True, text=True, check=True).stdout


def resident_blocks(regs: int, shared: int, warps: int) -> dict:
    """Blocks of `warps` warps that fit one SM at once, and what limits them."""
    regs_per_warp = -(-regs * 32 // REG_UNIT) * REG_UNIT
    limits = {"registers": SM_REGISTERS // (regs_per_warp * warps), "shared": SM_SHARED // (shared + BLOCK_RESERVED),
              "warps": SM_WARPS // warps, "blocks": SM_BLOCKS}
    blocks = min(limits.values())
    return {"blocks_per_sm": blocks, "limited_by": sorted(k for k, v in limits.items() if v == blocks),
            "occupancy": round(blocks * warps / SM_WARPS, 4)}


def loop_body(sass: str) -> list[str]:
    """The mnemonics (with their modifiers, e.g. LDSM.16.M88.4) of the longest loop in `sass`: from a backward
    branch's target to the branch. A decode kernel's main loop runs once a tile, so these are a tile's instructions
    a warp."""
    lines = sass.splitlines()
    address = {int(m.group(1), 16): i for i, line in enumerate(lines)
               if (m := re.search(r"/\*([0-9a-f]{4,})\*/\s", line))}
    best: list[str] = []
    for i, line in enumerate(lines):
        m = re.search(r"/\*([0-9a-f]{4,})\*/.*\bBRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", line)
        if m and int(m.group(2), 16) < int(m.group(1), 16) and int(m.group(2), 16) in address:
            body = [re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", x)
                    for x in lines[address[int(m.group(2), 16)]:i + 1]]
            ops = [o[0] for o in body if o]
            best = ops if len(ops) > len(best) else best
    return best


def measure(case) -> dict:
    from sm90_compile import aligned, compile_sm90_kernel
    kernel, ptrs, constexprs, scalars, warps, stages, maxnreg, *more_aligned = case
    start = time.perf_counter()
    hints = aligned(kernel) + (more_aligned[0] if more_aligned else ())     # + sizes a real launch sees as 16k
    compiled = compile_sm90_kernel(kernel, ptrs, constexprs, scalars, hints, warps, stages, maxnreg)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = nvidia_tool("cuobjdump", "--dump-resource-usage", f.name)
        sass = nvidia_tool("cuobjdump", "--dump-sass", f.name)
    fields = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage))
    mnemonics = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass)
    counts = {op: sum(1 for m in mnemonics if m == op or m.startswith(op + "_") or m.startswith(op + "."))
              for op in OPCODES}
    loop = loop_body(sass)
    regs, shared = int(fields["REG"]), compiled.metadata.shared
    return {"num_warps": warps, "num_stages": stages, "maxnreg": maxnreg, "registers": regs,
            "stack_bytes": int(fields["STACK"]), "shared_bytes": shared, **resident_blocks(regs, shared, warps),
            "sass_instructions": len(mnemonics), "sass_counts": counts,
            "loop_instructions": len(loop), "loop_counts": dict(sorted(Counter(loop).items(), key=lambda kv: -kv[1])),
            "compile_s": round(time.perf_counter() - start, 1)}


def plot(data: dict, path: str) -> None:
    """Registers a thread (spilled bytes marked) and programs resident per SM, one bar per case."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cases = {k: v for k, v in data["cases"].items() if "registers" in v}
    names = list(cases)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(8, 0.42 * len(names)), 7), sharex=True)
    x = range(len(names))
    top.bar(x, [cases[n]["registers"] for n in names], color=["tab:red" if cases[n]["stack_bytes"] else "tab:blue"
                                                                for n in names])
    top.axhline(255, ls=":", c="gray")
    top.set_ylabel("registers a thread\n(red: spills to the stack)")
    bottom.bar(x, [cases[n]["blocks_per_sm"] for n in names])
    bottom.set_ylabel("programs resident per SM")
    bottom.set_xticks(list(x), names, rotation=60, ha="right", fontsize=7)
    fig.suptitle(f"sm_90 builds: Triton {data['triton']}, {data['ptxas']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Description": data["command"]})


def main() -> None:
    import torch
    import triton
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="", help="comma-separated words: the cases to compile (default: all)")
    parser.add_argument("--output", default="kernel_resources.json")
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG beside --output from its JSON")
    args = parser.parse_args()
    if args.plot_only:
        with open(args.output) as f:
            plot(json.load(f), args.output.removesuffix(".json") + ".png")
        return
    cases = {**mla_cases(), **gqa_cases(), **moe_cases(), **skinny_cases()}
    words = [w for w in args.cases.split(",") if w]
    cases = {name: c for name, c in cases.items() if not words or any(w in name for w in words)}
    result = {"command": "python " + " ".join(sys.argv), "triton": triton.__version__, "torch": torch.__version__,
              "ptxas": nvidia_tool("ptxas", "--version").strip().splitlines()[-1], "target": "sm_90",
              "env": {k: v for k, v in os.environ.items() if k.startswith("DEEPSERVE_FP8")}, "cases": {}}
    for name, case in cases.items():
        try:
            result["cases"][name] = measure(case)
        except Exception as e:        # a setting that does not compile (shared memory): say so, go on
            result["cases"][name] = {"error": repr(e)[:400]}
        r = result["cases"][name]
        print(f"{name:48s}", {k: r.get(k) for k in ("registers", "stack_bytes", "shared_bytes", "blocks_per_sm",
                                                     "limited_by", "error") if k in r},
              r.get("sass_counts", ""), flush=True)
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)
    plot(result, args.output.removesuffix(".json") + ".png")


if __name__ == "__main__":
    main()
