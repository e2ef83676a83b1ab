#!/bin/bash
# The GPU work that waits for a device machine, in stages that each fit one device call (10 minutes at most): the
# A/B switches written while no GPU was lent (docs/gpu.md lists them), the GPU tests of the committed defaults, and
# the decode sweeps that issue 21's targets are read from. Each stage writes its files into $OUT (the device tool
# returns them) and prints a summary; the full logs stay in /tmp. docs/gpu_stages.md says what each stage ran in its
# sessions and which files it wrote.
#
# Run from the repository root on the device machine, one stage per call, with the wheels of the packages the image
# lacks in .whl/ (README "GPU"; the device tool's `carry: [".whl"]`):
#   bash benchmarks/gpu_pending.sh kernels   # ~4 min: the MLA decode tiles' kernel-level A/B (no model build)
#   bash benchmarks/gpu_pending.sh tests     # ~3 min: tests/gpu under pytest-xdist if present, then gpu_alone
#   bash benchmarks/gpu_pending.sh mla-ab    # ~9 min: V2-Lite steps over an E4M3 cache, MLA decode tiles
#   bash benchmarks/gpu_pending.sh mla-sm-ab   # ~6 min: V2-Lite steps, MLA programs an SM x tiles
#   bash benchmarks/gpu_pending.sh profiles    # ~6 min: kernel tables with PDL off, MoE batch 256 and dense 1B
#   bash benchmarks/gpu_pending.sh skinny64-ab # ~8 min: DEEPSERVE_SKINNY_64_ROWS=0,1 in steps at batch 48 / 64
#   bash benchmarks/gpu_pending.sh gqa-ncu     # ~2 min: Nsight Compute of the GQA decode kernel at large batch
#   bash benchmarks/gpu_pending.sh gqa-order   # ~3 min: the GQA decode kernel with a row's KV heads launched together
#   bash benchmarks/gpu_pending.sh gqa-launch-ab  # ~3 min: steps, DEEPSERVE_GQA_DECODE_LAUNCH=rows-first,heads-first
#   bash benchmarks/gpu_pending.sh gqa-in-step # ~2 min: the launch orders with a cache a layer, between GEMMs
#   bash benchmarks/gpu_pending.sh moe-ncu     # ~2 min: Nsight Compute of the fused MoE's GEMMs at 256 tokens
#   bash benchmarks/gpu_pending.sh gqa-regs    # ~3 min: the GQA decode kernel at large batch under register caps
#   bash benchmarks/gpu_pending.sh align-gather  # ~5 min: DEEPSERVE_MOE_ALIGN_GATHER: tests, the align alone, steps
#   bash benchmarks/gpu_pending.sh values-t64  # ~3 min: GQA decode over E4M3, values transposed, 16- and 64-slot blocks
#   bash benchmarks/gpu_pending.sh l2-prefetch # ~9 min: DEEPSERVE_L2_PREFETCH (session 27's, never timed), dense steps
#   bash benchmarks/gpu_pending.sh graph-tokens-1b  # ~4 min: DEEPSERVE_GRAPH_TOKENS=0,1 in Llama-3.2-1B steps
#   bash benchmarks/gpu_pending.sh gqa-pairs   # ~8 min: two KV heads a decode program: tests, calls, 1B steps
#   bash benchmarks/gpu_pending.sh s40-check   # ~7 min: tests/gpu, then 1B steps: KV head pairs never / auto
#   bash benchmarks/gpu_pending.sh s41-first   # ~9 min: tests/gpu, then 1B steps at batch 1-64: DEEPSERVE_L2_PREFETCH
#   bash benchmarks/gpu_pending.sh split-merge # ~6 min: DEEPSERVE_DECODE_SPLIT_MERGE: tests, 1B steps at batch 1-32
#   bash benchmarks/gpu_pending.sh s42-timeline  # ~3 min: 1B batch 1 / 2 graph timelines, reduce / last, PDL off / on
#   bash benchmarks/gpu_pending.sh s42-check   # ~8 min: tests/gpu, then 1B steps at batch 1-32: reduce / last (default)
#   bash benchmarks/gpu_pending.sh s42-others  # ~4 min: the same in Qwen3-MoE and Llama-3-8B steps at batch 8 / 32
#   bash benchmarks/gpu_pending.sh merge-splits  # ~2 min: decode split counts at kernel level, merge reduce / last
#   bash benchmarks/gpu_pending.sh merge-splits-wide  # ~3 min: split counts past the one-wave line, merge in the kernel
#   bash benchmarks/gpu_pending.sh split-rule  # ~6 min: split counts sized for the in-kernel merge, in steps
#   bash benchmarks/gpu_pending.sh deploy-len  # ~5 min: Llama-3.2-1B 1k steps from an engine sized for 128k
#   bash benchmarks/gpu_pending.sh deploy-len-moe  # ~2 min: the same for Qwen3-MoE / V2-Lite at their contexts
#   bash benchmarks/gpu_pending.sh deploy-len-moe-vs  # ~2 min: those against engines sized for ~1.1k, one call
#   bash benchmarks/gpu_pending.sh kernel-table  # ~3 min: 1B batch 1 / 8 / 64 replays' kernels by name, PDL off / on
#   bash benchmarks/gpu_pending.sh kernel-table-splits  # ~4 min: the same at batch 1 / 8, decode splits forced
#   bash benchmarks/gpu_pending.sh next-first # ~7 min: kernel-table at today's code, then splits-4k (session 47's next)
#   bash benchmarks/gpu_pending.sh v2lite-timeline  # ~3 min: V2-Lite batch 64 / 256 graph timelines over E4M3
#   bash benchmarks/gpu_pending.sh s48-first  # ~7 min: v2lite-timeline, then splits-4k
#   bash benchmarks/gpu_pending.sh moe-b256   # ~5 min: V2-Lite's MoE at 256 tokens: down tiles, shared fused / apart
#   bash benchmarks/gpu_pending.sh side-streams  # ~9 min: the side-stream switches: GPU tests, V2-Lite steps 64-256
#   bash benchmarks/gpu_pending.sh s50        # ~5 min: (d9ec60b) MLA warp chunks: tests, calls, steps; capture priority
#   bash benchmarks/gpu_pending.sh s56-first  # ~3 min: the MLA decode under Nsight Compute, V2-Lite b256 timeline
#   bash benchmarks/gpu_pending.sh router-splits  # ~7 min: DEEPSERVE_ROUTER_SPLITS=0,2,4 in MoE steps at batch 64 / 256
#   bash benchmarks/gpu_pending.sh reg-scores  # ~8 min: DEEPSERVE_MLA_WGMMA_REG_SCORES: tests, kernel calls, steps
#   bash benchmarks/gpu_pending.sh s55-async  # ~8 min: DEEPSERVE_MLA_WGMMA_ASYNC: tests, kernel calls, V2-Lite steps
#   bash benchmarks/gpu_pending.sh s51-wgmma  # ~3 min: DEEPSERVE_MLA_WGMMA: tests, kernel calls, V2-Lite steps
#   bash benchmarks/gpu_pending.sh s51        # ~5 min: V2-Lite steps over E4M3, MLA decode tiles 32x4x3 / 32x4x4
#   bash benchmarks/gpu_pending.sh s51-v41    # ~3 min: DeepSeek-V4.1 decode kernel tables at batch 1 / 8
#   bash benchmarks/gpu_pending.sh s50-v41    # ~2 min: DeepSeek-V4.1 decode steps, shared experts on a side stream 0/1
#   bash benchmarks/gpu_pending.sh side-timeline  # ~1 min: V2-Lite batch 256's graph timeline (side stream)
#   bash benchmarks/gpu_pending.sh cublaslt-dense  # ~4 min: TORCH_BLAS_PREFER_CUBLASLT=0,1 in 1B steps, 64-256
#   bash benchmarks/gpu_pending.sh s49-short  # ~4 min: s49-check's A/Bs in one pass, its side-stream tests only
#   bash benchmarks/gpu_pending.sh s49-check  # ~7 min: tests/gpu, side stream in pair mode, MoE sweep, priority
#   bash benchmarks/gpu_pending.sh splits-4k  # ~4 min: 1B batch 1 / 8 at 4k, decode splits by the rule / 16 / 64
#   bash benchmarks/gpu_pending.sh merge-one-tile  # ~2 min: DEEPSERVE_DECODE_MERGE_ONE_TILE=0,1 in 1B steps
#   bash benchmarks/gpu_pending.sh gqa-pairs-moe  # ~4 min: the same in Qwen3-MoE steps over an E4M3 cache
#   bash benchmarks/gpu_pending.sh combine-ab  # ~9 min: MoE decode steps, DEEPSERVE_MOE_COMBINE_IN_NORM=0,1
#   bash benchmarks/gpu_pending.sh combine-timeline  # ~4 min: Qwen3-MoE batch 256's graph timeline with it on
#   bash benchmarks/gpu_pending.sh mla-splits  # ~4 min: V2-Lite's MLA decode kernel at batch 128 / 256, tiles x splits
#   bash benchmarks/gpu_pending.sh decode-edges  # ~7 min: session 46's step-edge changes: tests, 1B steps vs before
#   bash benchmarks/gpu_pending.sh gemv-tiling  # ~6 min: the batch-1 GEMV's tilings on this GPU, the best in 1B steps
#   bash benchmarks/gpu_pending.sh s47-first  # ~6 min: V4.1's GPU tests; a step's input / output paths; 1B's gaps
#   bash benchmarks/gpu_pending.sh s47-all   # ~8 min: V4.1's GPU tests, step_io_paths.py, then mapped-io at b1 / 8 / 64
#   bash benchmarks/gpu_pending.sh s47-check  # ~9 min: tests/gpu with mapped step I/O on, then Qwen3-MoE steps 0 / 1
#   bash benchmarks/gpu_pending.sh mapped-io  # ~7 min: DEEPSERVE_MAPPED_STEP_IO: its GPU tests, then 1B steps 0 / 1
#   bash benchmarks/gpu_pending.sh window    # ~2 min: sliding-window attention: its GPU tests, one layer's kernels
#   bash benchmarks/gpu_pending.sh window-check  # ~4 min: window, then every GPU test file of the GQA attention paths
#   bash benchmarks/gpu_pending.sh sweeps    # ~7 min: the MoE (E4M3 and bf16 caches) and dense decode sweeps
#   (two stages in one call: `for s in tests sweeps; do bash benchmarks/gpu_pending.sh $s; done`)
# The stages that time kernels/mla_decode.py's Triton kernel over an 8-bit cache (kernels, mla-ab, mla-splits,
# mla-sm-ab, s50, s51) turn DEEPSERVE_MLA_WGMMA off, the default since session 54 there.
# MLA_TILES="32x4x3,16x4x3" narrows mla-ab to the settings the kernels stage favoured (default: all four).
set -u
STAGE=${1:?"a stage, one of those listed at the top of this script"}
OUT=${OUT:-/tmp/gpu_pending_out}
mkdir -p "$OUT"

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || { echo "wheel install failed"; exit 1; }
pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "editable install failed"
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
t0=$(date +%s)
elapsed() { echo "[t=$(( $(date +%s) - t0 )) s] $*"; }

summarise_steps() {   # the rows of an ab_env_sweep.py JSON: setting, label, step ms, the roofline ratios
    python3 - "$1" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for setting, rows in d["results"].items():
    for r in rows:
        print(f"{setting:40s} {r['label']:28s} {r['step_ms']:8.3f} ms", r.get("experts_roofline_ratio", ""),
              r.get("fraction_of_roofline", ""))
PY
}

mla_switch_ab() {   # A/B of a wgmma MLA decode switch $2 (0 / 1), files named $1_*: its GPU tests
    # (tests/gpu/test_mla_decode_wgmma.py, `-k $5` unless empty), kernel calls at V2-Lite batch 64 / 128 / 256 over
    # E4M3 under the settings $3, then (tests passed) V2-Lite steps over E4M3 at batches $4, two passes
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_mla_decode_wgmma.py -x ${5:+-k "$5"} \
        > "$OUT/pytest_$1.log" 2>&1
    tail -2 "$OUT/pytest_$1.log" | cut -c1-300
    grep -E "^(FAILED|E )" "$OUT/pytest_$1.log" | head -8
    elapsed "wgmma tests"
    timeout 150 python3 benchmarks/fp8_attention_kernels.py --cache-dtypes float8_e4m3fn --settings "$3" \
        --cases "v2-lite b64 ctx1024,v2-lite b128,v2-lite b256" --output "$OUT/$1_kernels.json" \
        > "/tmp/$1_kernels.log" 2>&1
    tail -1 "/tmp/$1_kernels.log" | cut -c1-300; summarise_kernels "$OUT/$1_kernels.json"
    elapsed "wgmma kernels"
    grep -q " failed" "$OUT/pytest_$1.log" && { echo "tests failed: no steps"; return; }
    timeout 330 python3 benchmarks/ab_env_sweep.py --setting "$2=0,1" --passes 2 --timeout 70 \
        --output "$OUT/$1_v2lite_ab.json" -- --shapes deepseek-v2-lite --contexts 1024 \
        --batches "$4" --kv-cache-dtype fp8 --profile-batch 0 > "/tmp/$1_ab.log" 2>&1
    tail -1 "/tmp/$1_ab.log" | cut -c1-300; summarise_steps "$OUT/$1_v2lite_ab.json"
    elapsed "$1 steps"
}

