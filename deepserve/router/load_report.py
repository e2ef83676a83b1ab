"""A replica's own account of its load, read from its Prometheus /metrics at each health probe.

The router's in-flight counts are exact for its own traffic but blind to anything else a replica serves
(another router, direct clients); the replica's gauges see everything but are up to one probe interval
old. Load is the larger of the two (replica.py), so neither blind spot makes a busy replica look idle.

Only the few series the router uses are kept; a replica that is not a deepserve server (no such series)
reports nothing, and the router falls back to its own counts.
"""

from __future__ import annotations

from dataclasses import dataclass

_WANTED = {
    "deepserve:num_requests_running": "running",
    "deepserve:num_requests_waiting": "waiting",
    "deepserve:kv_cache_usage_perc": "kv_usage",
    "deepserve:prefix_cache_queries_total": "prefix_queries",
    "deepserve:prefix_cache_hits_total": "prefix_hits",
    "deepserve:time_to_first_token_seconds_sum": "ttft_sum_s",
    "deepserve:time_to_first_token_seconds_count": "ttft_count",
}


@dataclass(frozen=True)
class LoadReport:
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0          # 0..1
    prefix_queries: float = 0.0    # tokens, cumulative
    prefix_hits: float = 0.0       # tokens, cumulative
    ttft_sum_s: float = 0.0        # cumulative: differences between two reports give the recent mean
    ttft_count: float = 0.0

    @property
    def requests(self) -> float:
        return self.running + self.waiting


def parse_load_report(text: str) -> LoadReport | None:
    """The report in a /metrics page (values summed over label sets), or None when it has none of the series."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        name = series.split("{", 1)[0]
        field = _WANTED.get(name)
        if field is None:
            continue
        try:
            values[field] = values.get(field, 0.0) + float(value)
        except ValueError:
            continue
    return LoadReport(**values) if values else None


def recent_ttft_s(previous: LoadReport | None, current: LoadReport) -> float | None:
    """Mean TTFT of the requests that got their first token between two reports (None if there were none)."""
    if previous is None:
        return None
    count = current.ttft_count - previous.ttft_count
    if count <= 0:
        return None
    return (current.ttft_sum_s - previous.ttft_sum_s) / count
