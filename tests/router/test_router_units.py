"""The router's small parts: circuit breaker, routing keys, SSE framing, load reports, the autoscaling signal,
config validation, the replicas file, the CLI flags."""

from __future__ import annotations

import json

import pytest

from deepserve.cli import build_parser
from deepserve.router.autoscale import desired_replicas
from deepserve.router.circuit_breaker import CircuitBreaker
from deepserve.router.config import RouterConfig
from deepserve.router.load_report import LoadReport, parse_load_report, recent_ttft_s
from deepserve.router.options import router_config
from deepserve.router.replica import Replica
from deepserve.router.replica_set import ReplicaSet, normalize_url, read_replicas_file
from deepserve.router.routing_key import routed_request
from deepserve.router.sse import SseFramer, TruncatedStream, sse_events


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# --- circuit breaker ---------------------------------------------------------------------------------
def test_breaker_opens_after_consecutive_failures_and_half_opens_for_one_trial():
    clock = Clock()
    breaker = CircuitBreaker(failures=3, cooldown_s=10, clock=clock)
    breaker.on_failure()
    breaker.on_failure()
    breaker.on_success()                       # the run of failures is broken
    for _ in range(2):
        breaker.on_failure()
    assert breaker.state == "closed" and breaker.allows()
    breaker.on_failure()
    assert breaker.state == "open" and not breaker.allows()
    clock.now += 10
    assert breaker.state == "half_open" and breaker.allows()
    breaker.on_dispatch()                      # the trial is out: nobody else
    assert not breaker.allows()
    breaker.on_failure()                       # trial failed: open again, twice as long
    assert breaker.state == "open" and breaker.cooldown_s == 20
    clock.now += 20
    breaker.on_dispatch()
    breaker.on_success()
    assert breaker.state == "closed" and breaker.cooldown_s == 10


def test_breaker_cooldown_is_capped():
    clock = Clock()
    breaker = CircuitBreaker(failures=1, cooldown_s=1, clock=clock)
    breaker.on_failure()
    for _ in range(10):
        clock.now += breaker.cooldown_s
        breaker.on_dispatch()
        breaker.on_failure()
    assert breaker.cooldown_s == 16


