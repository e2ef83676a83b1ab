"""Decode steps A/B'd over the settings of environment switches (experiments behind a DEEPSERVE_* variable, read at
start-up or first use): for each setting and pass, h200_decode_sweep.py in a process of its own, the rows merged
into one JSON (results: "NAME=value, pass N" -> rows of label, batch, step_ms, graph_replay_ms and the ratios) with
plot_ab.steps_by_batch's bars beside it. (ab_env.py A/Bs switches on batch-1 replays and offline throughput.)

Run (GPU machine; the sweep's arguments after --):
  python benchmarks/ab_env_sweep.py --setting DEEPSERVE_L2_PREFETCH=off,rotary,rotary_evict_last,reduce --passes 2 \\
      --output benchmarks/l2_prefetch_ab_h200.json -- --shapes llama-3.2-1b --contexts 1024 --batches 1,8,16,32,64
  python benchmarks/ab_env_sweep.py --setting DEEPSERVE_GRAPH_TOKENS=0,1 --passes 2 \\
      --output benchmarks/graph_tokens_ab_h200.json -- --shapes qwen3-moe --batches 8,128
Several --setting flags run every combination; --combo NAME=v,NAME2=v2 (repeatable) runs exactly the listed
settings instead, e.g. a baseline, each switch alone and all of them in one call. --tree LABEL=DIR (repeatable) A/Bs
source trees (a change without a switch): each setting (or none) runs once per tree, the sweep from DIR, e.g.
  git archive HEAD~1 deepserve benchmarks | tar -x -C /tmp/before
  python benchmarks/ab_env_sweep.py --tree before=/tmp/before --tree after=. --passes 2 --output ab.json -- ...
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SWEEP = HERE / "h200_decode_sweep.py"
KEPT = ("batch", "context", "step_ms", "graph_replay_ms", "tokens_per_s", "fraction_of_roofline",
        "experts_roofline_ratio", "touched_experts_per_step")


def settings(flags: list[str]) -> list[dict[str, str]]:
    """Every combination of the flags' values: ["A=1,2", "B=x"] -> [{A: 1, B: x}, {A: 2, B: x}]."""
    axes = []
    for flag in flags:
        name, _, values = flag.partition("=")
        if not name or not values:
            raise SystemExit(f"--setting {flag!r}: expected NAME=value1,value2,...")
        axes.append([(name, v) for v in values.split(",")])
    return [dict(combo) for combo in itertools.product(*axes)]


def combos(flags: list[str]) -> list[dict[str, str]]:
    """Each flag one setting: ["A=1,B=2", "A=3"] -> [{A: 1, B: 2}, {A: 3}]."""
    out = []
    for flag in flags:
        pairs = [item.partition("=") for item in flag.split(",")]
        if not all(name and sep and value for name, sep, value in pairs):
            raise SystemExit(f"--combo {flag!r}: expected NAME=value,NAME2=value2,...")
        out.append({name: value for name, _, value in pairs})
    return out


def sweep_rows(result: dict) -> list[dict]:
    """The sweep JSON's rows, each labelled by shape, context (when the sweep ran several) and batch."""
    rows = []
    for shape, by_context in result["results"].items():
        for context, entry in by_context.items():
            for r in entry.get("batches", []):
                row = {k: r[k] for k in KEPT if k in r}
                ctx = f" {int(context) // 1024}k" if len(by_context) > 1 else ""
                row.update(shape=shape, label=f"{shape}{ctx} b{r['batch']}")
                rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setting", action="append", default=[], help="NAME=value1,value2,... (repeatable)")
    ap.add_argument("--combo", action="append", default=[], help="NAME=value,NAME2=value2: one setting (repeatable)")
    ap.add_argument("--passes", type=int, default=1)
    ap.add_argument("--output", required=True)
    ap.add_argument("--timeout", type=int, default=300, help="seconds per sweep process")
    ap.add_argument("--sweep", default=str(SWEEP), help="the sweep script (h200_decode_sweep.py)")
    ap.add_argument("--tree", action="append", default=[],
                    help="LABEL=DIR (repeatable): also A/B source trees, each run from DIR/benchmarks/"
                         "h200_decode_sweep.py (which imports DIR's deepserve), e.g. a commit's `git archive`")
    ap.add_argument("sweep_args", nargs=argparse.REMAINDER, help="-- then the sweep's arguments")
    args = ap.parse_args()
    sweep_args = args.sweep_args[1:] if args.sweep_args[:1] == ["--"] else args.sweep_args
    if args.setting and args.combo:
        raise SystemExit("give --setting flags (every combination) or --combo flags (those settings), one kind")
    if not (args.setting or args.combo or args.tree):
        raise SystemExit("give --setting, --combo or --tree flags")
    chosen = settings(args.setting) if args.setting else combos(args.combo) if args.combo else [{}]
    if any(not label or not tree for label, _, tree in (flag.partition("=") for flag in args.tree)):
        raise SystemExit(f"--tree {args.tree}: expected LABEL=DIR")
    trees = dict(flag.partition("=")[::2] for flag in args.tree)
    if trees:       # each setting under each tree: "tree" labels the run, the sweep script comes from that tree
        chosen = [{"tree": label, **setting} for label in trees for setting in chosen]
    out = {"command": "python benchmarks/ab_env_sweep.py " + " ".join(sys.argv[1:]), "results": {}, "failed": []}
    with tempfile.TemporaryDirectory() as tmp:
        for p in range(1, args.passes + 1):
            for setting in chosen:
                name = ", ".join(f"{k}={v}" for k, v in setting.items()) + f", pass {p}"
                path = os.path.join(tmp, "sweep.json")
                env = {k: v for k, v in setting.items() if k != "tree"}
                sweep = os.path.join(trees[setting["tree"]], "benchmarks", SWEEP.name) if trees else args.sweep
                cmd = [sys.executable, sweep, *sweep_args, "--output", path]
                try:
                    run = subprocess.run(cmd, env={**os.environ, **env}, timeout=args.timeout,
                                         capture_output=True, text=True)
                    failed = run.returncode != 0 or not os.path.exists(path)
                    reason = (run.stderr or run.stdout)[-600:]
                except subprocess.TimeoutExpired:
                    failed, reason = True, f"timed out after {args.timeout} s"
                if failed:
                    out["failed"].append({"setting": name, "why": reason})
                    print(f"{name}: FAILED {reason[-200:]}", flush=True)
                    continue
                with open(path) as f:
                    result = json.load(f)
                os.remove(path)
                out.setdefault("gpu", result.get("gpu"))
                out["results"][name] = rows = sweep_rows(result)
                print(name, [(r["label"], r["step_ms"]) for r in rows], flush=True)
                # After every setting: a run cut short (a device call's time limit) keeps what it measured.
                Path(args.output).write_text(json.dumps(out, indent=1))
    output = Path(args.output)
    output.write_text(json.dumps(out, indent=1))
    from plot_ab import steps_by_batch
    fig = steps_by_batch(output, f"decode steps by setting: {'; '.join(args.tree + (args.setting or args.combo))}")
    fig.tight_layout()
    fig.savefig(output.with_suffix(".png"), dpi=110)
    print("wrote", output, output.with_suffix(".png"))


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