summarise_sweeps() {   # the sweeps written under $OUT (moe_fp8, moe_auto, dense_auto): each batch's step, tok/s, ratios
    python3 - "$OUT" <<'PY'
import json, os, sys
for name in ("moe_fp8", "moe_auto", "dense_auto"):
    path = os.path.join(sys.argv[1], name + ".json")
    if not os.path.exists(path):
        print(name, "missing"); continue
    d = json.load(open(path)); print(name, d["gpu"], d["bandwidth_Bps"])
    for shape, by_context in d["results"].items():
        for context, entry in by_context.items():
            for r in entry.get("batches", []):
                print(f"  {shape} {context} b{r['batch']}: {r['step_ms']} ms, {r['tokens_per_s']} tok/s, experts ratio",
                      r.get("experts_roofline_ratio"), "roofline fraction", r["fraction_of_roofline"])
            if "error" in entry:
                print(" ", shape, context, entry["error"][-300:])
PY
}

summarise_timelines() {   # the graph timelines of an h200_decode_sweep.py JSON's shape $3 (Llama-3.2-1B) at context $2
    # (1k): step, span, idle, one layer's launches in order (sequence), the replay's ten longest kernels by name
    # (by_kernel) and the eight that add the most to the span (exposed_by_kernel)
    python3 - "$1" "${2:-1024}" "${3:-llama-3.2-1b}" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for b in d["results"][sys.argv[3]][sys.argv[2]]["batches"]:
    t = b.get("graph_timeline") or {}
    print(sys.argv[1].rsplit("/", 1)[-1], "batch", b["batch"], "step", b["step_ms"], "span", t.get("span_us"),
          "idle", t.get("idle_us"), [(n[:18], us) for n, us in t.get("sequence", [])[8:20]])
    for name, n, us in t.get("by_kernel", [])[:10]:
        print(f"    {us:8.1f} us  x{n:5.1f}  {name[:60]}")
    for name, us in t.get("exposed_by_kernel", [])[:8]:      # what each kernel name adds to the span
        print(f"    exposed {us:8.1f} us  {name[:60]}")
PY
}

summarise_kernels() {   # the calls of an fp8_attention_kernels.py JSON: setting, case, label, us, KV TB/s
    python3 - "$1" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for setting, cases in d["by_setting"].items():
    for case, rows in cases.items():
        if case == "error":
            print(setting, rows[-800:]); continue
        for label, r in rows.items():
            print(f"{setting:34s} {case:30s} {label:26s}", r.get("us"), "us", r.get("kv_TBps"), "TB/s",
                  r.get("error", "")[:120])
PY
}

v2lite_b256_timeline() {   # NAME: V2-Lite batch 256's graph timeline over E4M3 at 1k into $OUT/NAME.json, summarised
    timeout 200 python3 benchmarks/h200_decode_sweep.py \
        --shapes deepseek-v2-lite --batches 256 --contexts 1024 --kv-cache-dtype fp8 --profile-batch 0 \
        --timeline-batch 256 --output "$OUT/$1.json" > "/tmp/$1.log" 2>&1
    tail -1 "/tmp/$1.log" | cut -c1-200
    summarise_timelines "$OUT/$1.json" 1024 deepseek-v2-lite
}

ncu_kernels() {   # KERNELS CSV COMMAND...: Nsight Compute's view of COMMAND's launches of KERNELS (a regex)
    command -v ncu > /dev/null || { echo "no ncu on this machine"; return; }
    timeout 200 ncu --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
        --section MemoryWorkloadAnalysis --section LaunchStats -k "regex:^$1\$" --csv --page details \
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
        "${@:3}" > "$2" 2> /tmp/ncu_kernels.err
    python3 - "$2" <<'PY'
import csv, sys
lines = open(sys.argv[1]).read().splitlines()
rows = csv.DictReader(lines[next(i for i, l in enumerate(lines) if l.startswith('"ID"')):])
keys = ("Duration", "DRAM Throughput", "Registers Per Thread", "Achieved Occupancy", "Theoretical Occupancy",
        "Warp Cycles Per Issued Instruction", "Dynamic Shared Memory Per Block", "Block Limit Registers",
        "Block Limit Shared Mem", "Issue Slots Busy", "Compute (SM) Throughput", "L2 Hit Rate",
        "Eligible Warps Per Scheduler")
for r in rows:       # the stall reasons: warps stalled for each, per issued instruction (the larger ones)
    stall = "issue_stalled" in r["Metric Name"]
    if r["Metric Name"] in keys or (stall and float(r["Metric Value"].replace(",", "") or 0) >= 0.2):
        print(r["ID"], r.get("Kernel Name", "")[:16], r["Grid Size"], r["Metric Name"], r["Metric Value"],
              r["Metric Unit"])
PY
    tail -3 /tmp/ncu_kernels.err
}

case "$STAGE" in
kernels)
    export DEEPSERVE_MLA_WGMMA=0
    timeout 240 python3 benchmarks/fp8_attention_kernels.py --settings "DEEPSERVE_FP8_PRODUCTS=f16" \
        --cases deepseek-v2-lite --tiles 32x4x3,16x4x3,32x4x2,32x4x2r168,16x4x3r128,32x4x2r128 \
        --output "$OUT/mla_tiles_kernels.json" > /tmp/mla_tiles.log 2>&1
    tail -12 /tmp/mla_tiles.log | cut -c1-1500; elapsed "mla tiles"
    ;;
tests)
    n=""; python3 -c "import xdist" 2>/dev/null && n="-n 8"
    timeout 360 python3 -m pytest -q $n tests/gpu -p no:cacheprovider > "$OUT/pytest_gpu.log" 2>&1
    tail -15 "$OUT/pytest_gpu.log"; elapsed "tests/gpu"
    timeout 150 python3 -m pytest -q tests/gpu -m gpu_alone -p no:cacheprovider > "$OUT/pytest_gpu_alone.log" 2>&1
    tail -3 "$OUT/pytest_gpu_alone.log"; elapsed "gpu_alone"
    ;;
mla-ab)
    export DEEPSERVE_MLA_WGMMA=0
    timeout 570 python3 benchmarks/ab_env_sweep.py \
        --setting "DEEPSERVE_MLA_DECODE_TILES=${MLA_TILES:-32x4x3,16x4x3,32x4x2r168,16x4x3r128}" --passes 1 \
        --timeout 130 --output "$OUT/mla_tiles_ab.json" -- --shapes deepseek-v2-lite --batches 8,64,128,256 \
        --kv-cache-dtype fp8 --profile-batch 0 > /tmp/mla_ab.log 2>&1
    tail -3 /tmp/mla_ab.log; summarise_steps "$OUT/mla_tiles_ab.json"; elapsed "mla-ab"
    ;;
mla-splits)
    export DEEPSERVE_MLA_WGMMA=0
    # Batch 256 runs one split (256 programs, two an SM by registers) and its E4M3 kernel reads at about 1.4 TB/s
    # (H100, session 30): does a second split or a deeper pipeline read faster? (Session 34, H100,
    # mla_splits_kernels_h100_s34.json: no; nor the token-major kernel it also timed.)
    timeout 280 python3 benchmarks/fp8_attention_kernels.py --cache-dtypes bfloat16,float8_e4m3fn \
        --settings "DEEPSERVE_FP8_PRODUCTS=f16" \
        --cases "v2-lite b128,v2-lite b256" --output "$OUT/mla_splits_kernels.json" \
        --tiles "${MLA_SPLIT_TILES:-32x4x3s1,32x4x3s2,32x4x4,32x8x3}" \
        > /tmp/mla_splits.log 2>&1
    # bf16 then E4M3, two calls each
    ncu_kernels _mla_decode_kernel "$OUT/ncu_mla_b256.csv" python3 benchmarks/ncu_decode_attention.py --mla-large
    summarise_kernels "$OUT/mla_splits_kernels.json"
    elapsed "mla-splits"
    ;;
mla-sm-ab)
    export DEEPSERVE_MLA_WGMMA=0
    # The split heuristic's programs an SM (2: one split at batch 256) against others, with and without a register
    # cap that lets more programs share an SM; MLA_SM / MLA_SM_TILES set the values.
    timeout 570 python3 benchmarks/ab_env_sweep.py --setting "DEEPSERVE_MLA_PROGRAMS_PER_SM=${MLA_SM:-2,4}" \
        --setting "DEEPSERVE_MLA_DECODE_TILES=${MLA_SM_TILES:-32x4x3,32x4x3r128}" --passes "${PASSES:-1}" \
        --timeout 130 --output "$OUT/mla_programs_per_sm_ab.json" -- --shapes deepseek-v2-lite --batches 128,256 \
        --kv-cache-dtype fp8 --profile-batch 0 > /tmp/mla_sm_ab.log 2>&1
    tail -3 /tmp/mla_sm_ab.log; summarise_steps "$OUT/mla_programs_per_sm_ab.json"; elapsed "mla-sm-ab"
    ;;
profiles)
    # Kernel tables with DEEPSERVE_PDL=0, where each kernel's duration is its own (under PDL it includes the wait for
    # its predecessor): the MoE shapes at batch 256 over an E4M3 cache, Llama-3.2-1B at batch 8 and 64.
    DEEPSERVE_PDL=0 timeout 280 python3 benchmarks/h200_decode_sweep.py --shapes qwen3-moe,deepseek-v2-lite \
        --batches 256 --contexts 1024 --kv-cache-dtype fp8 --profile-batch 256 \
        --output "$OUT/moe_b256_pdl_off_profile.json" > /tmp/moe_profile.log 2>&1
    grep " profile " /tmp/moe_profile.log | cut -c1-600; elapsed "moe profiles"
    DEEPSERVE_PDL=0 timeout 200 python3 benchmarks/h200_decode_sweep.py --shapes llama-3.2-1b --batches 8,64 \
        --contexts 1024 --profile-batch 8,64 --profile-dense --output "$OUT/dense1b_pdl_off_profile.json" \
        > /tmp/dense_profile.log 2>&1
    grep " profile \|^llama" /tmp/dense_profile.log | cut -c1-1500; elapsed "dense profiles"
    ;;
skinny64-ab)
    # The skinny GEMM at 33-64 rows (DEEPSERVE_SKINNY_64_ROWS, on since session 35 from Llama-3.2-1B's steps alone):
    # the MoE shapes' steps at batch 48 / 64 (Qwen3-MoE's split-K o_proj, V2-Lite's dense first layer), and a
    # second pass of the 1B (SKINNY_SHAPES narrows the shapes, SKINNY_LIMIT the seconds).
    timeout "${SKINNY_LIMIT:-560}" python3 benchmarks/ab_env_sweep.py --setting DEEPSERVE_SKINNY_64_ROWS=0,1 \
        --passes 1 --timeout 130 --output "$OUT/skinny_64_rows_ab.json" -- \
        --shapes "${SKINNY_SHAPES:-llama-3.2-1b,qwen3-moe,deepseek-v2-lite}" --batches 48,64 --contexts 1024 \
        --profile-batch 0 > /tmp/skinny64_ab.log 2>&1
    tail -3 /tmp/skinny64_ab.log; summarise_steps "$OUT/skinny_64_rows_ab.json"; elapsed "skinny64-ab"
    ;;
gqa-ncu)
    # The paged GQA decode kernel where it reads below the copy bandwidth (H100, session 35): Qwen3-MoE batch 256
    # over E4M3 at 2.41 TB/s (bf16 2.81; qwen3_attention_tiles_h100_s35.json), Llama-3.2-1B batch 64 over bf16 at
    # 2.46 (dense1b_attention_tiles_h100_s35.json). Nsight Compute's view of each, two calls each.
    ncu_kernels _decode_kernel "$OUT/ncu_gqa_large.csv" python3 benchmarks/ncu_decode_attention.py --gqa-large
    elapsed "gqa-ncu"
    ;;
gqa-order)
    # A row's KV heads launched side by side (DecodeTiles.heads_first): their programs read neighbouring pieces of
    # the same cache rows (one token's heads are contiguous) at about the same time. Qwen3-MoE's E4M3 cache reads at
    # 2.41 TB/s at batch 256 where bf16 reads at 2.81 (a head's 128-byte piece of a 512-byte row, H100, session 35).
    timeout 280 python3 benchmarks/fp8_attention_kernels.py --cache-dtypes float8_e4m3fn,bfloat16 \
        --settings "DEEPSERVE_FP8_PRODUCTS=f16" --cases "qwen3-moe,llama-3.2-1b b64 ctx1024,llama-3-8b b256" \
        --tiles 64x4x2h,64x4x3,64x4x3h,64x4x3e,64x4x3eh --output "$OUT/gqa_heads_first_kernels.json" \
        > /tmp/gqa_order.log 2>&1
    tail -3 /tmp/gqa_order.log | cut -c1-300; summarise_kernels "$OUT/gqa_heads_first_kernels.json"
    elapsed "gqa-order"
    ;;
