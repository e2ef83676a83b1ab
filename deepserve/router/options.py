"""The flags of `deepserve router` and their defaults (RouterConfig's).

Light, like serving/openai/options.py: building the CLI's parser loads neither fastapi nor httpx. The key and
rate-limit flags are the server's own (`add_access_args`), read by the server's code (keys.py).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from deepserve.router.config import POLICIES, CacheAwareSettings, RouterConfig
from deepserve.serving.openai.keys import api_keys
from deepserve.serving.openai.options import DEFAULT_MAX_BODY_BYTES, add_access_args

_DEFAULT = RouterConfig(replicas=["http://placeholder:1"])    # read for its defaults only (a config needs a replica)
_CACHE = CacheAwareSettings()


def add_router_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replica", action="append", default=[], dest="replicas", metavar="URL",
                        help="a replica's base URL, e.g. http://127.0.0.1:8001 (repeat for several)")
    parser.add_argument("--replicas-file", metavar="PATH",
                        help="more replica URLs, one per line; re-read when it changes and on SIGHUP")
    parser.add_argument("--prefill-replica", action="append", default=[], dest="prefill_replicas", metavar="URL",
                        help="a `serve --role prefill` replica: it computes each prompt into the shared KV store "
                             "before a --replica (then a decode replica) serves the request; repeat for several")
    parser.add_argument("--prefill-timeout", type=float, default=_DEFAULT.prefill_timeout_s, metavar="S",
                        help="past this a prefill is given up (the decode replica computes the prompt)")
    parser.add_argument("--policy", choices=POLICIES, default=_DEFAULT.policy)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--uvicorn-log-level", default="warning")
    access = parser.add_argument_group("access (the server's semantics)")
    add_access_args(access)
    access.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="answer 413 to larger request bodies")
    health = parser.add_argument_group("health and failover")
    health.add_argument("--health-interval", type=float, default=_DEFAULT.health_interval_s, metavar="S")
    health.add_argument("--health-timeout", type=float, default=_DEFAULT.health_timeout_s, metavar="S",
                        help="a probe slower than this fails (how a hung replica is found)")
    health.add_argument("--unhealthy-after", type=int, default=_DEFAULT.unhealthy_after, metavar="N",
                        help="failed probes in a row that take a replica out")
    health.add_argument("--no-load-reports", dest="load_reports", action="store_false",
                        help="do not read the replicas' /metrics (load from the router's own counts only)")
    health.add_argument("--max-retries", type=int, default=_DEFAULT.max_retries, metavar="N",
                        help="more attempts for a request not yet streamed")
    health.add_argument("--retry-backoff", type=float, default=_DEFAULT.retry_backoff_s, metavar="S",
                        help="backoff before the first retry (doubles, jittered, at most 2 s)")
    health.add_argument("--wait-for-replica", type=float, default=_DEFAULT.wait_for_replica_s, metavar="S",
                        help="how long a request waits for an eligible replica before a 503")
    health.add_argument("--connect-timeout", type=float, default=_DEFAULT.connect_timeout_s, metavar="S")
    health.add_argument("--read-timeout", type=float, default=_DEFAULT.read_timeout_s, metavar="S",
                        help="idle time between two bytes of a replica's answer")
    health.add_argument("--breaker-failures", type=int, default=_DEFAULT.breaker_failures, metavar="N",
                        help="failed requests in a row that open a replica's circuit")
    health.add_argument("--breaker-cooldown", type=float, default=_DEFAULT.breaker_cooldown_s, metavar="S")
    cache = parser.add_argument_group("cache_aware")
    cache.add_argument("--cache-threshold", type=float, default=_CACHE.cache_threshold, metavar="F",
                       help="matched fraction of the text that routes by prefix")
    cache.add_argument("--balance-abs-threshold", type=int, default=_CACHE.balance_abs, metavar="N")
    cache.add_argument("--balance-rel-threshold", type=float, default=_CACHE.balance_rel, metavar="F")
    cache.add_argument("--cache-max-chars", type=int, default=_CACHE.max_chars_per_replica, metavar="N",
                       help="characters remembered per replica")
    scale = parser.add_argument_group("autoscaling gauge (deepserve:router_desired_replicas)")
    scale.add_argument("--autoscale-target-ttft-ms", type=float, default=None, metavar="MS")
    scale.add_argument("--autoscale-min", type=int, default=1, metavar="N")
    scale.add_argument("--autoscale-max", type=int, default=None, metavar="N")


def router_config(args: argparse.Namespace) -> RouterConfig:
    cache = CacheAwareSettings(cache_threshold=args.cache_threshold, balance_abs=args.balance_abs_threshold,
                               balance_rel=args.balance_rel_threshold, max_chars_per_replica=args.cache_max_chars)
    return RouterConfig(
        replicas=args.replicas, replicas_file=args.replicas_file, policy=args.policy, cache_aware=cache,
        prefill_replicas=args.prefill_replicas, prefill_timeout_s=args.prefill_timeout,
        api_keys=api_keys(args), rate_limit=args.rate_limit, max_body_bytes=args.max_body_bytes,
        health_interval_s=args.health_interval, health_timeout_s=args.health_timeout,
        unhealthy_after=args.unhealthy_after, load_reports=args.load_reports, max_retries=args.max_retries,
        retry_backoff_s=args.retry_backoff, wait_for_replica_s=args.wait_for_replica,
        connect_timeout_s=args.connect_timeout, read_timeout_s=args.read_timeout,
        breaker_failures=args.breaker_failures, breaker_cooldown_s=args.breaker_cooldown,
        autoscale_target_ttft_ms=args.autoscale_target_ttft_ms, autoscale_min=args.autoscale_min,
        autoscale_max=args.autoscale_max)


@dataclass(frozen=True)
class ReplicaRange:
    """`deepserve serve --replicas N | MIN:MAX`: how many engine processes a local cluster runs."""
    minimum: int
    maximum: int

    @property
    def autoscales(self) -> bool:
        return self.maximum > self.minimum


def parse_replica_range(value: str) -> ReplicaRange:
    """`N` or `MIN:MAX` (1 <= MIN <= MAX)."""
    low, colon, high = value.partition(":")
    try:
        minimum, maximum = int(low), int(high if colon else low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX, got {value!r}") from None
    if not 1 <= minimum <= maximum:
        raise argparse.ArgumentTypeError(f"expected 1 <= MIN <= MAX, got {value!r}")
    return ReplicaRange(minimum, maximum)


def parse_pd_split(value: str) -> tuple[int, int]:
    """`P:D`: prefill and decode replica counts, each >= 1."""
    low, colon, high = value.partition(":")
    try:
        prefill, decode = int(low), int(high)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected P:D (e.g. 1:2), got {value!r}") from None
    if not colon or prefill < 1 or decode < 1:
        raise argparse.ArgumentTypeError(f"expected P:D with P, D >= 1, got {value!r}")
    return prefill, decode


def add_cluster_args(parser: argparse.ArgumentParser) -> None:
    """The flags `deepserve serve` takes to run several engines behind a router (local_cluster.py)."""
    group = parser.add_argument_group("replicas (several engine processes behind a router on --host:--port)")
    group.add_argument("--replicas", type=parse_replica_range, default=None, metavar="N|MIN:MAX",
                       help="run N engine processes (MIN:MAX: scale between them on the router's desired count)")
    group.add_argument("--pd", type=parse_pd_split, default=None, metavar="P:D",
                       help="prefill/decode disaggregation: P `--role prefill` and D `--role decode` engines sharing "
                            "--kv-store (disk or redis) behind the router (router/pd_cluster.py)")
    group.add_argument("--router-policy", choices=POLICIES, default=_DEFAULT.policy)
    group.add_argument("--autoscale-target-ttft-ms", type=float, default=None, metavar="MS",
                       help="with MIN:MAX: the time to first token the replica count aims for")


def runs_a_cluster(args: argparse.Namespace) -> bool:
    replicas = getattr(args, "replicas", None)
    return getattr(args, "pd", None) is not None or (isinstance(replicas, ReplicaRange) and replicas.maximum > 1)
