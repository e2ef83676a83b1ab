"""`deepserve serve --replicas N` (or `MIN:MAX`): N engine processes on free loopback ports and a router in front
of them on `--host:--port`, one command for a user with a big box.

The children are plain `deepserve serve` processes with the same flags (minus host, port and replicas), so
every server flag means what it means for one server. The router learns them from a replicas file this module
writes (the router re-reads it when it changes), which is what lets the supervisor change the set while the
router runs:
- a child that dies is started again on its port (the router takes it out, then probes it back);
- with MIN:MAX, every few seconds the supervisor reads the router's `deepserve:router_desired_replicas` gauge
  and adds one child (started and healthy before it is listed) or drains one: it is unlisted first, stopped
  only once the router has no request in flight on it, and stopped with SIGTERM, which drains the server too.
  So no request is lost while scaling down. It acts only on what the last two readings agree on (HPA's
  stabilization, over two readings): the gauge is a snapshot, and one request caught waiting for its first
  step reads as a full queue.

CPU threads: each child gets OMP_NUM_THREADS = cores / MAX unless the variable is set, so N engines do not
fight over the cores; on a GPU box, a CUDA_VISIBLE_DEVICES list of at least MAX devices gives one to each.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Sequence

import httpx

from deepserve.router.config import RouterConfig
from deepserve.router.options import ReplicaRange
from deepserve.router.server import serve_router
from deepserve.serving.openai.keys import api_keys

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0          # a big model loads for minutes
STOP_TIMEOUT_S = 60.0
SUPERVISE_INTERVAL_S = 1.0
SCALE_INTERVAL_S = 5.0
STABILIZE_READINGS = 2           # readings of the desired count, SCALE_INTERVAL_S apart, that a change must hold for
_STRIPPED_FLAGS = ("--replicas", "--port", "--host", "--router-policy")


def child_argv(serve_argv: list[str]) -> list[str]:
    """The `serve` flags without the ones the cluster sets itself (host, port, replicas, router policy)."""
    out, skip = [], False
    for arg in serve_argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in _STRIPPED_FLAGS:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class EngineProcess:
    """One `deepserve serve` child on a loopback port."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = argv
        self.env = env
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        command = [sys.executable, "-m", "deepserve.cli", "serve", *self.argv, "--host", "127.0.0.1",
                   "--port", str(self.port)]
        self.proc = subprocess.Popen(command, env=self.env)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_healthy(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"replica on port {self.port} exited with {self.proc.returncode} while starting")
            if self.healthy():
                return
            time.sleep(0.5)
        raise TimeoutError(f"replica on port {self.port} not healthy after {timeout_s:.0f} s")

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        if not self.alive():
            return
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)          # the server drains its requests, then exits
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