gqa-launch-ab)
    # The launch rule gqa-order's kernel timings chose (heads first; three stages past one wave over E4M3) in decode
    # steps: Qwen3-MoE over an E4M3 cache, Llama-3.2-1B over bf16 (split launches at batch 8), after its own tests.
    timeout 100 python3 -m pytest -q -n 8 tests/gpu/test_paged_attention.py tests/gpu/test_gemv.py \
        -p no:cacheprovider 2>&1 | tail -2
    # PASSES (default 1) and the shapes' batches (MOE_BATCHES, DENSE_BATCHES) narrow or widen it.
    for shape in qwen3-moe llama-3.2-1b; do
        if [ $shape = qwen3-moe ]; then args="--batches ${MOE_BATCHES:-64,128,256} --kv-cache-dtype fp8"; t=150
        else args="--batches ${DENSE_BATCHES:-8,64} --contexts 1024,4096"; t=100; fi
        timeout $(( ${PASSES:-1} * 2 * t )) python3 benchmarks/ab_env_sweep.py \
            --setting DEEPSERVE_GQA_DECODE_LAUNCH=rows-first,heads-first --passes "${PASSES:-1}" --timeout $t \
            --output "$OUT/gqa_decode_launch_ab_$shape.json" -- --shapes $shape $args \
            --profile-batch 0 > /tmp/gqa_launch_ab.log 2>&1
        tail -2 /tmp/gqa_launch_ab.log; summarise_steps "$OUT/gqa_decode_launch_ab_$shape.json"
    done
    elapsed "gqa-launch-ab"
    ;;
gqa-in-step)
    # Heads first took Qwen3-MoE batch 256's E4M3 call from 110.7 to 104.9 us alone (gqa-order) but its step only
    # from 9.794 to 9.761 ms (gqa-launch-ab): is it the step's surroundings (a cache a layer, blocks in runs, GEMMs
    # between)? Kernel durations with PDL off, each tiling with blocks in runs and shuffled.
    DEEPSERVE_PDL=0 timeout 150 python3 benchmarks/decode_attention_in_step.py --cases "qwen3-moe:128,256:1024" \
        --layout both --splits 1 --layers 48 --tiles 64x4x2,64x4x2h,64x4x3,64x4x3h --cache-dtype float8_e4m3fn \
        --output "$OUT/gqa_in_step_qwen3_e4m3.json" 2>&1 | tail -4 | cut -c1-400
    DEEPSERVE_PDL=0 timeout 100 python3 benchmarks/decode_attention_in_step.py --cases "llama-3.2-1b:64:1024" \
        --layout both --splits 1 --layers 16 --tiles 64x4x3e,64x4x3eh --output "$OUT/gqa_in_step_1b_bf16.json" \
        2>&1 | tail -2 | cut -c1-400
    python3 - "$OUT"/gqa_in_step_*.json <<'PY'
import json, sys
for path in sys.argv[1:]:
    for r in json.load(open(path))["results"]:
        print(r["shape"], r["batch"], r["layout"], {k: v[0] if isinstance(v, list) else v for k, v in r["us"].items()})
PY
    elapsed "gqa-in-step"
    ;;
moe-ncu)
    # Qwen3-MoE batch 256's MoE GEMMs read their experts at 96% (gate/up) and 89% (down) of the copy bandwidth in
    # the step (H100, qwen3_b256_pdl_off_heads-first_h100_s36.json), and no down tiling moved the down GEMM
    # (tune_moe_down_h100_s35.json): Nsight Compute's view of both at 256 tokens, stall reasons included. (Session 37,
    # ncu_moe_b256_h100_s37.json: down at 86% of DRAM peak, gate/up at 90%. A persistent down GEMM, one wave over a
    # flat K loop, lost by 2-4%: moe_persistent_down_h100_s37.json, code at commit 4785c04.)
    ncu_kernels "(_gate_up_kernel|_down_kernel)" "$OUT/ncu_moe_b256.csv" python3 benchmarks/ncu_fused_moe.py \
        --shapes qwen3-moe,deepseek-v2-lite --tokens 256
    elapsed "moe-ncu"
    ;;
gqa-regs)
    # The E4M3 kernel of an unsplit large-batch launch holds 110 registers a thread on the device (4 programs an SM;
    # ncu_gqa_large_h100_s36.json): capped at 96 (80) with two stages (39 KB of shared memory, 20 KB at 32 keys),
    # 5 (6) fit an SM. The engine's pick (64x4x3h over E4M3) first; bf16 beside it.
    timeout 300 python3 benchmarks/fp8_attention_kernels.py --cache-dtypes "${REGS_DTYPES:-float8_e4m3fn,bfloat16}" \
        --settings "DEEPSERVE_FP8_PRODUCTS=f16" --cases "${REGS_CASES:-qwen3-moe,llama-3-8b b256}" \
        --tiles "${REGS_TILES:-64x4x3h,64x4x2h,64x4x2hr96,64x4x2hr80,32x4x3h,32x4x3hr80,32x4x2hr64}" \
        --output "$OUT/gqa_regs_kernels.json" > /tmp/gqa_regs.log 2>&1
    tail -3 /tmp/gqa_regs.log | cut -c1-300; summarise_kernels "$OUT/gqa_regs_kernels.json"; elapsed "gqa-regs"
    ;;
align-gather)
    # The one-program MoE align with its run starts gathered in registers and its blocks labelled by stores (no
    # scratch round trip, no binary search of 8 dependent loads): 120 us a Qwen3-MoE batch-256 step on an H100,
    # 7.5 us a layer on the critical path (h100_moe_b256_pdl_off_profile_s35.json).
    timeout 100 python3 -m pytest -q tests/gpu/test_fused_moe.py -k "align or cuda_graph" -p no:cacheprovider 2>&1 \
        | tail -2
    sed 's/^ALIGN_GATHER = .*/ALIGN_GATHER = False/' deepserve/kernels/moe_align.py > /tmp/moe_align_before.py
    DEEPSERVE_MOE_ALIGN_GATHER=1 timeout 120 python3 benchmarks/moe_align_ab.py --before /tmp/moe_align_before.py \
        --tokens 8,16,32,64,128,256 --output "$OUT/moe_align_gather_ab.json" 2>&1 | tail -12; elapsed "align alone"
    timeout 400 python3 benchmarks/ab_env_sweep.py --setting DEEPSERVE_MOE_ALIGN_GATHER=0,1 --passes "${PASSES:-1}" \
        --timeout 140 --output "$OUT/moe_align_gather_steps_ab.json" -- --shapes qwen3-moe,deepseek-v2-lite \
        --batches ${MOE_BATCHES:-64,256} --kv-cache-dtype fp8 --profile-batch 0 > /tmp/align_ab.log 2>&1
    tail -3 /tmp/align_ab.log; summarise_steps "$OUT/moe_align_gather_steps_ab.json"; elapsed "align-gather steps"
    ;;
values-t64)
    # Each block's values stored transposed lost with 16-slot blocks (gqa_values_transposed_h200_s37.json): a value
    # row's run is then 16 bytes, half a DRAM sector, and the L2 hit rate went 3% -> 37%. With 64-slot blocks a run
    # is 64 bytes. The engine's layout and the transposed one (DecodeTiles.values_t, on a transposed copy of the
    # cache, outputs checked) at both block sizes. If it wins, every KV writer and reader needs the layout first.
    timeout 100 python3 -m pytest -q tests/gpu/test_paged_attention.py -k transposed -p no:cacheprovider 2>&1 | tail -2
    for bs in 16 64; do
        timeout 200 python3 benchmarks/fp8_attention_kernels.py --block-size $bs --cache-dtypes float8_e4m3fn \
            --settings "DEEPSERVE_FP8_PRODUCTS=f16" --cases "qwen3-moe b256,llama-3-8b b256,llama-3-8b b64" \
            --tiles 64x4x3h,64x4x3ht,64x4x3eht,64x4x2ht --output "$OUT/values_t_block$bs.json" \
            > /tmp/values_t$bs.log 2>&1
        tail -2 /tmp/values_t$bs.log | cut -c1-300; summarise_kernels "$OUT/values_t_block$bs.json"
        elapsed "values-t, $bs-slot blocks"
    done
    ;;
l2-prefetch)
    # Session 27's switch (docs/gpu.md): extra programs of the rotary + KV-write kernel or of the split reduce ask L2
    # for o_proj's weight while the latency-bound attention runs. First timed in session 41 (s41-first, H100): kept
    # off, slower at batch 8-32, 1-2% faster at 64 only (l2_*_h100_s41.json).
    timeout 100 python3 -m pytest -q -n 4 tests/gpu -k "l2_prefetch or prefetch" -p no:cacheprovider 2>&1 | tail -2
    timeout 480 python3 benchmarks/ab_env_sweep.py \
        --setting DEEPSERVE_L2_PREFETCH=off,rotary,rotary_evict_last,reduce --passes 1 --timeout 110 \
        --output "$OUT/l2_prefetch_ab.json" -- --shapes llama-3.2-1b --contexts 1024 --batches 1,8,16,64 \
        --profile-batch 0 > /tmp/l2_prefetch_ab.log 2>&1
    tail -3 /tmp/l2_prefetch_ab.log; summarise_steps "$OUT/l2_prefetch_ab.json"; elapsed "l2-prefetch"
    ;;
gqa-pairs)
    # Llama-3.2-1B's 64-wide heads are 128-byte pieces of a token's bf16 row; its decode kernel read them at 2.46
    # TB/s (81% of the copy bandwidth, dense1b_attention_tiles_h100_s35.json) where Qwen3-MoE's 256-byte bf16 pieces
    # read at 2.81 (93%); over E4M3 Qwen3-MoE's heads are 128-byte pieces too (2.41-2.56 TB/s). DecodeTiles.kv_heads
    # 2 (DEEPSERVE_GQA_KV_HEADS_PER_PROGRAM=2) reads two adjacent KV heads a program, 256 contiguous bytes a token.
    # The kernel alone ('p' tilings beside their one-head twins; the 1B over both caches, Qwen3-MoE and Llama-3-8B
    # batch 256 over E4M3 too), then 1B steps.
    timeout 100 python3 -m pytest -q -n 4 tests/gpu/test_paged_attention.py \
        -k "kv_heads or pair or fp8_cache_matches or values_transposed or tile_settings" -p no:cacheprovider 2>&1 \
        | tail -2
    timeout 240 python3 benchmarks/fp8_attention_kernels.py --cache-dtypes bfloat16,float8_e4m3fn \
        --settings "DEEPSERVE_FP8_PRODUCTS=f16" --cases "llama-3.2-1b,qwen3-moe,llama-3-8b b256" \
        --tiles 64x4x2h,64x4x2hp,64x4x3eh,64x4x3ehp,64x4x3h,64x4x3hp,32x4x3hp \
        --output "$OUT/gqa_kv_pairs_kernels.json" > /tmp/gqa_pairs.log 2>&1
    tail -2 /tmp/gqa_pairs.log | cut -c1-300; summarise_kernels "$OUT/gqa_kv_pairs_kernels.json"
    elapsed "gqa-pairs calls"
    timeout 300 python3 benchmarks/ab_env_sweep.py --setting DEEPSERVE_GQA_KV_HEADS_PER_PROGRAM=1,2 \
        --passes "${PASSES:-1}" --timeout 140 --output "$OUT/gqa_kv_pairs_ab.json" -- --shapes llama-3.2-1b \
        --batches 8,64,256 --contexts 1024,4096 --profile-batch 0 > /tmp/gqa_pairs_ab.log 2>&1
    tail -3 /tmp/gqa_pairs_ab.log; summarise_steps "$OUT/gqa_kv_pairs_ab.json"; elapsed "gqa-pairs steps"
    ;;
s40-check)
    # Session 40's default DEEPSERVE_GQA_KV_HEADS_PER_PROGRAM=auto (KV head pairs over a 16-bit cache in one-wave
    # launches without a split; when this stage first ran, in every unsplit launch) under all of tests/gpu, then
    # Llama-3.2-1B steps: never / auto. (Its first run also timed session 38's few-row qkv + rotary launch, since
    # removed: gqa_pairs_auto_ab_h200_s40.json.)
    n=""; python3 -c "import xdist" 2>/dev/null && n="-n 8"
    timeout 300 python3 -m pytest -q $n tests/gpu -p no:cacheprovider > "$OUT/pytest_gpu.log" 2>&1
    tail -6 "$OUT/pytest_gpu.log"; grep -m 6 "^E .*Error\|^E  *assert" "$OUT/pytest_gpu.log" | cut -c1-300
    elapsed "tests/gpu"
    timeout 260 python3 benchmarks/ab_env_sweep.py --combo DEEPSERVE_GQA_KV_HEADS_PER_PROGRAM=1 \
        --combo DEEPSERVE_GQA_KV_HEADS_PER_PROGRAM=auto \
        --passes "${PASSES:-2}" --timeout 120 --output "$OUT/gqa_pairs_auto_ab.json" -- --shapes llama-3.2-1b \
        --batches 8,64,256 --contexts 1024,4096 --profile-batch 0 > /tmp/s40_ab.log 2>&1
    tail -3 /tmp/s40_ab.log; summarise_steps "$OUT/gqa_pairs_auto_ab.json"; elapsed "s40-check"
    ;;
