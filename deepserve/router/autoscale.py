"""The replica count the load asks for, exported as a gauge for an external autoscaler (Kubernetes HPA, KEDA).

HPA's rule, desired = ceil(current x signal / target), on the worst of three signals from the replicas' load
reports, each 1.0 when a replica is exactly as loaded as wanted:
- queue: requests waiting to be scheduled mean the replicas are full: 1 + waiting / running;
- KV cache: mean usage over KV_TARGET (a full cache preempts);
- TTFT: the recent mean time to first token over --autoscale-target-ttft-ms (only with a target).
No signal above 1 lets the count shrink; the result is clamped to [min, max]. Hysteresis (how long a
signal must hold before acting) is the autoscaler's business (HPA: a tolerance and a stabilization window).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from deepserve.router.replica import Replica

KV_TARGET = 0.8


def load_signal(replicas: list[Replica], target_ttft_s: float | None) -> float:
    """The worst signal over the replicas (1.0: as loaded as wanted), 0.0 without any report."""
    reports = [r.report for r in replicas if r.report is not None]
    if not reports:
        return 0.0
    running = sum(report.running for report in reports)
    waiting = sum(report.waiting for report in reports)
    signals = [sum(report.kv_usage for report in reports) / len(reports) / KV_TARGET]
    if waiting > 0:
        signals.append(1.0 + waiting / max(running, 1.0))
    ttfts = [r.recent_ttft_s for r in replicas if r.recent_ttft_s is not None]
    if target_ttft_s is not None and ttfts:
        signals.append(sum(ttfts) / len(ttfts) / target_ttft_s)
    return max(signals)


def desired_replicas(replicas: Iterable[Replica], target_ttft_ms: float | None, minimum: int = 1,
                     maximum: int | None = None) -> int:
    serving = [r for r in replicas if r.healthy and not r.removed]
    if not serving:
        desired = minimum
    else:
        target_s = target_ttft_ms / 1000.0 if target_ttft_ms is not None else None
        desired = math.ceil(len(serving) * load_signal(serving, target_s) - 1e-9)
    desired = max(minimum, desired)
    return min(desired, maximum) if maximum is not None else desired
