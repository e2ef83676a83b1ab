"""Whether a change left the GQA attention kernels' sm_90 code as it was, on a machine without a GPU: the paged
decode kernel (split with the in-kernel merge, and unsplit) and the prefill kernel at Llama-3.2-1B's shapes, at
their defaults (no sliding window), compiled to PTX at a base revision (a git worktree) and at the working tree, then
compared instruction by instruction (debug info and labels left out; "same instructions, other order" when only
their order differs). Needs Triton (any version that targets sm_90: tests/kernels/sm90_compile.py).

    python benchmarks/compare_attention_ptx.py --base 96ccd36 [--output F.json]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Run in a child interpreter per tree, so each imports its own deepserve.
COMPILE = r'''
import json, sys
sys.path.insert(0, sys.argv[1]); sys.path.insert(1, sys.argv[2])
from deepserve.kernels import paged_attention as pa, paged_prefill as pp
from sm90_compile import compile_sm90_kernel
ptrs = {"q_ptr": "*bf16", "cache_ptr": "*bf16", "out_ptr": "*bf16", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
        "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "q_rows_ptr": "*i32", "seq_ids_ptr": "*i32",
        "count_ptr": "*i32"}
base = dict(HEAD_DIM=64, BLOCK_D=64, BLOCK_G=16, BLOCK_N=64, EARLY_V=False, HEADS_FIRST=True, VALUES_T=False,
            KV_HEADS=1, INPUTS_READY=True, USE_PDL=True)
out = {}
for name, extra in [("decode_split_merge", dict(SPLIT=True, MERGE_LAST=True, MERGE_G=4, MERGE_S=16, LATE_TRIGGER=True)),
                    ("decode_unsplit", dict(SPLIT=False))]:
    out[name] = compile_sm90_kernel(pa._decode_kernel, ptrs, {**base, **extra}, scalar_types={"qk_scale": "fp32"},
                                    num_stages=2).asm["ptx"]
pre = {"q_ptr": "*bf16", "cache_ptr": "*bf16", "out_ptr": "*bf16", "block_tables_ptr": "*i64", "seq_lens_ptr": "*i64",
       "query_start_ptr": "*i64", "tile_seq_ptr": "*i32", "tile_m0_ptr": "*i32"}
out["prefill"] = compile_sm90_kernel(pp._prefill_kernel, pre, dict(HEAD_DIM=64, BLOCK_D=64, BLOCK_M=64, BLOCK_N=64),
                                     scalar_types={"qk_scale": "fp32"}, num_stages=2).asm["ptx"]
print(json.dumps(out))
'''


def instructions(ptx: str) -> list[str]:
    """The PTX's code lines: no debug sections, comments, .loc / .file lines or label lines; label names erased."""
    lines = []
    for line in ptx.split("\n"):
        if re.match(r"\s*\.section\s+\.debug", line):
            break
        stripped = line.strip()
        if not stripped or stripped.startswith(("//", ".loc", ".file")) or re.match(r"\$L__\w+:$", stripped):
            continue
        lines.append(re.sub(r"\$L__\w+", "$L", stripped))
    return lines


def compile_tree(tree: Path) -> dict[str, str]:
    done = subprocess.run([sys.executable, "-c", COMPILE, str(tree), str(ROOT / "tests" / "kernels")],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the git revision to compare the working tree with")
    ap.add_argument("--output", default="")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        worktree = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(worktree), args.base],
                       check=True)
        try:
            before = compile_tree(worktree)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)], check=True)
    after = compile_tree(ROOT)
    result = {}
    for name in before:
        a, b = instructions(before[name]), instructions(after[name])
        verdict = "identical" if a == b else "same instructions, other order" if sorted(a) == sorted(b) else "differ"
        result[name] = {"verdict": verdict, "instructions": len(b), "lines_differing_in_order":
                        sum(x != y for x, y in zip(a, b)) if verdict != "differ" else None}
        print(f"{name:20s} {verdict} ({len(a)} -> {len(b)} instructions)")
    if args.output:
        Path(args.output).write_text(json.dumps({"command": "python " + " ".join(sys.argv), "base": args.base,
                                                 "results": result}, indent=1) + "\n")


if __name__ == "__main__":
    main()