s41-first)
    # All of tests/gpu (session 40's narrowed KV-head pair rule has a GPU test that ran only under the interpreter;
    # session 27's L2 prefetch has one that never ran), then session 27's L2 prefetch in Llama-3.2-1B steps at the
    # short batches of issue 21 (1, 8 and 64 at 1k: 0.75 / 0.69 / 0.72 of the roofline on the H100, session 40).
    # S41_SHORT=1 (a call with less device time left, ~5 min): the GPU tests of the files session 41 changed, and
    # three settings.
    n=""; python3 -c "import xdist" 2>/dev/null && n="-n 8"
    tests=(tests/gpu); settings=off,rotary,reduce,rotary_evict_last
    [ "${S41_SHORT:-0}" = 1 ] && tests=(tests/gpu/test_skinny_gemm.py tests/gpu/test_qkv_rotary.py \
        tests/gpu/test_engine_gpu.py tests/gpu/test_paged_attention.py) && settings=off,rotary,reduce
    timeout 280 python3 -m pytest -q $n "${tests[@]}" -p no:cacheprovider > "$OUT/pytest_gpu.log" 2>&1
    tail -6 "$OUT/pytest_gpu.log"; grep -m 6 "^E .*Error\|^E  *assert" "$OUT/pytest_gpu.log" | cut -c1-300
    elapsed "tests/gpu"
    timeout 290 python3 benchmarks/ab_env_sweep.py --setting DEEPSERVE_L2_PREFETCH=$settings \
        --passes 1 --timeout 95 --output "$OUT/l2_prefetch_1b_ab.json" -- --shapes llama-3.2-1b --contexts 1024 \
        --batches 1,8,64 --profile-batch 0 > /tmp/l2_prefetch_ab.log 2>&1
    tail -3 /tmp/l2_prefetch_ab.log | cut -c1-400; summarise_steps "$OUT/l2_prefetch_1b_ab.json"; elapsed "l2 1b"
    ;;
split-merge)
    # DEEPSERVE_DECODE_SPLIT_MERGE (session 42's; the split decode's merge in the decode kernel, by the last split
    # program of each row and KV head, no reduce launch): its GPU tests (the kernel against the reference and the
    # reduce, the engine's tokens eager and in CUDA graphs), then Llama-3.2-1B steps at the batches whose launches
    # split, reduce / last. Session 42 ran it as s42-first and s42-late at the code of that time (BATCHES 1,8,16,32
    # at 1k and 4k; 1,2,4,8,16 at 1k). PASSES (default 2), BATCHES, CONTEXTS.
    n=""; python3 -c "import xdist" 2>/dev/null && n="-n 8"
    timeout 200 python3 -m pytest -q $n tests/gpu/test_paged_attention.py tests/gpu/test_engine_gpu.py \
        -p no:cacheprovider > "$OUT/pytest_gpu.log" 2>&1
    tail -4 "$OUT/pytest_gpu.log"; grep -m 6 "^E .*Error\|^E  *assert" "$OUT/pytest_gpu.log" | cut -c1-300
    elapsed "tests"
    timeout 480 python3 benchmarks/ab_env_sweep.py --setting DEEPSERVE_DECODE_SPLIT_MERGE=reduce,last \
        --passes "${PASSES:-2}" --timeout 110 --output "$OUT/split_merge_1b_ab.json" -- --shapes llama-3.2-1b \
        --contexts "${CONTEXTS:-1024,4096}" --batches "${BATCHES:-1,2,8,16,32}" --profile-batch 0 \
        > /tmp/split_merge_ab.log 2>&1
    tail -3 /tmp/split_merge_ab.log | cut -c1-400; summarise_steps "$OUT/split_merge_1b_ab.json"; elapsed "merge 1b"
    ;;
s42-timeline)
    # Why the in-kernel split merge lost at 1B batch 2-16 and won at batch 1 (split_merge_auto_1b_ab_h100_s42.json,
    # the next kernel let in early then): the graph replay's kernel sequence (one layer's launches and their
    # durations) at batch 1 / 2, 1k, reduce / last, with PDL off (each kernel's duration its own) and on.
    for pdl in 0 1; do for merge in reduce last; do
        DEEPSERVE_PDL=$pdl DEEPSERVE_DECODE_SPLIT_MERGE=$merge timeout 100 python3 benchmarks/h200_decode_sweep.py \
            --shapes llama-3.2-1b --contexts 1024 --batches 1,2 --profile-batch 0 --timeline-batch 1,2 \
            --output "$OUT/split_merge_timeline_${merge}_pdl${pdl}.json" > /tmp/split_merge_timeline.log 2>&1
        tail -1 /tmp/split_merge_timeline.log | cut -c1-200
        summarise_timelines "$OUT/split_merge_timeline_${merge}_pdl${pdl}.json"
    done; done
    elapsed "timelines"
    ;;
s42-check)
    # DEEPSERVE_DECODE_SPLIT_MERGE=last as the default (late PDL trigger over 2+ rows): all of tests/gpu, then
    # Llama-3.2-1B steps at the batches whose launches split, 1k and 4k, reduce / last.
    n=""; python3 -c "import xdist" 2>/dev/null && n="-n 8"
    timeout 250 python3 -m pytest -q $n tests/gpu -p no:cacheprovider > "$OUT/pytest_gpu.log" 2>&1
    tail -4 "$OUT/pytest_gpu.log"; grep -m 6 "^E .*Error\|^E  *assert" "$OUT/pytest_gpu.log" | cut -c1-300
    elapsed "tests/gpu"
    timeout 220 python3 benchmarks/ab_env_sweep.py --setting DEEPSERVE_DECODE_SPLIT_MERGE=reduce,last \
        --passes "${PASSES:-2}" --timeout 100 --output "$OUT/split_merge_default_1b_ab.json" -- \
        --shapes llama-3.2-1b --contexts 1024,4096 --batches 1,2,8,32 --profile-batch 0 \
        > /tmp/split_merge_default_ab.log 2>&1
    tail -2 /tmp/split_merge_default_ab.log | cut -c1-300; summarise_steps "$OUT/split_merge_default_1b_ab.json"
    elapsed "merge default 1b"
    ;;
s42-others)
    # The split merge's default on the other GQA shapes whose launches split: Qwen3-MoE (128-wide heads, group 8)
    # and Llama-3-8B at batch 8 / 32, 1k, reduce / last, one pass (PASSES).
    timeout 250 python3 benchmarks/ab_env_sweep.py --setting DEEPSERVE_DECODE_SPLIT_MERGE=reduce,last \
        --passes "${PASSES:-1}" --timeout 120 --output "$OUT/split_merge_others_ab.json" -- \
        --shapes qwen3-moe,llama-3-8b --contexts 1024 --batches 8,32 --profile-batch 0 \
        > /tmp/split_merge_others_ab.log 2>&1
    tail -2 /tmp/split_merge_others_ab.log | cut -c1-300; summarise_steps "$OUT/split_merge_others_ab.json"
    elapsed "merge others"
    ;;
merge-splits)
    # The decode split counts (decode_num_splits) were tuned with a reduce launch after each split launch; with the
    # merge in the kernel a split costs a partial write and the last program's read instead. Every split count at
    # kernel level (CUDA graphs of 20 calls), reduce / last, Llama-3.2-1B and Llama-3-8B at the batches whose
    # launches split: does the heuristic's pick still win? (Session 43: merge_splits_{reduce,last}_h100_s43.json.)
    for merge in reduce last; do
        DEEPSERVE_DECODE_SPLIT_MERGE=$merge timeout 200 python3 benchmarks/tune_decode_attention.py \
            --shapes llama-3.2-1b,llama-3-8b --batches 1,2,8,16,32 --contexts 1024,4096 \
            --output "$OUT/merge_splits_${merge}.json" > /tmp/merge_splits.log 2>&1
        tail -2 /tmp/merge_splits.log | cut -c1-300
    done
    elapsed "merge-splits"
    ;;
merge-splits-wide)
    # Past the split rule's one-wave line (about two 128-wide programs an SM) nothing splits: with a reduce launch
    # a split cost more than it gained there. With the merge in the kernel, Llama-3-8B at batch 32 ran 6.5% (1k) and
    # 9.4% (4k) faster at 2 splits (merge-splits, session 43). Every split count with the merge in the kernel at
    # batch 32 / 64 / 128, bf16 caches, and Qwen3-MoE over E4M3.
    timeout 250 python3 benchmarks/tune_decode_attention.py --shapes llama-3.2-1b,llama-3-8b,qwen3-moe \
        --batches 32,64,128 --contexts 1024,4096 --output "$OUT/merge_splits_wide_bf16.json" > /tmp/msw.log 2>&1
    tail -3 /tmp/msw.log | cut -c1-300
    timeout 120 python3 benchmarks/tune_decode_attention.py --shapes qwen3-moe --kv-dtype e4m3 \
        --batches 32,64,128,256 --contexts 1024,4096 --output "$OUT/merge_splits_wide_e4m3.json" > /tmp/msw.log 2>&1
    tail -3 /tmp/msw.log | cut -c1-300
    elapsed "merge-splits-wide"
    ;;
split-rule)
    # DEEPSERVE_DECODE_SPLIT_RULE (session 43): split counts sized for the in-kernel merge (merged) against session
    # 42's (reduce), in decode steps, two passes, at the batches whose counts it moves: Llama-3.2-1B batch 1 / 2 (16
    # splits at 1k) and 64 (2 splits), Llama-3-8B batch 32 (2 splits), Qwen3-MoE over E4M3 batch 32 (4 splits, not
    # 5) and 64 (unmoved over E4M3: a control). First the paged-attention and engine GPU tests at the new counts.
    timeout 150 python3 -m pytest -q -x tests/gpu/test_paged_attention.py tests/gpu/test_engine_gpu.py \
        -p no:cacheprovider > "$OUT/pytest_split_rule.log" 2>&1
    tail -2 "$OUT/pytest_split_rule.log"; grep -m 6 "^E .*Error\|^E  *assert" "$OUT/pytest_split_rule.log" | cut -c1-300
    elapsed "tests"
    for spec in "llama-3.2-1b 1024,4096 1,2,64 auto" "llama-3-8b 1024,4096 32 auto" "qwen3-moe 1024 32,64 fp8"; do
        set -- $spec
        timeout 200 python3 benchmarks/ab_env_sweep.py --setting DEEPSERVE_DECODE_SPLIT_RULE=reduce,merged \
            --passes "${PASSES:-2}" --timeout 90 --output "$OUT/split_rule_${1}_ab.json" -- --shapes "$1" \
            --contexts "$2" --batches "$3" --kv-cache-dtype "$4" --profile-batch 0 > /tmp/split_rule_ab.log 2>&1
        tail -2 /tmp/split_rule_ab.log | cut -c1-300; summarise_steps "$OUT/split_rule_${1}_ab.json"
        elapsed "split rule $1"
    done
    ;;
deploy-len)
    # The decode sweep sizes max_model_len to its contexts (~1.1k at 1k), so its graphs' split grids and block
    # tables are that short. A deployment's default is the model's context (131072 for Llama-3.2-1B): the same 1k
    # steps from an engine sized for it, block tables sent at full width and packed (DEEPSERVE_COMPACT_BLOCK_TABLES).
    timeout 120 python3 benchmarks/h200_decode_sweep.py --shapes llama-3.2-1b --contexts 1024 --batches 1,8,64 \
        --profile-batch 0 --output "$OUT/deploy_len_short.json" > /tmp/deploy_len.log 2>&1
    tail -2 /tmp/deploy_len.log | cut -c1-300
    timeout 300 python3 benchmarks/ab_env_sweep.py --setting DEEPSERVE_COMPACT_BLOCK_TABLES=0,1 --passes 1 \
        --timeout 140 --output "$OUT/deploy_len_128k_ab.json" -- --shapes llama-3.2-1b --contexts 1024 \
        --batches 1,8,64 --max-model-len 131072 --profile-batch 0 > /tmp/deploy_len_ab.log 2>&1
    tail -2 /tmp/deploy_len_ab.log | cut -c1-300; summarise_steps "$OUT/deploy_len_128k_ab.json"
    elapsed "deploy-len"
    ;;
