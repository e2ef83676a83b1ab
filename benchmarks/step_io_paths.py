"""What a decode step's inputs and outputs cost the device between two CUDA graph replays, by the way they travel.

A steady greedy decode step on the GPU is: the step's inputs copied host -> device (pinned, one memcpy), the
graph replayed, the sampled tokens copied device -> host (one memcpy), an event the host waits on a step later.
Llama-3.2-1B's batch-1 step at 1k takes ~20 us longer than its graph replayed back to back (session 46,
`decode_edges_1b_ab_h100_s46.json`: 1.037 against 1.017 ms). This times, on a stand-in forward (a chain of GEMVs
in a CUDA graph), each way of moving the bytes, with the host one step ahead as the engine's overlapped loop is
(launch step i, then wait for step i - 1):

  graph            the graph alone, no inputs or outputs moved
  copies           memcpy in, graph, memcpy out (the engine today)
  copy_in          memcpy in, graph (tokens stay on the device)
  copy_out         graph, memcpy out
  mapped           the graph's first kernel reads the inputs from pinned host memory itself, its last writes the
                   tokens into pinned host memory (one graph per host buffer: the engine alternates two)
  mapped_in        mapped inputs, memcpy out
  graph_memcpy     both memcpys captured inside the graph (one graph per host buffer)

Each step carries a counter in its inputs and the forward returns it plus one: the host checks every token it
collects, so a path that lost or reordered bytes fails instead of timing well.

Run (GPU machine):  python benchmarks/step_io_paths.py --output step_io_paths.json
Plot (any machine): python benchmarks/step_io_paths.py --plot step_io_paths.json   (writes the PNG beside it)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=ok), mask=ok)


def copy_by_kernel(src: torch.Tensor, dst: torch.Tensor, block: int = 1024) -> None:
    """dst[:] = src[:] by a kernel: either side may be pinned host memory (read or written over PCIe)."""
    n = dst.numel()
    _copy_kernel[(triton.cdiv(n, block),)](src, dst, n, BLOCK=block, num_warps=4)


class Stand:
    """The stand-in forward and its buffers: `layers` GEMVs of [hidden, hidden] bf16, then tokens = inputs[0] + 1."""

    def __init__(self, in_elems: int, layers: int, hidden: int) -> None:
        self.host_in = [torch.zeros(in_elems, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self.host_out = [torch.zeros(8, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self.dev_in = torch.zeros(in_elems, dtype=torch.int64, device="cuda")
        self.tokens = torch.zeros(8, dtype=torch.int64, device="cuda")
        self.weights = [torch.randn(hidden, hidden, dtype=torch.bfloat16, device="cuda") / hidden ** 0.5
                        for _ in range(layers)]
        self.x = torch.randn(1, hidden, dtype=torch.bfloat16, device="cuda")

    def forward(self) -> None:
        h = self.x + self.dev_in[:1].to(torch.bfloat16)[:, None] * 0
        for w in self.weights:
            h = torch.nn.functional.linear(h, w)
        self.tokens.copy_(self.dev_in[:8] + 1 + (h[0, :8] * 0).to(torch.int64))

    def capture(self, before=None, after=None) -> torch.cuda.CUDAGraph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                before and before()
                self.forward()
                after and after()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            before and before()
            self.forward()
            after and after()
        torch.cuda.synchronize()
        return graph


def run_path(stand: Stand, path: str, steps: int) -> tuple[float, int]:
    """(us a step, tokens checked) of `steps` steps taken the way `path` names, the host one step ahead."""
    plain = stand.capture()
    by_turn = None
    if path in ("mapped", "mapped_in"):
        by_turn = [stand.capture(before=lambda t=t: copy_by_kernel(stand.host_in[t], stand.dev_in),
                                 after=(lambda t=t: copy_by_kernel(stand.tokens, stand.host_out[t]))
                                 if path == "mapped" else None) for t in range(2)]
    if path == "graph_memcpy":
        by_turn = [stand.capture(before=lambda t=t: stand.dev_in.copy_(stand.host_in[t], non_blocking=True),
                                 after=lambda t=t: stand.host_out[t].copy_(stand.tokens, non_blocking=True))
                   for t in range(2)]
    copy_in = path in ("copies", "copy_in")
    copy_out = path in ("copies", "copy_out", "mapped_in")
    checks = path in ("copies", "mapped", "mapped_in", "graph_memcpy")     # the tokens reach the host
    events: list = []
    checked = 0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        turn = i % 2
        if path != "graph":
            stand.host_in[turn][0] = i          # the step's counter: its token must come back as i + 1
        if copy_in:
            stand.dev_in.copy_(stand.host_in[turn], non_blocking=True)
        (by_turn[turn] if by_turn else plain).replay()
        if copy_out:
            stand.host_out[turn].copy_(stand.tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        events.append((i, turn, event))
        if i >= 1:                               # collect the step before this one
            j, t, e = events[i - 1]
            e.synchronize()
            if checks:
                got = int(stand.host_out[t][0])
                if got != j + 1:
                    raise RuntimeError(f"{path}: step {j} collected token {got}, expected {j + 1}")
                checked += 1
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1e6, checked


def plot(path: str) -> None:
    """Each path's time a step over the graph alone, per size of the step's inputs, into PATH's .png."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(path) as f:
        data = json.load(f)
    sizes = list(data["results"])
    paths = [p for p in data["results"][sizes[0]] if p != "graph"]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(sizes)
    for i, size in enumerate(sizes):
        rows = data["results"][size]
        ax.bar([j + i * width for j in range(len(paths))], [rows[p].get("over_graph_us", 0) for p in paths],
               width, label=f"inputs {size} B")
    ax.set_xticks([j + width * (len(sizes) - 1) / 2 for j in range(len(paths))], paths)
    ax.set_ylabel("us a step over the graph alone")
    ax.set_title(f"{data['gpu']}: a step's inputs / tokens, by the way they travel (median of "
                 f"{len(data['results'][sizes[0]]['graph']['us'])})", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path.rsplit(".", 1)[0] + ".png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plot", help="a JSON this script wrote: draw its PNG and exit")
    ap.add_argument("--paths", default="graph,copies,copy_in,copy_out,mapped,mapped_in,graph_memcpy")
    ap.add_argument("--in-elems", default="3074,70", help="int64 elements of a step's inputs (the engine's batch-1 "
                    "copy at a 512-row capture: 6 columns x 512 + 2, then a compact layout's)")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--output", default="step_io_paths.json")
    args = ap.parse_args()
    if args.plot:
        plot(args.plot)
        return
    result = {"command": "python " + " ".join(sys.argv), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": triton.__version__, "layers": args.layers, "hidden": args.hidden,
              "results": {}}
    for in_elems in (int(v) for v in args.in_elems.split(",")):
        stand = Stand(in_elems, args.layers, args.hidden)
        rows = {}
        for rep in range(args.repeats):
            for path in args.paths.split(","):      # interleaved: a drift of the clock touches every path alike
                rows.setdefault(path, {"us": [], "checked": 0})
                try:
                    us, checked = run_path(stand, path, args.steps)
                except Exception as e:      # a path this GPU / Triton cannot take: say why, time the others
                    rows[path]["error"] = repr(e)[-500:]
                    continue
                rows[path]["us"].append(round(us, 2))
                rows[path]["checked"] += checked
        base = statistics.median(rows["graph"]["us"]) if "graph" in rows else None
        for path, r in rows.items():
            if not r["us"]:
                print(path, r.get("error"), flush=True)
                continue
            r["median_us"] = statistics.median(r["us"])
            if base is not None:
                r["over_graph_us"] = round(r["median_us"] - base, 2)
            print(f"in {in_elems * 8} B  {path:14s} {r['median_us']:8.2f} us a step", r.get("over_graph_us"),
                  "checked", r["checked"], flush=True)
        result["results"][str(in_elems * 8)] = rows
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
