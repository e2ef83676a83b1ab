"""Host time of the verification-cost model's online update (spec_decode/length_policy.py StepCostModel.observe),
per engine step, with the fit redone every step (before session 11) and once per 1/100 of the window (now).

A small model's decode step on an H200 is ~0.6 ms (benchmarks/spec_decode_h200.json): an update costing as much
is paid by confidence-scheduled speculation on every step.

    python benchmarks/cost_model_overhead.py --out benchmarks/cost_model_overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time


def per_observe_us(refits_per_window: int, steps: int) -> float:
    from deepserve.spec_decode import length_policy
    from deepserve.spec_decode.length_policy import StepCostModel
    length_policy.REFITS_PER_WINDOW = refits_per_window
    rng = random.Random(0)
    model = StepCostModel([(1, 0.5), (2, 0.5), (4, 0.52), (8, 0.55), (16, 0.6), (32, 0.7), (64, 0.9)], padded=True)
    for _ in range(5000):                                       # a full window first
        model.observe(rng.choice([1, 2, 3, 5, 8, 12, 20, 33]), 0.6 + rng.random() * 0.1)
    t0 = time.perf_counter()
    for _ in range(steps):
        model.observe(rng.choice([1, 2, 3, 5, 8, 12, 20, 33]), 0.6 + rng.random() * 0.1)
    return round((time.perf_counter() - t0) / steps * 1e6, 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/cost_model_overhead.json")
    ap.add_argument("--steps", type=int, default=1000)
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from deepserve.bench.throughput import machine_info
    result = {"command": "python " + " ".join(sys.argv), "machine": machine_info(),
              "window_samples": 5000,
              "us_per_step_refit_every_step": per_observe_us(10 ** 9, args.steps),     # interval max(1, 0) = 1
              "us_per_step_refit_per_1_100_window": per_observe_us(100, args.steps)}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}))


if __name__ == "__main__":
    main()