deploy-len-moe)
    # The packed block tables' default (DEEPSERVE_COMPACT_BLOCK_TABLES=auto packs where a row at max_model_len holds
    # 512 blocks or more: worker/cuda_graph.py COMPACT_MIN_BLOCKS) on the MoE shapes at their models' own contexts,
    # Qwen3-30B-A3B's 40960 and DeepSeek-V2-Lite's 163840: 1k steps over E4M3 at batch 8 / 64 / 256, the tables at
    # full width (0) and packed (1).
    for spec in "qwen3-moe 40960" "deepseek-v2-lite 163840"; do
        set -- $spec
        timeout 280 python3 benchmarks/ab_env_sweep.py --setting DEEPSERVE_COMPACT_BLOCK_TABLES=0,1 \
            --passes "${PASSES:-1}" --timeout 130 --output "$OUT/deploy_len_${1}_ab.json" -- --shapes "$1" \
            --contexts 1024 --batches 8,64,256 --kv-cache-dtype fp8 --max-model-len "$2" --profile-batch 0 \
            > /tmp/deploy_len_moe.log 2>&1
        tail -2 /tmp/deploy_len_moe.log | cut -c1-300; summarise_steps "$OUT/deploy_len_${1}_ab.json"
        elapsed "deploy-len $1"
    done
    ;;
deploy-len-moe-vs)
    # deploy-len-moe's packed engines against engines sized for the sweep's ~1.1k, in one call (machines differ by
    # a few percent): short, deployment-sized (tables packed by default), short again, at batch 64 / 256.
    for spec in "qwen3-moe 40960" "deepseek-v2-lite 163840"; do
        set -- $spec
        for len in short1 "$2" short2; do      # (session 44's runs wrote both short ones to one file: the second)
            extra=""; [ "${len#short}" = "$len" ] && extra="--max-model-len $len"
            timeout 120 python3 benchmarks/h200_decode_sweep.py --shapes "$1" --contexts 1024 --batches 64,256 \
                --kv-cache-dtype fp8 --profile-batch 0 $extra --output "$OUT/deploy_vs_${1}_${len}.json" \
                > /tmp/deploy_vs.log 2>&1
            python3 -c "import json, sys; d = json.load(open(sys.argv[1])); print(sys.argv[2], [(b['batch'], \
                b['step_ms'], b.get('experts_roofline_ratio')) for r in d['results'].values() for c in r.values() \
                for b in c['batches']])" "$OUT/deploy_vs_${1}_${len}.json" "$1 max_model_len=$len" \
                || tail -1 /tmp/deploy_vs.log | cut -c1-300
        done
        elapsed "deploy-len-vs $1"
    done
    ;;
kernel-table)
    # Where Llama-3.2-1B's batch 1 / 8 / 64 steps at 1k go, for the 0.80 target (session 43's note): each graph
    # replay's kernels by name (profile_gpu_step's by_kernel: launches and microseconds a replay), with PDL off (each
    # kernel's duration its own, to price it against its bytes) and on (what overlaps). Session 44:
    # kernel_table_1b_pdl{0,1}_h100_s44.json; session 45 (with exposed times): kernel_table_1b_pdl{0,1}_h100_s45.json,
    # price_kernels_1b_pdl{0,1}_h100_s45.json.
    for pdl in 0 1; do
        DEEPSERVE_PDL=$pdl timeout 120 python3 benchmarks/h200_decode_sweep.py --shapes llama-3.2-1b \
            --contexts 1024 --batches 1,8,64 --profile-batch 0 --timeline-batch 1,8,64 \
            --output "$OUT/kernel_table_1b_pdl${pdl}.json" > /tmp/kernel_table.log 2>&1
        tail -1 /tmp/kernel_table.log | cut -c1-200
        summarise_timelines "$OUT/kernel_table_1b_pdl${pdl}.json"
        # each launch of a layer against its bytes (and, with PDL on, what it adds to the step)
        python3 benchmarks/price_kernels_1b.py "$OUT/kernel_table_1b_pdl${pdl}.json" \
            --output "$OUT/price_kernels_1b_pdl${pdl}.json" | head -40
    done
    elapsed "kernel-table"
    ;;
kernel-table-splits)
    # Whether the batch-1 / 8 decode of Llama-3.2-1B at 1k gains from one-tile partitions in the step (session 44's
    # note): the graphs, sized for ~1.1k keys, split the 1B's 1044 keys in 9 parts of 128 (the merge tile holds 16
    # splits). DEEPSERVE_DECODE_SPLITS forces the count: 8 (6 parts of 192 keys), 32 (17 of 64, merged by a reduce
    # launch), against the rule (0). Kernel tables with PDL off (each kernel's own duration) and on (what
    # each launch adds to the step: exposed_by_kernel). If 32 beats the rule with PDL on, the in-kernel merge
    # is worth extending past 16 splits. Session 45: kernel_table_splits_h100_s45.json (the rule fastest or tied;
    # 32's decode launch 3.4 us faster, its reduce as slow); since then 32 splits of one tile merge in the kernel
    # (DEEPSERVE_DECODE_MERGE_ONE_TILE, on by default: `merge-one-tile`).
    for splits in 0 8 32; do
        for pdl in 0 1; do
            DEEPSERVE_PDL=$pdl DEEPSERVE_DECODE_SPLITS=$splits timeout 100 python3 benchmarks/h200_decode_sweep.py \
                --shapes llama-3.2-1b --contexts 1024 --batches 1,8 --profile-batch 0 --timeline-batch 1,8 \
                --output "$OUT/kernel_table_splits${splits}_pdl${pdl}.json" > /tmp/kernel_table_splits.log 2>&1
            echo "splits $splits, PDL $pdl"; summarise_timelines "$OUT/kernel_table_splits${splits}_pdl${pdl}.json"
        done
    done
    elapsed "kernel-table-splits"
    ;;
s48-first)
    # Session 48's first call: where V2-Lite's batch 64 / 256 steps go (v2lite-timeline), then splits-4k.
    bash "$0" v2lite-timeline
    bash "$0" splits-4k
    ;;
next-first)
    # Session 47's note, items 1-2, in one call: where the 1B's batch 1 / 8 / 64 steps go now that no copy runs
    # between replays (kernel-table: PDL off and on), then the batch-1 decode's split counts at 4k.
    bash "$0" kernel-table
    bash "$0" splits-4k
    ;;
splits-4k)
    # Llama-3.2-1B batch 1 at 4k: 0.764 of the roofline against 0.804 at 1k (session 47,
    # h100_decode_sweep_dense_1b_s47.json), the step 98 us longer for 6.3 MB more KV a layer (~1 TB/s at the margin).
    # There the rule (decode_num_splits) splits batch 1's launch ~33 ways (128-key partitions), past the in-kernel
    # merge's 16, so a reduce launch merges them; 16 splits (256 keys each) merge in the kernel; 64 (one 64-key tile
    # each) take the reduce too. Batch 8 gets 9, merged in the kernel. At kernel level (merge_splits_last_h100_s43.json)
    # batch 1's launch took 7.82 us at 16 splits and 7.25 at 32, without the reduce launch that 32 adds in a step.
    # Steps and graph timelines (what each launch adds to the step, PDL on) at batch 1 / 8, the split count forced.
    for splits in 0 16 64; do
        DEEPSERVE_DECODE_SPLITS=$splits timeout 100 python3 benchmarks/h200_decode_sweep.py --shapes llama-3.2-1b \
            --contexts 4096 --batches 1,8 --profile-batch 0 --timeline-batch 1,8 \
            --output "$OUT/splits_4k_1b_splits${splits}.json" > /tmp/splits_4k.log 2>&1
        echo "splits $splits"; summarise_timelines "$OUT/splits_4k_1b_splits${splits}.json" 4096
    done
    elapsed "splits-4k"
    ;;
merge-one-tile)
    # Session 45's DEEPSERVE_DECODE_MERGE_ONE_TILE (on by default since): one-tile partitions past the in-kernel
    # merge's 16-split tile merged over a 32-split one (Llama-3.2-1B batch 1-2 at 1k: 18 splits, 17 used, instead of 9
    # of two tiles), off / on in batch 1 / 2 / 4 steps at 1k, two passes (merge_one_tile_1b_ab_h100_s45.json). Its
    # first A/B ran beside the MLP's L2 prefetch at the decode site, timed in the same call and removed (e3c37ce's
    # `mlp-prefetch` stage, mlp_prefetch_1b_ab*_h100_s45.json).
    timeout 200 python3 -m pytest -q tests/gpu/test_paged_attention.py -k "split_merge or one_tile" \
        -p no:cacheprovider > "$OUT/pytest_one_tile.log" 2>&1
    tail -2 "$OUT/pytest_one_tile.log"; elapsed "tests"
    timeout 250 python3 benchmarks/ab_env_sweep.py --setting DEEPSERVE_DECODE_MERGE_ONE_TILE=0,1 --passes 2 \
        --timeout 60 --output "$OUT/merge_one_tile_1b_ab.json" -- --shapes llama-3.2-1b --contexts 1024 \
        --batches 1,2,4 --profile-batch 0 > /tmp/merge_one_tile.log 2>&1
    tail -2 /tmp/merge_one_tile.log | cut -c1-300; summarise_steps "$OUT/merge_one_tile_1b_ab.json"; elapsed "A/B"
    ;;
gqa-pairs-moe)
    # Qwen3-MoE's batch 128 / 256 over E4M3 (its 128-wide heads 128 bytes a token) with two KV heads a program: the
    # decode attention is 1.7 ms of its 9.7 ms batch-256 step, at 81% of the copy bandwidth.
    timeout 300 python3 benchmarks/ab_env_sweep.py --setting DEEPSERVE_GQA_KV_HEADS_PER_PROGRAM=1,2 \
        --passes "${PASSES:-1}" --timeout 140 --output "$OUT/gqa_kv_pairs_moe_ab.json" -- --shapes qwen3-moe \
        --batches 128,256 --contexts 1024 --kv-cache-dtype fp8 --profile-batch 0 > /tmp/gqa_pairs_moe_ab.log 2>&1
    tail -3 /tmp/gqa_pairs_moe_ab.log; summarise_steps "$OUT/gqa_kv_pairs_moe_ab.json"; elapsed "gqa-pairs-moe"
    ;;
graph-tokens-1b)
    # Llama-3.2-1B's batch-1 step at 1k takes 1.102 ms of which the graph replay is 1.075 (H100,
    # h100_decode_sweep_dense_auto_s36.json): 27 us a step outside the graph, 2.5% of it. DEEPSERVE_GRAPH_TOKENS
    # (session 27) ends each graph with the greedy argmax and starts it with the token patch; timed on Qwen3-MoE
    # (batch 8 / 128, within noise: graph_inputs_ab_h200.json) and, in session 41, on the 1B (H100, 0.3-1.6%
    # faster at batch 1 / 8 / 64: graph_tokens_1b_*_h100_s41.json), after which it became the default.
    timeout 300 python3 benchmarks/ab_env_sweep.py --setting DEEPSERVE_GRAPH_TOKENS=0,1 --passes "${PASSES:-2}" \
        --timeout 70 --output "$OUT/graph_tokens_1b_ab.json" -- --shapes llama-3.2-1b --batches 1,8 \
        --contexts 1024 --profile-batch 0 > /tmp/graph_tokens_ab.log 2>&1
    tail -3 /tmp/graph_tokens_ab.log; summarise_steps "$OUT/graph_tokens_1b_ab.json"; elapsed "graph-tokens-1b"
    ;;
combine-ab)
    # The MoE combine summed inside the next add + RMSNorm (one launch a MoE layer fewer; bit-identical, checked by
    # the `tests` stage's test_engine_gpu.py::test_moe_combine_in_norm_gives_the_same_bits).
    timeout 570 python3 benchmarks/ab_env_sweep.py --setting DEEPSERVE_MOE_COMBINE_IN_NORM=0,1 --passes "${PASSES:-2}" \
        --timeout 140 --output "$OUT/moe_combine_in_norm_ab.json" -- --shapes qwen3-moe,deepseek-v2-lite \
        --batches 8,64,128,256 --kv-cache-dtype fp8 --profile-batch 0 > /tmp/combine_ab.log 2>&1
    tail -3 /tmp/combine_ab.log; summarise_steps "$OUT/moe_combine_in_norm_ab.json"; elapsed "combine-ab"
    ;;