# --- routing keys ------------------------------------------------------------------------------------
def test_routing_key_of_completions_and_chat():
    r = routed_request("/v1/completions", json.dumps({"prompt": "abc", "max_tokens": 10, "stream": True}).encode())
    assert (r.text, r.stream, r.tokens) == ("abc", True, 10)
    r = routed_request("/v1/completions", json.dumps({"prompt": [[1, 2, 3]]}).encode())
    assert r.text == "1,2,3," and not r.stream
    chat = {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    r = routed_request("/v1/chat/completions", json.dumps(chat).encode())
    assert r.text == "<system>be brief<user>hi"
    longer = {"messages": chat["messages"] + [{"role": "assistant", "content": "hello"}]}
    assert routed_request("/v1/chat/completions", json.dumps(longer).encode()).text.startswith(r.text)


def test_routing_key_of_a_bad_body_is_its_text_and_still_forwarded():
    r = routed_request("/v1/completions", b"{not json")
    assert r.body == b"{not json" and r.text == "{not json" and not r.stream


# --- SSE ---------------------------------------------------------------------------------------------
def test_sse_framer_cuts_at_event_boundaries():
    framer = SseFramer()
    assert framer.feed(b"data: 1\n\nda") == [b"data: 1\n\n"]
    assert framer.feed(b"ta: 2\n") == []
    assert framer.feed(b"\ndata: [DONE]\r\n\r\n") == [b"data: 2\n\n", b"data: [DONE]\r\n\r\n"]
    assert framer.pending == b""


async def _chunks(*parts: bytes):
    for part in parts:
        yield part


async def _collect(raw):
    return [event async for event in sse_events(raw)]


def test_sse_events_require_the_done_event():
    import asyncio
    assert asyncio.run(_collect(_chunks(b"data: 1\n\ndata: [DO", b"NE]\n\n"))) == [b"data: 1\n\n", b"data: [DONE]\n\n"]
    with pytest.raises(TruncatedStream):
        asyncio.run(_collect(_chunks(b"data: 1\n\ndata: 2")))


# --- load reports and autoscaling --------------------------------------------------------------------
SERVER_METRICS = """# HELP deepserve:num_requests_running Sequences running.
deepserve:num_requests_running{model_name="m"} 3.0
deepserve:num_requests_waiting{model_name="m"} 2.0
deepserve:kv_cache_usage_perc{model_name="m"} 0.5
deepserve:prefix_cache_hits_total{model_name="m"} 40.0
deepserve:prefix_cache_queries_total{model_name="m"} 100.0
deepserve:time_to_first_token_seconds_sum{model_name="m"} 2.0
deepserve:time_to_first_token_seconds_count{model_name="m"} 4.0
deepserve:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 1.0
"""


def test_load_report_from_the_servers_metrics():
    report = parse_load_report(SERVER_METRICS)
    assert report == LoadReport(running=3, waiting=2, kv_usage=0.5, prefix_queries=100, prefix_hits=40,
                                ttft_sum_s=2.0, ttft_count=4)
    assert report.requests == 5
    assert parse_load_report("other_metric 1\n") is None
    later = LoadReport(ttft_sum_s=5.0, ttft_count=6)
    assert recent_ttft_s(report, later) == pytest.approx(1.5)      # 3 s over the 2 new requests
    assert recent_ttft_s(later, later) is None


def fleet(*reports: LoadReport, ttft: float | None = None) -> list[Replica]:
    out = []
    for report in reports:
        replica = Replica("http://x:1", CircuitBreaker())
        replica.healthy, replica.report, replica.recent_ttft_s = True, report, ttft
        out.append(replica)
    return out


def test_desired_replicas_follows_the_worst_signal():
    idle = fleet(LoadReport(), LoadReport(), LoadReport())
    assert desired_replicas(idle, None, minimum=1) == 1
    queued = fleet(LoadReport(running=4, waiting=4), LoadReport(running=4, waiting=4))
    assert desired_replicas(queued, None, minimum=1, maximum=8) == 4          # 2 x (1 + 8/8)
    assert desired_replicas(queued, None, minimum=1, maximum=3) == 3
    slow = fleet(LoadReport(running=1), LoadReport(running=1), ttft=0.9)
    assert desired_replicas(slow, 300.0) == 6                                   # 2 x 900/300
    full_kv = fleet(LoadReport(kv_usage=1.0))
    assert desired_replicas(full_kv, None) == 2                                 # 1 x 1.0 / 0.8, rounded up
    assert desired_replicas([], None, minimum=2) == 2


# --- config, replicas file, flags --------------------------------------------------------------------
@pytest.mark.parametrize("bad", [{"policy": "random"}, {"replicas": []}, {"max_retries": -1},
                                 {"health_interval_s": 0}, {"rate_limit": 0}, {"api_keys": [""]},
                                 {"autoscale_min": 3, "autoscale_max": 2}])
def test_router_config_is_validated(bad):
    with pytest.raises(ValueError):
        RouterConfig(**{"replicas": ["http://a:1"], **bad})


def test_replica_urls_are_normalized():
    assert normalize_url("127.0.0.1:8001/") == "http://127.0.0.1:8001"
    assert normalize_url("https://h.example:443") == "https://h.example:443"
    for bad in ("ftp://x:1", "http://:80", "http://h:notaport"):
        with pytest.raises(ValueError):
            normalize_url(bad)


def test_replicas_file_and_reload(tmp_path):
    path = tmp_path / "replicas"
    path.write_text("# the fleet\nhttp://a:1\n\nb:2  # second\n")
    assert read_replicas_file(str(path)) == ["http://a:1", "http://b:2"]
    removed = []
    replica_set = ReplicaSet(["http://static:9"], str(path), CircuitBreaker)
    replica_set.on_removed.append(removed.append)
    assert sorted(r.url for r in replica_set) == ["http://a:1", "http://b:2", "http://static:9"]
    a = replica_set.get("http://a:1")
    path.write_text("http://a:1\nhttp://c:3\n")
    replica_set.reload_if_changed()
    assert sorted(r.url for r in replica_set) == ["http://a:1", "http://c:3", "http://static:9"]
    assert replica_set.get("http://a:1") is a                      # kept, with its state
    assert [r.url for r in removed] == ["http://b:2"] and removed[0].removed
    path.write_text("not a url:xx\n")
    assert not replica_set.reload()                                 # a bad file keeps the current set
    assert len(replica_set) == 3
    with pytest.raises(FileNotFoundError):
        ReplicaSet([], str(tmp_path / "missing"), CircuitBreaker)


def test_cli_flags_make_a_router_config(tmp_path, monkeypatch):
    monkeypatch.delenv("DEEPSERVE_API_KEY", raising=False)
    keys = tmp_path / "keys"
    keys.write_text("sk-file\n")
    keys.chmod(0o600)
    args = build_parser().parse_args(["router", "--replica", "http://a:1", "--replica", "b:2", "--policy",
                                      "least_load", "--api-key-file", str(keys), "--rate-limit", "5",
                                      "--max-retries", "4", "--cache-threshold", "0.6"])
    config = router_config(args)
    assert config.replicas == ["http://a:1", "b:2"] and config.policy == "least_load"
    assert config.api_keys == ["sk-file"] and config.rate_limit == 5.0
    assert config.max_retries == 4 and config.cache_aware.cache_threshold == 0.6
    with pytest.raises(SystemExit):
        build_parser().parse_args(["router", "--replica", "http://a:1", "--policy", "random"])


# --- serve --replicas --------------------------------------------------------------------------------
def test_replica_range_flag():
    from deepserve.router.options import ReplicaRange, runs_a_cluster

    assert build_parser().parse_args(["serve", "--replicas", "3"]).replicas == ReplicaRange(3, 3)
    args = build_parser().parse_args(["serve", "--replicas", "1:4", "--router-policy", "least_load"])
    assert args.replicas == ReplicaRange(1, 4) and args.replicas.autoscales and args.router_policy == "least_load"
    assert runs_a_cluster(args) and not runs_a_cluster(build_parser().parse_args(["serve", "--replicas", "1"]))
    assert not runs_a_cluster(build_parser().parse_args(["serve"]))
    for bad in ("0", "3:2", "two", "1:"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--replicas", bad])


def test_children_get_the_serve_flags_but_not_the_clusters():
    from deepserve.router.local_cluster import child_argv

    argv = ["--replicas", "2", "--port=9000", "--max-model-len", "256", "--host", "0.0.0.0", "--api-key", "k",
            "--router-policy", "round_robin", "--seed", "1"]
    assert child_argv(argv) == ["--max-model-len", "256", "--api-key", "k", "--seed", "1"]


def test_the_cluster_scales_only_on_what_two_readings_agree_on():
    from deepserve.router.local_cluster import stabilized_target

    assert stabilized_target([3], 1) == 1                  # one reading: not yet
    assert stabilized_target([3, 3], 1) == 3
    assert stabilized_target([2, 3], 1) == 2               # up as far as both ask
    assert stabilized_target([1, 3], 2) == 2               # a blip (a request caught waiting) moves nothing
    assert stabilized_target([3, 1], 2) == 2
    assert stabilized_target([1, 1], 3) == 1
    assert stabilized_target([2, 1], 3) == 2               # down only as far as both allow


def test_the_router_never_imports_torch():
    import subprocess
    import sys

    code = ("import sys\nfrom deepserve.router.app import build_router_app\nimport deepserve.router.local_cluster\n"
            "from deepserve.cli import main\nprint('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
