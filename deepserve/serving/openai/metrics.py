"""Prometheus metrics with vLLM's names under the `deepserve:` prefix.

Two sources:
- engine state (requests running / waiting, KV usage, prefix-cache and token counters, preemptions,
  spec-decode counters) is read at scrape time from the AsyncLLMEngine's stats snapshot, so the
  exported counters are exactly the engine's own;
- per-request latencies (TTFT, inter-token, end-to-end, queue time) and per-request token counts are
  observed on the engine thread after each step (`StepObserver`), when the times are known precisely.

Each server owns its registry (no process-global state), so several servers can live in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from deepserve.engine.engine import EngineStats
from deepserve.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets (seconds), so dashboards built for vLLM read these the same way.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                            120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)

# EngineStats field -> (exported counter name without `_total`, help). The spec-decode counters stay 0 without
# speculative decoding; verified tokens / steps is the query rows a decode step verified on average.
_ENGINE_COUNTERS = {
    "prefix_cache_queries": ("deepserve:prefix_cache_queries", "Prefix cache queries, in tokens."),
    "prefix_cache_hits": ("deepserve:prefix_cache_hits", "Prefix cache hits, in tokens."),
    "num_preemptions": ("deepserve:num_preemptions", "Cumulative number of preemptions."),
    "prompt_tokens": ("deepserve:prompt_tokens", "Prompt tokens computed (prefix-cache hits excluded)."),
    "spec_decode_num_drafts": ("deepserve:spec_decode_num_drafts", "Sequence-steps that verified drafts."),
    "spec_decode_num_draft_tokens": ("deepserve:spec_decode_num_draft_tokens", "Draft tokens verified."),
    "spec_decode_num_accepted_tokens": ("deepserve:spec_decode_num_accepted_tokens", "Draft tokens accepted."),
    "spec_decode_num_steps": ("deepserve:spec_decode_num_steps", "Decode steps taken with speculation on."),
    "spec_decode_num_verified_tokens": ("deepserve:spec_decode_num_verified_tokens",
                                        "Query rows of decoding sequences (1 + drafts verified, each)."),
}


@dataclass
class _RequestProgress:
    num_tokens: int = 0
    last_token_time: float | None = None


class ServerMetrics:
    """The server's Prometheus registry; also the engine loop's StepObserver."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self._stats_source: Callable[[], EngineStats] | None = None
        self._progress: dict[str, _RequestProgress] = {}    # touched only on the engine thread
        self.ttft = self._histogram("time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.inter_token = self._histogram("inter_token_latency_seconds", "Time between two output steps of a "
                                           "request.", _ITL_BUCKETS)
        self.e2e = self._histogram("e2e_request_latency_seconds", "End-to-end request latency.",
                                   _REQUEST_LATENCY_BUCKETS)
        self.queue_time = self._histogram("request_queue_time_seconds", "Time from arrival to first scheduling.",
                                          _REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = self._histogram("request_prompt_tokens", "Prompt tokens of finished "
                                                     "requests.", _TOKEN_COUNT_BUCKETS)
        self.request_generation_tokens = self._histogram("request_generation_tokens", "Generated tokens of "
                                                         "finished requests (all n outputs).", _TOKEN_COUNT_BUCKETS)
        # Counted here from the outputs (every new token id of every sequence), not taken from the engine.
        self.generated_tokens = Counter("deepserve:generation_tokens", "Generated tokens.", ["model_name"],
                                        registry=self.registry).labels(model_name)
        self._success = Counter("deepserve:request_success", "Finished requests, by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self._rejected = Counter("deepserve:request_rejected", "HTTP requests refused (4xx, 503), by HTTP "
                                 "status.", ["model_name", "status"], registry=self.registry)
        self.registry.register(_EngineStatsCollector(model_name, self._current_stats))

    def _histogram(self, name: str, help_text: str, buckets: tuple[float, ...]):
        return Histogram(f"deepserve:{name}", help_text, ["model_name"], buckets=buckets,
                         registry=self.registry).labels(self.model_name)

    def watch(self, engine) -> None:
        """Read engine gauges and counters from `engine.stats` (an AsyncLLMEngine) at scrape time."""
        self._stats_source = lambda: engine.stats

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def count_rejected(self, status: int) -> None:
        self._rejected.labels(self.model_name, str(status)).inc()

    # --- StepObserver (engine thread) ----------------------------------------------------------
    def on_step(self, outputs: list[RequestOutput], stats: EngineStats, now: float) -> None:
        for output in outputs:
            progress = self._progress.setdefault(output.request_id, _RequestProgress())
            num_tokens = sum(len(c.token_ids) for c in output.outputs)
            if num_tokens > progress.num_tokens:
                self.generated_tokens.inc(num_tokens - progress.num_tokens)
                if progress.last_token_time is None:
                    self.ttft.observe(now - output.metrics.arrival_time)
                else:
                    self.inter_token.observe(now - progress.last_token_time)
                progress.num_tokens, progress.last_token_time = num_tokens, now
            if output.finished:
                self._on_finished(output, now)

    def on_abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._progress.pop(request_id, None)

    def _on_finished(self, output: RequestOutput, now: float) -> None:
        del self._progress[output.request_id]
        m = output.metrics
        self.e2e.observe((m.finished_time or now) - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
        self.request_prompt_tokens.observe(len(output.prompt_token_ids))
        self.request_generation_tokens.observe(sum(len(c.token_ids) for c in output.outputs))
        reason = output.outputs[0].finish_reason if output.outputs else None
        self._success.labels(self.model_name, "error" if output.error else (reason or "unknown")).inc()

    def _current_stats(self) -> EngineStats | None:
        return self._stats_source() if self._stats_source is not None else None


class _EngineStatsCollector(Collector):
    def __init__(self, model_name: str, stats: Callable[[], EngineStats | None]) -> None:
        self.model_name = model_name
        self.stats = stats

    def collect(self) -> Iterable[Metric]:
        stats = self.stats()
        if stats is None:
            return
        yield self._gauge("deepserve:num_requests_running", "Sequences running (scheduled in the last step).",
                          stats.num_running)
        yield self._gauge("deepserve:num_requests_waiting", "Sequences waiting to be scheduled.",
                          stats.num_waiting)
        yield self._gauge("deepserve:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
                          stats.kv_cache_usage)
        yield self._gauge("deepserve:kv_cache_free_blocks", "KV-cache blocks free (cached ones included).",
                          stats.num_free_blocks)
        yield self._gauge("deepserve:kv_cache_total_blocks", "KV-cache blocks in all.", stats.num_blocks)
        for field_name, (name, help_text) in _ENGINE_COUNTERS.items():
            family = CounterMetricFamily(name, help_text, labels=["model_name"])
            family.add_metric([self.model_name], float(getattr(stats, field_name, 0)))
            yield family
        if getattr(stats, "kv_store", None):
            yield from kv_store_metrics(self.model_name, stats.kv_store)
        if getattr(stats, "moe_lb", None) is not None:     # expert parallelism only
            yield self._gauge("deepserve:moe_lb", "Expert-parallel balance: sum over steps of the busiest EP rank's "
                              "routed tokens / the mean rank's (1 = even), over the EPLB window.", stats.moe_lb)
            family = CounterMetricFamily("deepserve:eplb_rebalances", "Expert rebalancings done.",
                                         labels=["model_name"])
            family.add_metric([self.model_name], float(stats.num_eplb_rebalances))
            yield family

    def _gauge(self, name: str, help_text: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, help_text, labels=["model_name"])
        family.add_metric([self.model_name], float(value))
        return family


# KVStoreConnector.metrics() per-tier fields -> (metric, help, counter?)
_KV_STORE_TIER_FIELDS = {
    "hits": ("deepserve:kv_store_hits", "KV store blocks loaded, by tier.", True),
    "misses": ("deepserve:kv_store_misses", "KV store lookups a tier did not hold, by tier.", True),
    "bytes_read": ("deepserve:kv_store_read_bytes", "KV store bytes loaded, by tier.", True),
    "bytes_written": ("deepserve:kv_store_written_bytes", "KV store bytes saved, by tier.", True),
    "checksum_failures": ("deepserve:kv_store_checksum_failures", "Corrupt or truncated entries (recomputed).", True),
    "evictions": ("deepserve:kv_store_evictions", "Entries evicted by a tier's size bound.", True),
    "errors": ("deepserve:kv_store_errors", "Failed tier operations (e.g. Redis gone), by tier.", True),
    "used_bytes": ("deepserve:kv_store_used_bytes", "Bytes a tier holds.", False),
}


def kv_store_metrics(model_name: str, m: dict) -> Iterable[Metric]:
    """Prometheus families for the KV store's metrics (`EngineStats.kv_store`)."""
    for key, (name, help_text, is_counter) in _KV_STORE_TIER_FIELDS.items():
        family = (CounterMetricFamily if is_counter else GaugeMetricFamily)(name, help_text,
                                                                            labels=["model_name", "tier"])
        for tier, values in m["tiers"].items():
            family.add_metric([model_name, tier], float(values.get(key, 0)))
        yield family
    for which, done in (("save", "saved"), ("load", "loaded")):
        latency = m[f"{which}_latency"]
        family = CounterMetricFamily(f"deepserve:kv_store_{which}_seconds", f"Time spent on KV store block {which}s "
                                     f"(and how many: _count).", labels=["model_name"])
        family.add_metric([model_name], latency["total_s"])
        yield family
        count = CounterMetricFamily(f"deepserve:kv_store_{which}_blocks", f"KV store blocks {done}, timed.",
                                    labels=["model_name"])
        count.add_metric([model_name], float(latency["count"]))
        yield count
    for key, (name, help_text) in _KV_STORE_LOAD_TIMES.items():
        if key in m:                    # the engine's connector adds them; a bare store has none
            family = CounterMetricFamily(name, help_text, labels=["model_name"])
            family.add_metric([model_name], float(m[key]))
            yield family


# KVStoreConnector.metrics() load times: the engine thread's vs the fetch threads'
_KV_STORE_LOAD_TIMES = {
    "admission_load_s": ("deepserve:kv_store_admission_load_seconds",
                         "Engine-thread time on KV store loads (starting fetches, copying fetched blocks in)."),
    "fetch_s": ("deepserve:kv_store_fetch_seconds",
                "Background time fetching KV store blocks (lookup, read, decode, checksum)."),
}