side-streams)
    # Session 49's DEEPSERVE_MOE_SHARED_STREAM and DEEPSERVE_MLA_WRITE_STREAM (layers/side_stream.py; the second
    # was removed after this stage timed it, its code is at commit 9efb72d). At V2-Lite batch
    # 256 over E4M3 (v2lite_timeline_h100_s48.json) each MoE layer runs the shared experts apart (cuBLAS gate/up 12.8
    # us + SiLU-and-mul 2.7 + down 8.7 exposed), after the router (6.8 + 2.5) and before the align (3.9): all short
    # launches on part of the SMs, one after the other. On a side stream the shared experts run beside the router and
    # the routed experts; the latent cache write (3.6) beside W_UK's product (4.6). Their GPU test (the same bits,
    # eager and in CUDA graphs), then steps at batch 8 / 64 / 128 / 256 (64 and 128 fuse the shared experts into the
    # grouped GEMMs by default: the fourth setting runs them apart on the side stream there), one pass. The third
    # asks PyTorch for cuBLASLt's GEMMs (the stacked q / kv_a GEMM took 10.5 us for 4.9 us of bytes, o_proj 6.3 for
    # 2.8: few output tiles at 256 rows).
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_engine_gpu.py -k side_stream \
        > /tmp/side_tests.log 2>&1
    tail -3 /tmp/side_tests.log | cut -c1-300; grep -E "^(E  |FAILED)" /tmp/side_tests.log | head -12 | cut -c1-300
    elapsed "side-stream tests"
    timeout 430 python3 benchmarks/ab_env_sweep.py --combo DEEPSERVE_MOE_SHARED_STREAM=0 \
        --combo DEEPSERVE_MOE_SHARED_STREAM=1 --combo DEEPSERVE_MOE_SHARED_STREAM=1,TORCH_BLAS_PREFER_CUBLASLT=1 \
        --combo DEEPSERVE_MOE_SHARED_STREAM=1,DEEPSERVE_MLA_WRITE_STREAM=1,DEEPSERVE_MOE_FUSED_SHARED=0 \
        --passes 1 --timeout 125 --output "$OUT/side_streams_v2lite_ab.json" -- --shapes deepseek-v2-lite \
        --contexts 1024 --batches "${SIDE_BATCHES:-8,64,128,256}" --kv-cache-dtype fp8 --profile-batch 0 \
        > /tmp/side_ab.log 2>&1
    tail -2 /tmp/side_ab.log | cut -c1-300; grep -iE "error|Traceback" /tmp/side_ab.log | head -5 | cut -c1-300
    summarise_steps "$OUT/side_streams_v2lite_ab.json"; elapsed "side-streams A/B"
    ;;
cublaslt-dense)
    # PyTorch's GEMMs through cuBLASLt (TORCH_BLAS_PREFER_CUBLASLT=1) in Llama-3.2-1B steps at 1k, where cuBLAS
    # takes the projections past the skinny GEMM's rows (33-64 rows: qkv and o_proj; 65+: all), one pass.
    timeout 260 python3 benchmarks/ab_env_sweep.py --setting TORCH_BLAS_PREFER_CUBLASLT=0,1 --passes 1 --timeout 120 \
        --output "$OUT/cublaslt_1b_ab.json" -- --shapes llama-3.2-1b --contexts 1024 --batches 64,128,256 \
        --profile-batch 0 > /tmp/cublaslt_1b.log 2>&1
    tail -2 /tmp/cublaslt_1b.log | cut -c1-300; summarise_steps "$OUT/cublaslt_1b_ab.json"; elapsed "cublaslt-dense"
    ;;
s49-check)
    # (DEEPSERVE_MOE_SHARED_FORK and DEEPSERVE_SIDE_STREAM_PRIORITY were removed after s49-short timed them: their
    # code is at commit 104c2b9, where this stage and s49-short run as written.)
    # Session 49's default (DEEPSERVE_MOE_SHARED_STREAM on): tests/gpu; V2-Lite batch 1 / 2 / 4 (the pair mode, which
    # side-streams timed only from batch 8) with the switch 0 / 1, two passes; the MoE sweep over an E4M3 cache
    # (issue 21's MoE targets); the side stream at a higher priority (DEEPSERVE_SIDE_STREAM_PRIORITY=-1: at batch 256
    # the shared experts' down GEMM ends after the routed down GEMM, v2lite_side_timeline_h100_s49.json) and forked
    # after the routing (DEEPSERVE_MOE_SHARED_FORK=experts: there the shared gate/up GEMM's one wave of 132 blocks
    # holds the SMs until it ends, 11.2 us exposed, and the routed gate/up starts after it), one pass.
    n=""; python3 -c "import xdist" 2>/dev/null && n="-n 8"
    timeout 200 python3 -m pytest -q $n tests/gpu -m "not gpu_alone" -p no:cacheprovider > "$OUT/pytest_gpu.log" 2>&1
    tail -4 "$OUT/pytest_gpu.log" | cut -c1-300; grep -E "^FAILED" "$OUT/pytest_gpu.log" | head | cut -c1-300
    elapsed "tests/gpu"
    timeout 130 python3 benchmarks/ab_env_sweep.py --setting DEEPSERVE_MOE_SHARED_STREAM=0,1 --passes 2 --timeout 60 \
        --output "$OUT/side_stream_pair_mode_v2lite_ab.json" -- --shapes deepseek-v2-lite --contexts 1024 \
        --batches 1,2,4 --kv-cache-dtype fp8 --profile-batch 0 > /tmp/side_pair.log 2>&1
    tail -1 /tmp/side_pair.log | cut -c1-300; summarise_steps "$OUT/side_stream_pair_mode_v2lite_ab.json"
    elapsed "pair mode A/B"
    SWEEP_KV=fp8 SWEEP_DENSE=0 bash "$0" sweeps
    timeout 150 python3 benchmarks/ab_env_sweep.py --setting DEEPSERVE_MOE_SHARED_FORK=router,experts \
        --setting DEEPSERVE_SIDE_STREAM_PRIORITY=0,-1 --passes 1 --timeout 60 \
        --output "$OUT/side_stream_priority_v2lite_ab.json" -- --shapes deepseek-v2-lite --contexts 1024 \
        --batches 128,256 --kv-cache-dtype fp8 --profile-batch 0 > /tmp/side_prio.log 2>&1
    tail -1 /tmp/side_prio.log | cut -c1-300; summarise_steps "$OUT/side_stream_priority_v2lite_ab.json"
    elapsed "s49-check"
    ;;
s49-short)
    # s49-check in less device time: the side-stream GPU tests only, then the pair-mode A/B and the fork / priority
    # A/B, one pass each (no MoE sweep: the A/B rows carry the experts-roofline ratios).
    timeout 120 python3 -m pytest -q -n 4 -p no:cacheprovider tests/gpu/test_engine_gpu.py tests/gpu/test_fused_moe.py \
        -k "side_stream or combine_in_norm or backend_in_moe" > "$OUT/pytest_gpu.log" 2>&1
    tail -2 "$OUT/pytest_gpu.log" | cut -c1-300; grep -E "^FAILED" "$OUT/pytest_gpu.log" | head | cut -c1-300
    elapsed "side-stream tests"
    timeout 80 python3 benchmarks/ab_env_sweep.py --setting DEEPSERVE_MOE_SHARED_STREAM=0,1 --passes 1 --timeout 60 \
        --output "$OUT/side_stream_pair_mode_v2lite_ab.json" -- --shapes deepseek-v2-lite --contexts 1024 \
        --batches 1,2,4 --kv-cache-dtype fp8 --profile-batch 0 > /tmp/side_pair.log 2>&1
    summarise_steps "$OUT/side_stream_pair_mode_v2lite_ab.json"; elapsed "pair mode A/B"
    timeout 150 python3 benchmarks/ab_env_sweep.py --setting DEEPSERVE_MOE_SHARED_FORK=router,experts \
        --setting DEEPSERVE_SIDE_STREAM_PRIORITY=0,-1 --passes 1 --timeout 60 \
        --output "$OUT/side_stream_priority_v2lite_ab.json" -- --shapes deepseek-v2-lite --contexts 1024 \
        --batches 128,256 --kv-cache-dtype fp8 --profile-batch 0 > /tmp/side_prio.log 2>&1
    summarise_steps "$OUT/side_stream_priority_v2lite_ab.json"; elapsed "fork / priority A/B"
    ;;
s50)
    export DEEPSERVE_MLA_WGMMA=0
    # (Both switches were removed after this stage timed them on an H100: slower, or no gain. Their code is at commit
    # d9ec60b, where this stage runs as written: mla_warp_chunks_*_h100_s50.json and
    # graph_priority_v2lite_ab_h100_s50.json.)
    # Session 50. (1) DEEPSERVE_MLA_WARP_CHUNKS: the MLA decode kernel with its four column chunks as the products'
    # batch dimension, one a warp. The default kernel's warps split the tile's keys in the score product, so every
    # warp reads the whole [16, 576] query from shared memory in every tile (sm_90 build: about 36 of 51 ldmatrix a tile
    # and warp; over E4M3 the kernel reads HBM at 1.4 TB/s with its shared-memory pipe 75% busy, session 34). Its
    # tests, then kernel calls at V2-Lite batch 64 / 128 / 256 (bf16 and E4M3 caches, five tiles), then steps over
    # E4M3 at batch 64 / 128 / 256 (default tiles, and MLA_CHUNK_TILES forced), one pass. (2) The capture stream
    # above the side stream (DEEPSERVE_GRAPH_STREAM_PRIORITY=-1): at batch 256 the shared experts' cuBLAS gate/up
    # (one wave of 132 blocks) holds the SMs until it ends, and the routed gate/up starts after it
    # (v2lite_side_timeline_h100_s49.json); with the main launches first, the router's chain and the routed GEMMs
    # take free SMs before the shared blocks. Steps at batch 64 / 128 / 256, one pass.
    timeout 100 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_mla_decode.py -k "warp_chunks or matches" \
        > "$OUT/pytest_warp_chunks.log" 2>&1
    tail -2 "$OUT/pytest_warp_chunks.log" | cut -c1-300; grep -E "^FAILED" "$OUT/pytest_warp_chunks.log" | head -5
    elapsed "warp-chunk tests"
    timeout 170 python3 benchmarks/fp8_attention_kernels.py --cache-dtypes bfloat16,float8_e4m3fn \
        --settings "DEEPSERVE_FP8_PRODUCTS=f16;DEEPSERVE_FP8_PRODUCTS=f16+DEEPSERVE_MLA_WARP_CHUNKS=1" \
        --cases "v2-lite b64 ctx1024,v2-lite b128,v2-lite b256" --output "$OUT/mla_warp_chunks_kernels.json" \
        --tiles "${MLA_TILES50:-32x4x3,16x4x4,32x4x4,64x4x2,16x4x3}" > /tmp/mla_chunks_kernels.log 2>&1
    tail -1 /tmp/mla_chunks_kernels.log | cut -c1-300; summarise_kernels "$OUT/mla_warp_chunks_kernels.json"
    elapsed "warp-chunk kernels"
    timeout 200 python3 benchmarks/ab_env_sweep.py --combo DEEPSERVE_MLA_WARP_CHUNKS=0 \
        --combo DEEPSERVE_MLA_WARP_CHUNKS=1 \
        --combo "DEEPSERVE_MLA_WARP_CHUNKS=1,DEEPSERVE_MLA_DECODE_TILES=${MLA_CHUNK_TILES:-16x4x4}" --passes 1 \
        --timeout 60 --output "$OUT/mla_warp_chunks_v2lite_ab.json" -- --shapes deepseek-v2-lite --contexts 1024 \
        --batches 64,128,256 --kv-cache-dtype fp8 --profile-batch 0 > /tmp/mla_chunks_ab.log 2>&1
    tail -1 /tmp/mla_chunks_ab.log | cut -c1-300; summarise_steps "$OUT/mla_warp_chunks_v2lite_ab.json"
    elapsed "warp-chunk steps"
    timeout 130 python3 benchmarks/ab_env_sweep.py --setting DEEPSERVE_GRAPH_STREAM_PRIORITY=0,-1 --passes 1 \
        --timeout 60 --output "$OUT/graph_priority_v2lite_ab.json" -- --shapes deepseek-v2-lite --contexts 1024 \
        --batches 64,128,256 --kv-cache-dtype fp8 --profile-batch 0 > /tmp/graph_prio.log 2>&1
    tail -1 /tmp/graph_prio.log | cut -c1-300; summarise_steps "$OUT/graph_priority_v2lite_ab.json"
    elapsed "graph stream priority A/B"
    ;;
s51-wgmma)
    # Session 51: DEEPSERVE_MLA_WGMMA, the MLA decode over an 8-bit cache with tokens as the products' rows on
    # warpgroup MMAs, in Gluon (kernels/mla_decode_wgmma.py; sm_90 build: 179 registers, 2 programs an SM,
    # kernel_resources_mla_wgmma_triton36_s51.json). Its tests, then kernel calls at V2-Lite batch 64 / 128 / 256
    # against the Triton kernel (E4M3), then V2-Lite steps over E4M3 at batch 64 / 256, one pass. Run in session
    # 54 (mla_wgmma_*_h100_s54.json): the kernel is the default since.
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_mla_decode_wgmma.py -x \
        > "$OUT/pytest_mla_wgmma.log" 2>&1
    tail -2 "$OUT/pytest_mla_wgmma.log" | cut -c1-300; grep -E "^(FAILED|E )" "$OUT/pytest_mla_wgmma.log" | head -8
    elapsed "wgmma tests"
    timeout 150 python3 benchmarks/fp8_attention_kernels.py --cache-dtypes float8_e4m3fn \
        --settings "DEEPSERVE_FP8_PRODUCTS=f16+DEEPSERVE_MLA_WGMMA=0;DEEPSERVE_FP8_PRODUCTS=f16+DEEPSERVE_MLA_WGMMA=1" \
        --cases "v2-lite b64 ctx1024,v2-lite b128,v2-lite b256" --output "$OUT/mla_wgmma_kernels.json" \
        > /tmp/mla_wgmma_kernels.log 2>&1
    tail -1 /tmp/mla_wgmma_kernels.log | cut -c1-300; summarise_kernels "$OUT/mla_wgmma_kernels.json"
    elapsed "wgmma kernels"
    # The steps only where the tests passed and the kernel beat the default at batch 256 (a device call's minutes);
    # S51_STEPS=0: never.
    [ "${S51_STEPS:-1}" = 1 ] || exit 0
    python3 - "$OUT/mla_wgmma_kernels.json" "$OUT/pytest_mla_wgmma.log" <<'PY' || { echo "steps skipped"; exit 0; }
