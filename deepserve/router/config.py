"""RouterConfig: every knob of the router, validated once, with the defaults the flags show.

Light (standard library only): the CLI's parser and the tests build it without loading the serving stack.
"""

from __future__ import annotations

from dataclasses import dataclass, field

POLICIES = ("cache_aware", "least_load", "power_of_two", "round_robin")


@dataclass
class CacheAwareSettings:
    # A request goes to the replica holding its longest prefix when at least this fraction of its text
    # matched; below it, the match is too weak to be worth a busier replica.
    cache_threshold: float = 0.3
    # Loads are imbalanced iff max - min > balance_abs AND max > balance_rel * min (sgl-router's test; the
    # current sgl / vllm-router defaults are 0.3 / 64 / 1.5; 32 suits the smaller fleets of one host).
    balance_abs: int = 32
    balance_rel: float = 1.5
    # Size of each replica's share of the approximate tree, in characters; past it, least recently used
    # prefixes are forgotten (the replica's own cache will have evicted them too).
    max_chars_per_replica: int = 1 << 22

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs < 0:
            raise ValueError(f"balance_abs must be >= 0, got {self.balance_abs}")
        if self.balance_rel < 1.0:
            raise ValueError(f"balance_rel must be >= 1, got {self.balance_rel}")
        if self.max_chars_per_replica < 1:
            raise ValueError(f"max_chars_per_replica must be >= 1, got {self.max_chars_per_replica}")


@dataclass
class RouterConfig:
    replicas: list[str] = field(default_factory=list)     # static URLs (--replica)
    replicas_file: str | None = None                      # re-read on change or SIGHUP
    # Prefill/decode disaggregation (router/pd.py): these compute prompts into the shared KV store first; the
    # replicas above then decode. Empty: every replica does both.
    prefill_replicas: list[str] = field(default_factory=list)
    prefill_timeout_s: float = 300.0
    policy: str = "cache_aware"
    cache_aware: CacheAwareSettings = field(default_factory=CacheAwareSettings)
    api_keys: list[str] = field(default_factory=list)     # empty: no authentication
    rate_limit: float | None = None                       # requests per second per key (or client address)
    max_body_bytes: int = 4 * 1024 * 1024
    # Health: a probe of GET /health every interval; `unhealthy_after` failed probes in a row take a replica out
    # (a refused connection on a request takes it out at once); one good probe brings it back.
    health_interval_s: float = 2.0
    health_timeout_s: float = 2.0
    unhealthy_after: int = 2
    load_reports: bool = True                             # also read each replica's /metrics at every probe
    # Retries of a request not yet streamed: at most max_retries more attempts, each after a backoff of
    # retry_backoff_s * 2**(k-1) (jittered, capped at 2 s).
    max_retries: int = 2
    retry_backoff_s: float = 0.05
    # How long a request waits for a replica to become eligible when none is, before a 503.
    wait_for_replica_s: float = 10.0
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 600.0                         # idle time between two bytes of a replica's answer
    # Circuit breaker: after `breaker_failures` failed requests in a row a replica gets no traffic for
    # breaker_cooldown_s (doubling on each failed trial, up to 16x); then one trial request decides.
    breaker_failures: int = 5
    breaker_cooldown_s: float = 5.0
    # Autoscaling gauge: the desired replica count, from TTFT against this target, queue depth and KV usage.
    autoscale_target_ttft_ms: float | None = None
    autoscale_min: int = 1
    autoscale_max: int | None = None
    seed: int | None = None                               # power_of_two's random choices (tests fix it)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not self.replicas and not self.replicas_file:
            raise ValueError("give at least one --replica URL or a --replicas-file")
        positive = {"health_interval_s": self.health_interval_s, "health_timeout_s": self.health_timeout_s,
                    "connect_timeout_s": self.connect_timeout_s, "read_timeout_s": self.read_timeout_s,
                    "breaker_cooldown_s": self.breaker_cooldown_s, "max_body_bytes": self.max_body_bytes}
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        at_least_one = {"unhealthy_after": self.unhealthy_after, "breaker_failures": self.breaker_failures,
                        "autoscale_min": self.autoscale_min}
        for name, value in at_least_one.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        for name, value in {"max_retries": self.max_retries, "retry_backoff_s": self.retry_backoff_s,
                            "wait_for_replica_s": self.wait_for_replica_s}.items():
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.rate_limit is not None and self.rate_limit <= 0:
            raise ValueError(f"rate_limit must be > 0 requests/s, got {self.rate_limit}")
        if any(not key for key in self.api_keys):
            raise ValueError("an API key must not be empty")
        if self.autoscale_max is not None and self.autoscale_max < self.autoscale_min:
            raise ValueError(f"autoscale_max ({self.autoscale_max}) < autoscale_min ({self.autoscale_min})")
        if self.autoscale_target_ttft_ms is not None and self.autoscale_target_ttft_ms <= 0:
            raise ValueError(f"autoscale_target_ttft_ms must be > 0, got {self.autoscale_target_ttft_ms}")