class LocalCluster:
    def __init__(self, argv: list[str], replicas: ReplicaRange, router_url: str, replicas_file: str) -> None:
        self.argv = argv
        self.range = replicas
        self.router_url = router_url
        self.replicas_file = replicas_file
        self.engines: list[EngineProcess] = []
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._devices = _device_list(replicas.maximum)
        self._readings: deque[int] = deque(maxlen=STABILIZE_READINGS)

    # --- membership ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start MIN engines together and wait until all are healthy, then list them."""
        fresh = [self._new_engine() for _ in range(self.range.minimum)]
        for engine in fresh:
            engine.start()
        for engine in fresh:
            engine.wait_healthy()
        with self._lock:
            self.engines.extend(fresh)
            self._write_file()

    def _new_engine(self) -> EngineProcess:
        env = dict(os.environ)
        if "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.range.maximum))
        used = {e.env.get("CUDA_VISIBLE_DEVICES") for e in self.engines}
        free = [d for d in self._devices if d not in used]
        if free:
            env["CUDA_VISIBLE_DEVICES"] = free[0]
        return EngineProcess(self.argv, env)

    def _write_file(self) -> None:
        # Written whole and renamed over the old one, so the router never reads half a file.
        tmp = self.replicas_file + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("".join(f"{e.url}\n" for e in self.engines))
        os.replace(tmp, self.replicas_file)

    # --- supervision -----------------------------------------------------------------------------
    def supervise(self) -> None:
        """Restart dead engines; with MIN:MAX, follow the router's desired count. Runs until stop()."""
        last_scale = time.monotonic()
        while not self._stopping.wait(SUPERVISE_INTERVAL_S):
            self._restart_dead()
            if self.range.autoscales and time.monotonic() - last_scale >= SCALE_INTERVAL_S:
                last_scale = time.monotonic()
                self._scale_once()

    def _restart_dead(self) -> None:
        for engine in list(self.engines):
            if not engine.alive() and not self._stopping.is_set():
                logger.warning("replica on port %d exited (%s): starting it again", engine.port,
                               engine.proc.returncode if engine.proc else None)
                engine.start()            # same port: the router probes it back once it is up

    def _scale_once(self) -> None:
        desired = self._desired()
        if desired is None:
            return
        self._readings.append(desired)
        count = len(self.engines)
        target = stabilized_target(self._readings, count)
        if target > count and count < self.range.maximum:
            self._add_one()
        elif target < count and count > self.range.minimum:
            self._drain_one()

    def _desired(self) -> int | None:
        try:
            text = httpx.get(self.router_url + "/metrics", timeout=5, trust_env=False).text
        except httpx.HTTPError:
            return None
        for line in text.splitlines():
            if line.startswith("deepserve:router_desired_replicas "):
                return math.ceil(float(line.rsplit(" ", 1)[1]))
        return None

    def _add_one(self) -> None:
        engine = self._new_engine()
        engine.start()
        try:
            engine.wait_healthy()
        except (RuntimeError, TimeoutError) as error:
            logger.warning("scaling up failed: %s", error)
            engine.stop()
            return
        with self._lock:
            self.engines.append(engine)
            self._write_file()
        logger.warning("scaled up to %d replicas", len(self.engines))

    def _drain_one(self) -> None:
        with self._lock:
            engine = self.engines.pop()
            self._write_file()        # unlisted: the router sends it nothing new
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while time.monotonic() < deadline and self._router_holds(engine.url):
            time.sleep(0.5)
        engine.stop()
        logger.warning("scaled down to %d replicas", len(self.engines))

    def _router_holds(self, url: str) -> bool:
        """Whether the router may still send to `url` (it has not re-read the file yet: up to a health interval)
        or still has requests in flight there (a removed replica is listed until its last one ends)."""
        try:
            replicas = httpx.get(self.router_url + "/router/replicas", timeout=5, trust_env=False).json()["replicas"]
        except (httpx.HTTPError, ValueError, KeyError):
            return False
        return any(r["url"] == url and (not r["removed"] or r["in_flight"] > 0) for r in replicas)

    def stop(self) -> None:
        self._stopping.set()
        for engine in self.engines:
            engine.stop()


def stabilized_target(readings: Sequence[int], current: int) -> int:
    """The count to move towards: up only as far as every recent reading asks, down only as far as every one
    allows (HPA's stabilization window); `current` until there are STABILIZE_READINGS readings."""
    if len(readings) < STABILIZE_READINGS:
        return current
    low, high = min(readings), max(readings)
    if low > current:
        return low
    if high < current:
        return high
    return current


def _device_list(count: int) -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    devices = [d.strip() for d in visible.split(",") if d.strip()]
    return devices if len(devices) >= count else []


def run_local_cluster(args: argparse.Namespace, serve_argv: list[str]) -> int:
    replicas: ReplicaRange = args.replicas
    with tempfile.TemporaryDirectory(prefix="deepserve-cluster-") as tmp:
        router_url = f"http://127.0.0.1:{args.port}"
        cluster = LocalCluster(child_argv(serve_argv), replicas, router_url, os.path.join(tmp, "replicas"))
        try:
            cluster.start()
            config = RouterConfig(replicas_file=cluster.replicas_file, policy=args.router_policy,
                                  api_keys=api_keys(args), rate_limit=args.rate_limit,
                                  max_body_bytes=args.max_body_bytes, autoscale_min=replicas.minimum,
                                  autoscale_max=replicas.maximum,
                                  autoscale_target_ttft_ms=args.autoscale_target_ttft_ms)
            supervisor = threading.Thread(target=cluster.supervise, name="replica-supervisor", daemon=True)
            supervisor.start()
            logger.warning("%d replica(s) up: %s", len(cluster.engines), ", ".join(e.url for e in cluster.engines))
            return serve_router(config, args.host, args.port, args.uvicorn_log_level, args.drain_timeout)
        finally:
            cluster.stop()