import json, sys
if " passed" not in open(sys.argv[2]).read() or " failed" in open(sys.argv[2]).read():
    sys.exit(1)
us = {s: [r.get("us") for case, rows in cases.items() if "b256" in case for r in rows.values()]
      for s, cases in json.load(open(sys.argv[1]))["by_setting"].items()}
base, wgmma = (us[s][0] for s in sorted(us, key=lambda s: "WGMMA=1" in s))
print("batch 256 kernel us: default", base, "wgmma", wgmma)
sys.exit(0 if wgmma and base and wgmma < base else 1)
PY
    timeout 200 python3 benchmarks/ab_env_sweep.py --setting DEEPSERVE_MLA_WGMMA=0,1 --passes 1 --timeout 60 \
        --output "$OUT/mla_wgmma_v2lite_ab.json" -- --shapes deepseek-v2-lite --contexts 1024 \
        --batches 64,256 --kv-cache-dtype fp8 --profile-batch 0 > /tmp/mla_wgmma_ab.log 2>&1
    tail -1 /tmp/mla_wgmma_ab.log | cut -c1-300; summarise_steps "$OUT/mla_wgmma_v2lite_ab.json"
    elapsed "wgmma steps"
    ;;
router-splits)
    # Session 55's, run in session 56 (router_splits_moe_ab_h100_s56.json: the rule was the fastest): the MoE router
    # GEMM's split-K count (16 by the rule at 256 tokens of V2-Lite's and Qwen3-MoE's gates) against 2 and 4. In
    # V2-Lite batch 256's timeline (v2lite_side_timeline_h100_s49.json) the partials kernel added 7.0 us a layer to
    # the span and the routing chain before the routed gate/up ~18 us.
    timeout 480 python3 benchmarks/ab_env_sweep.py --setting DEEPSERVE_ROUTER_SPLITS=0,2,4 --passes 1 --timeout 150 \
        --output "$OUT/router_splits_moe_ab.json" -- --shapes deepseek-v2-lite,qwen3-moe --contexts 1024 \
        --batches 64,256 --kv-cache-dtype fp8 --profile-batch 0 > /tmp/router_splits_ab.log 2>&1
    tail -1 /tmp/router_splits_ab.log | cut -c1-300; summarise_steps "$OUT/router_splits_moe_ab.json"
    elapsed "router splits"
    ;;
s56-first)
    # Run in session 56 (ncu_mla_wgmma_table_ahead_b256_h200_s56.json, an H200; the timeline printed on an H100 by
    # side-timeline). For session 56: where V2-Lite batch 256 stands after session 55 (1.504x its experts' roofline,
    # h100_decode_sweep_moe_fp8_s55.json). The wgmma MLA decode in its committed form (cp.async, the block table a tile
    # ahead) under Nsight Compute at batch 256 (the stalls left: ncu_mla_wgmma_async_b256_h100_s55.json had the form
    # before the table moved), then the step's graph timeline: what each launch adds to the span.
    ncu_kernels _mla_decode_wgmma_kernel "$OUT/ncu_mla_wgmma_table_ahead.csv" \
        python3 benchmarks/ncu_decode_attention.py --mla-large
    elapsed "ncu"
    v2lite_b256_timeline v2lite_timeline_b256; elapsed "timeline"
    ;;
reg-scores)
    # Session 57: DEEPSERVE_MLA_WGMMA_REG_SCORES, the wgmma MLA decode's score products with the widened keys as
    # their A operand in registers (reordered so that a thread's 16 loaded bytes are its fragment) instead of read back
    # from shared memory: a tile's shared-memory traffic ~246 -> ~166 KB, where session 56's Nsight Compute had the
    # kernel's warps waiting on shared memory most. Its tests (its two paths), kernel calls at V2-Lite batch 64 /
    # 128 / 256 over E4M3, then V2-Lite steps over E4M3 at batch 64 / 256, two passes.
    mla_switch_ab mla_reg_scores DEEPSERVE_MLA_WGMMA_REG_SCORES \
        "DEEPSERVE_MLA_WGMMA_REG_SCORES=0;DEEPSERVE_MLA_WGMMA_REG_SCORES=1" 64,256 reg_scores
    ;;
s55-async)
    # Session 55: DEEPSERVE_MLA_WGMMA_ASYNC, the wgmma MLA decode with the next tile's chunks 3-7 carried by cp.async
    # into shared memory (20 KB more a program, still two an SM) instead of loaded into registers at a tile's start.
    # Its tests (all paths), kernel calls at V2-Lite batch 64 / 128 / 256 over E4M3, then V2-Lite steps over E4M3
    # at batch 8 / 64 / 128 / 256, two passes. Run in session 55 before the block table was read a tile ahead
    # (mla_wgmma_async_*_h100_s55.json; with it: mla_wgmma_table_ahead_*_h100_s55.json); the default since.
    mla_switch_ab mla_wgmma_async DEEPSERVE_MLA_WGMMA_ASYNC \
        "DEEPSERVE_MLA_WGMMA_ASYNC=0;DEEPSERVE_MLA_WGMMA_ASYNC=1;DEEPSERVE_MLA_WGMMA=0" 8,64,128,256 ""
    ;;
s51)
    export DEEPSERVE_MLA_WGMMA=0
    # Session 51. Session 50's kernel calls had the MLA decode kernel over an E4M3 cache 1-2% faster at 32x4x4 (four
    # cp.async stages) than at the default 32x4x3 (34.4 / 56.8 / 99.1 against 34.6 / 57.6 / 101.1 us at V2-Lite batch
    # 64 / 128 / 256, mla_warp_chunks_kernels_h100_s50.json); its builds hold 2 programs an SM either way. Here in
    # V2-Lite steps over E4M3 at batch 8 / 64 / 128 / 256, two passes, both forced so that each row names its tiles.
    timeout 330 python3 benchmarks/ab_env_sweep.py --setting DEEPSERVE_MLA_DECODE_TILES=32x4x3,32x4x4 --passes 2 \
        --timeout 70 --output "$OUT/mla_stages_v2lite_ab.json" -- --shapes deepseek-v2-lite --contexts 1024 \
        --batches 8,64,128,256 --kv-cache-dtype fp8 --profile-batch 0 > /tmp/mla_stages_ab.log 2>&1
    tail -1 /tmp/mla_stages_ab.log | cut -c1-300; summarise_steps "$OUT/mla_stages_v2lite_ab.json"
    elapsed "MLA stages A/B"
    ;;
s51-v41)
    # Where a DeepSeek-V4.1 decode step goes with today's code (the last kernel table, profile_v41_b1.json, is an
    # H200 run of 2026-12-01 at commit 89a48d0, before most of the decode work): the scaled shape at batch 1 / 8,
    # ~1k context. Its batch-1 step ran at 0.651 of the roofline in session 50 (v41_side_stream_ab_h100_s50.json).
    timeout 300 python3 benchmarks/profile_v41_decode.py --batches 1,8 --output "$OUT/profile_v41_decode.json" \
        > /tmp/profile_v41.log 2>&1
    tail -2 /tmp/profile_v41.log | cut -c1-300
    python3 - "$OUT/profile_v41_decode.json" <<'PY'
import json, sys
for batch, r in json.load(open(sys.argv[1]))["results"].items():
    k = r["kernels"]
    print("batch", batch, "replay", r.get("graph_replay_ms"), "ms; kernels a step", k["kernels_per_step"],
          "kernel us a step", k["total_us_per_step"])
    for name, us, n in k["top"][:25]:
        print(f"    {us:8.1f} us  x{n:5.1f}  {name[:90]}")
PY
    elapsed "V4.1 decode profile"
    ;;
s50-v41)
    # DeepSeek-V4.1's scaled shape (h200_v41.py: MoE on every layer, one shared expert) with its shared experts on
    # the side stream (session 49's default) or not: decode steps at batch 1 / 8 / 64 / 256.
    for on in 0 1; do
        DEEPSERVE_MOE_SHARED_STREAM=$on timeout 170 python3 benchmarks/h200_v41.py --prefill "" --eager-batches "" \
            --batches 1,8,64,256 --output "$OUT/v41_side_stream_$on.json" > "/tmp/v41_side_$on.log" 2>&1
        tail -1 "/tmp/v41_side_$on.log" | cut -c1-200
        python3 - "$OUT/v41_side_stream_$on.json" "$on" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])).get("decode", []):
    keys = ("batch_size", "decode_ms_per_step", "fraction_of_roofline", "error")
    print("side stream", sys.argv[2], {k: r.get(k) for k in keys})
PY
        elapsed "V4.1 side stream $on"
    done
    ;;
side-timeline)
    # V2-Lite batch 256's graph timeline over E4M3 with the shared experts on the side stream (session 49's
    # DEEPSERVE_MOE_SHARED_STREAM, then also with DEEPSERVE_MLA_WRITE_STREAM=1, since removed): what each launch adds
    # to the span (v2lite_timeline_h100_s48.json is the same without them).
    v2lite_b256_timeline v2lite_side_timeline; elapsed "side-timeline"
    ;;
v2lite-timeline)
    # Where DeepSeek-V2-Lite's batch 64 / 256 steps over an E4M3 cache go today (its batch 256 is issue 21's last MoE
    # target: 1.61x the experts' roofline, h100_decode_sweep_moe_fp8_s47.json; batch 64 touches as many experts in
    # 12.25 ms against 15.27): each graph replay's kernels by name and what each adds to the span (PDL on).
    timeout 280 python3 benchmarks/h200_decode_sweep.py --shapes deepseek-v2-lite --batches 64,256 --contexts 1024 \
        --kv-cache-dtype fp8 --profile-batch 0 --timeline-batch 64,256 --output "$OUT/v2lite_timeline.json" \
        > /tmp/v2lite_timeline.log 2>&1
    tail -1 /tmp/v2lite_timeline.log | cut -c1-200
    summarise_timelines "$OUT/v2lite_timeline.json" 1024 deepseek-v2-lite; elapsed "v2lite-timeline"
    ;;
moe-b256)
    # V2-Lite batch 256 over E4M3 (v2lite_timeline_h100_s48.json): per MoE layer the down GEMM's launch lasts 157.5 us
    # for 369 MB against the gate/up's 253.9 for 738 MB (it adds 132.6 to the step), and the shared experts run apart
    # (fused only up to 128 tokens): cuBLAS gate/up + SiLU-and-mul + cuBLAS down, 25 us. On this GPU: the down GEMM's
    # tiles at 256 tokens (the whole fused_moe call timed, only the down tiles varied; session 48: the pick is the
    # fastest), then the shared experts fused / apart at 128 / 256 tokens.
    timeout 300 python3 benchmarks/tune_moe_decode.py --down --shapes deepseek-v2-lite --tokens 256 \
        --output "$OUT/tune_moe_down_v2lite.json" > /tmp/tune_down.log 2>&1
    grep -E "best|engine pick" /tmp/tune_down.log | cut -c1-300; tail -2 /tmp/tune_down.log | cut -c1-300
    python3 - "$OUT/tune_moe_down_v2lite.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]["deepseek-v2-lite"]:
    timed = sorted((v["us"], k) for k, v in r["configs"].items() if isinstance(v, dict))
    for us, k in timed[:8]:
        print(r["tokens"], us, k.replace("MoEConfig", "")[:200])
