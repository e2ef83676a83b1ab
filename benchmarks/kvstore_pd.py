"""Prefill/decode disaggregation vs colocated replicas: TTFT and ITL under a mixed load (CPU, default model).

Two engine processes either way, one torch thread each (2 cores): `serve --replicas 2` (colocated: each replica
prefills and decodes; the router's cache_aware policy) against `serve --replicas 2 --pd 1:1` (one prefill, one
decode engine sharing a disk KV store). The load: `deepserve bench serve` with long prompts arriving (Poisson) while
earlier requests decode, so colocated decodes share steps with prompt chunks and disaggregated ones do not.

Run:  python benchmarks/kvstore_pd.py --output benchmarks/kvstore_pd.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from deepserve.bench.throughput import machine_info, write_json

METRICS = ("ttft", "itl", "e2el")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_group(flags: list[str], log_path: str, max_model_len: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = open(log_path, "w")  # noqa: SIM115 - written by the group until it exits
    proc = subprocess.Popen([sys.executable, "-m", "deepserve.cli", "serve", *flags, "--port", str(port),
                             "--max-model-len", str(max_model_len)], env=env, start_new_session=True,
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(log_path) as f:
                raise RuntimeError(f"the group exited: {f.read()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError("the group did not come up")


def stop_group(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def bench(url: str, args, label: str, out_json: str, compare: list[str]) -> dict:
    cmd = [sys.executable, "-m", "deepserve.cli", "bench", "serve", "--base-url", url, "--num-prompts",
           str(args.num_prompts), "--request-rate", str(args.request_rate), "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--seed", "0", "--label", label, "--output-json", out_json]
    if compare:
        cmd += ["--plot", args.plot, "--compare", *compare]
    subprocess.run(cmd, check=True, timeout=1800)
    with open(out_json) as f:
        return json.load(f)


def summary(run: dict) -> dict:
    """The bench's per-run numbers for TTFT / ITL / E2EL (ms), whatever their exact key layout."""
    result = run["runs"][0] if "runs" in run else run
    return {k: v for k, v in result.items() if any(m in k for m in METRICS) or k in ("completed", "duration_s",
                                                                                        "request_throughput")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--request-rate", type=float, default=0.25)
    parser.add_argument("--input-len", type=int, default=768)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--output", default="benchmarks/kvstore_pd.json")
    parser.add_argument("--plot", default="benchmarks/kvstore_pd.png")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="kvstore-pd-")
    kv_store = json.dumps({"backend": "disk", "path": os.path.join(work, "kv")})
    groups = {"colocated": ["--replicas", "2"], "pd_1_1": ["--replicas", "2", "--pd", "1:1", "--kv-store", kv_store]}
    runs, files = {}, []
    for label, flags in groups.items():
        print(f"{label}: starting", flush=True)
        proc, url = start_group(flags, os.path.join(work, f"{label}.log"), args.max_model_len)
        try:
            out = os.path.join(work, f"{label}.json")
            runs[label] = bench(url, args, label, out, files)
            files.append(out)
        finally:
            stop_group(proc)
    payload = {"command": "python " + shlex.join(sys.argv), "groups": groups,
               "load": {k: getattr(args, k) for k in ("num_prompts", "request_rate", "input_len", "output_len")},
               "summary": {label: summary(run) for label, run in runs.items()}, "runs": runs,
               "notes": ["2 engine processes either way, OMP_NUM_THREADS=1 each, on the same 2 cores",
                         ("pd_1_1: prefill replica computes each prompt into a disk KV store, the decode replica "
                          "loads it; colocated: both replicas prefill and decode")],
               "machine": machine_info()}
    write_json(args.output, payload)
    print(json.dumps(payload["summary"], indent=2))


if __name__ == "__main__":
    main()