PY
    elapsed "tune down"
    # The fastest down tiles in V2-Lite steps at batch 128 / 256 over E4M3 against the pick, where 3% or more faster
    # alone (DEEPSERVE_MOE_DOWN_TILES, one pass).
    best=$(python3 - "$OUT/tune_moe_down_v2lite.json" <<'PY'
import json, re, sys
r = json.load(open(sys.argv[1]))["results"]["deepseek-v2-lite"][-1]
timed = {k: v["us"] for k, v in r["configs"].items() if isinstance(v, dict)}
us, best = min((v, k) for k, v in timed.items() if k != "engine pick")
if us < 0.97 * timed["engine pick"]:
    f = dict(re.findall(r"(\w+)=(\d+)", best))
    print("x".join(f[k] for k in ("block_n_down", "block_k_down", "num_warps_down", "num_stages_down")))
PY
)
    echo "down tiles to time in steps: ${best:-none}"
    if [ -n "$best" ]; then
        timeout 260 python3 benchmarks/ab_env_sweep.py --setting "DEEPSERVE_MOE_DOWN_TILES=default,$best" --passes 1 \
            --timeout 120 --output "$OUT/moe_down_tiles_v2lite_ab.json" -- --shapes deepseek-v2-lite --contexts 1024 \
            --batches "${DOWN_BATCHES:-128,256}" --kv-cache-dtype fp8 --profile-batch 0 > /tmp/down_tiles_ab.log 2>&1
        tail -2 /tmp/down_tiles_ab.log | cut -c1-300; summarise_steps "$OUT/moe_down_tiles_v2lite_ab.json"
        elapsed "down tiles A/B"
    fi
    if [ "${SHARED:-1}" = 1 ]; then     # SHARED=0: no shared-experts part
        timeout 200 python3 benchmarks/moe_shared_fusion_ab.py --uncapped --shapes deepseek-v2-lite \
            --batches 128,256 --output "$OUT/moe_shared_fusion_v2lite.json" 2>&1 | tail -4 | cut -c1-300
        elapsed "shared fusion"
    fi
    ;;
combine-timeline)
    # Where a batch-256 layer's time goes with the combine in the norm (session 32's, without: 605 us in 14 launches,
    # h100_moe_b256_timeline_s32.json).
    DEEPSERVE_MOE_COMBINE_IN_NORM=1 timeout 300 python3 benchmarks/h200_decode_sweep.py --shapes qwen3-moe \
        --batches 256 --contexts 1024 --kv-cache-dtype fp8 --profile-batch 0 --timeline-batch 256 \
        --output "$OUT/moe_combine_in_norm_timeline.json" > /tmp/combine_timeline.log 2>&1
    tail -30 /tmp/combine_timeline.log | cut -c1-300; elapsed "combine-timeline"
    ;;
decode-edges)
    # Session 46's changes at a decode step's ends, all three on (no switch): the hidden states taken without a
    # gather where every row samples, the batch-1 / skinny LM head writing the graph's logits in place, the PDL
    # embedding gather. Their GPU tests, then Llama-3.2-1B steps at 1k, batch 1 / 2 / 8 / 64, two passes, against
    # the tree before them (BEFORE, default .scratch/s46/before: `git archive b6441ce deepserve` plus its
    # benchmarks/*.py, carried in).
    # (session 46's run also took tests/gpu/test_engine_gpu.py here, which outran the timeout; the `tests` stage has it)
    timeout 150 python3 -m pytest -q tests/gpu/test_embedding.py tests/gpu/test_gemv.py \
        -p no:cacheprovider > "$OUT/pytest_decode_edges.log" 2>&1
    tail -2 "$OUT/pytest_decode_edges.log"; elapsed "tests"
    timeout 330 python3 benchmarks/ab_env_sweep.py --tree before="${BEFORE:-.scratch/s46/before}" --tree after=. \
        --passes 2 --timeout 80 --output "$OUT/decode_edges_1b_ab.json" -- --shapes llama-3.2-1b --contexts 1024 \
        --batches 1,2,8,64 --profile-batch 0 > /tmp/decode_edges.log 2>&1
    tail -2 /tmp/decode_edges.log | cut -c1-300; summarise_steps "$OUT/decode_edges_1b_ab.json"; elapsed "A/B"
    ;;
gemv-tiling)
    # Session 46's DEEPSERVE_GEMV_TILING: the batch-1 GEMV's 36 tilings (gemv.py's table was tuned on an H200) timed
    # on this GPU on the down, gate/up and LM-head shapes of Llama-3.2-1B and Llama-3-8B, then in 1B batch-1 steps at
    # 1k the fastest tiling of the down (long_rows) and gate/up (many_rows) classes against the table, two passes.
    timeout 240 python3 benchmarks/tune_gemv.py --kernel 2d-wide \
        --shapes down,gate_up,lm_head,llama3_8b_down,llama3_8b_gate_up --output "$OUT/tune_gemv_wide.json" \
        > /tmp/tune_gemv.log 2>&1
    tail -6 /tmp/tune_gemv.log | cut -c1-300; elapsed "tune"
    candidates=$(python3 - "$OUT/tune_gemv_wide.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["results"]
table = {"long_rows": ("down", "(1, 512, 4)"), "many_rows": ("gate_up", "(4, 512, 1)")}
picked = {}
for shape_class, (shape, default) in table.items():
    if shape not in rows:
        continue
    us, best = min((v["us"], c) for c, v in rows[shape].items() if c.startswith("(") and isinstance(v, dict))
    print(f"{shape_class}: table {default} {rows[shape][default]['us']} us, best {best} {us} us", file=sys.stderr)
    if us < 0.97 * rows[shape][default]["us"]:           # 3% or more faster on its own
        picked[shape_class] = shape_class + "=" + "x".join(best.strip("()").split(", "))
settings = list(picked.values()) + (([";".join(picked.values())]) if len(picked) > 1 else [])
print(",".join(settings))
PY
)
    echo "candidates: ${candidates:-none}"
    if [ -n "$candidates" ]; then
        timeout 320 python3 benchmarks/ab_env_sweep.py --setting "DEEPSERVE_GEMV_TILING=default,$candidates" \
            --passes 2 --timeout 60 --output "$OUT/gemv_tiling_1b_ab.json" -- --shapes llama-3.2-1b \
            --contexts 1024 --batches 1 --profile-batch 0 > /tmp/gemv_tiling_ab.log 2>&1
        tail -2 /tmp/gemv_tiling_ab.log | cut -c1-300; summarise_steps "$OUT/gemv_tiling_1b_ab.json"; elapsed "A/B"
    fi
    ;;
s47-first)
    # DeepSeek-V4.1's GPU tests since session 46's step-edge changes (never run on a GPU with them), then what a
    # step's inputs and outputs cost between two graph replays: the ways they can travel on a stand-in forward
    # (step_io_paths.py), and what runs between Llama-3.2-1B's replays at batch 1 / 8 (step_outside_graph.py).
    timeout 240 python3 -m pytest -q tests/gpu/test_deepseek_v41_gpu.py tests/gpu/test_dspark_gpu.py \
        tests/gpu/test_embedding.py -p no:cacheprovider > "$OUT/pytest_v41.log" 2>&1
    tail -3 "$OUT/pytest_v41.log"; elapsed "V4.1 tests"
    timeout 150 python3 benchmarks/step_io_paths.py --output "$OUT/step_io_paths.json" 2>&1 | tail -16
    elapsed "step io paths"
    timeout 150 python3 benchmarks/step_outside_graph.py --cases 'llama-3.2-1b:1,8' \
        --output "$OUT/step_outside_graph_1b.json" > /tmp/outside.log 2>&1
    tail -2 /tmp/outside.log | cut -c1-2500; elapsed "outside graph"
    ;;
s47-all)
    # One call for session 47's first device time: s47-first without step_outside_graph.py, then mapped-io.
    timeout 150 python3 -m pytest -q tests/gpu/test_deepseek_v41_gpu.py tests/gpu/test_dspark_gpu.py \
        tests/gpu/test_embedding.py -p no:cacheprovider > "$OUT/pytest_v41.log" 2>&1
    tail -3 "$OUT/pytest_v41.log"; elapsed "V4.1 tests"
    timeout 100 python3 benchmarks/step_io_paths.py --repeats 3 --output "$OUT/step_io_paths.json" 2>&1 | tail -16
    elapsed "step io paths"
    BATCHES=1,8,64 bash "$0" mapped-io
    ;;
s47-check)
    # DEEPSERVE_MAPPED_STEP_IO on by default: all of tests/gpu (the `tests` stage), then Qwen3-MoE decode steps over
    # an E4M3 cache at batch 8 / 64, off / on, one pass.
    bash "$0" tests
    timeout 240 python3 benchmarks/ab_env_sweep.py --setting DEEPSERVE_MAPPED_STEP_IO=0,1 --passes 1 --timeout 110 \
        --output "$OUT/mapped_io_qwen3_moe_ab.json" -- --shapes qwen3-moe --contexts 1024 --batches 8,64 \
        --kv-cache-dtype fp8 --profile-batch 0 > /tmp/mapped_io_moe.log 2>&1
    tail -2 /tmp/mapped_io_moe.log | cut -c1-300; summarise_steps "$OUT/mapped_io_qwen3_moe_ab.json"; elapsed "A/B"
    ;;
mapped-io)
    # Session 47's DEEPSERVE_MAPPED_STEP_IO: decode graphs that read their inputs from pinned host memory and write
    # the greedy tokens there (no copies queued between two replays). Its GPU tests (the load against its twin,
    # the argmax into host memory, an engine's tokens against an eager one's), then Llama-3.2-1B steps at 1k,
    # batch 1 / 2 / 8 / 64, off / on, two passes.
    timeout 150 python3 -m pytest -q tests/gpu/test_graph_inputs.py \
        tests/gpu/test_argmax.py tests/gpu/test_engine_gpu.py -k "load or argmax or pinned or graph_input_switches" \
        -p no:cacheprovider > "$OUT/pytest_mapped_io.log" 2>&1
    tail -3 "$OUT/pytest_mapped_io.log"; elapsed "tests"
    timeout 330 python3 benchmarks/ab_env_sweep.py --setting DEEPSERVE_MAPPED_STEP_IO=0,1 --passes 2 --timeout 80 \
        --output "$OUT/mapped_io_1b_ab.json" -- --shapes llama-3.2-1b --contexts 1024 \
        --batches "${BATCHES:-1,2,8,64}" --profile-batch 0 > /tmp/mapped_io.log 2>&1
    tail -2 /tmp/mapped_io.log | cut -c1-300; summarise_steps "$OUT/mapped_io_1b_ab.json"; elapsed "A/B"
    ;;
window)
    # Session 60's sliding-window attention (Mistral v0.1, Qwen's windowed layers): the decode and prefill kernels
    # against their PyTorch twins, the backends against each other, a windowed Mistral's greedy tokens on the GPU
    # (CUDA graphs, mixed steps, the batch-1 fused projection) against the CPU engine's; then one Mistral-7B layer's
    # kernels with and without its 4096-key window (sliding_window_attention_*.json).
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_paged_attention.py \
        tests/gpu/test_paged_prefill.py tests/gpu/test_engine_gpu.py -k window > "$OUT/pytest_window.log" 2>&1
    tail -3 "$OUT/pytest_window.log"; grep -E "^(FAILED|E )" "$OUT/pytest_window.log" | head -8; elapsed "tests"
    timeout 150 python3 benchmarks/sliding_window_attention.py --output "$OUT/sliding_window_attention.json" \
        > /tmp/window_bench.log 2>&1
    tail -16 /tmp/window_bench.log | cut -c1-200; elapsed "kernels"
    ;;
window-check)
    # The window stage, then the GPU test files whose kernels and backends the window touched (their default launches
    # build the same PTX as before: benchmarks/compare_attention_ptx.py), for when a whole `tests` stage does not fit
    # the device time left.
    bash "$0" window
    n=""; python3 -c "import xdist" 2>/dev/null && n="-n 8"
    timeout 300 python3 -m pytest -q $n -p no:cacheprovider tests/gpu/test_paged_attention.py \
        tests/gpu/test_paged_prefill.py tests/gpu/test_qkv_rotary.py tests/gpu/test_engine_gpu.py \
        tests/gpu/test_mixed_graph_gpu.py tests/gpu/test_batch_invariant_gpu.py tests/gpu/test_spec_decode_gpu.py \
        > "$OUT/pytest_gqa.log" 2>&1
    tail -3 "$OUT/pytest_gqa.log"; grep -E "^(FAILED|E )" "$OUT/pytest_gqa.log" | head -8; elapsed "GQA test files"
    ;;
sweeps)
    # SWEEP_KV=fp8: the MoE sweep over an E4M3 cache only; SWEEP_KV=' ' (a blank): no MoE sweep, the dense one alone
    for kv in ${SWEEP_KV:-fp8 auto}; do
        timeout 140 python3 benchmarks/h200_decode_sweep.py --shapes qwen3-moe,deepseek-v2-lite --batches 8,64,128,256 \
            --contexts 1024 --kv-cache-dtype $kv --output "$OUT/moe_$kv.json" > /tmp/moe_$kv.log 2>&1
        elapsed "moe sweep, $kv cache"
    done
    if [ "${SWEEP_DENSE:-1}" = 1 ]; then       # SWEEP_DENSE=0: the MoE sweeps only
        timeout 160 python3 benchmarks/h200_decode_sweep.py --shapes llama-3.2-1b,llama-3-8b --batches 1,8,64,256 \
            --contexts 1024,4096 --output "$OUT/dense_auto.json" > /tmp/dense.log 2>&1
        elapsed "dense sweep"
    fi
    summarise_sweeps
    ;;
*)
    echo "unknown stage $STAGE"; exit 2
    ;;
esac
