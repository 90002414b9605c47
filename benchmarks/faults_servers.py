"""The fault suite's processes: simulated SGLang servers that can be killed and restarted on their port, and
sglang-router (PyPI `sglang-router` 0.3.2, as slime runs it) in front of them.

    with SimProcess(SimConfig(max_running=16)) as server:     # python -m benchmarks.simserver on a free port
        server.kill()                                         # SIGKILL: requests in flight see the connection drop
        server.start()                                        # the same port again, a fresh server
    with RouterProcess([a.url, b.url]) as router:             # policy consistent_hashing, health checks every second
        ... router.url ...

Every process runs in a process group of its own, logging to a file, and is stopped with SIGTERM, then SIGKILL.
Readiness is polled (a starting process sends no event), bounded by `startup_timeout_s`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import httpx

from benchmarks.simserver import SimConfig

REPO = Path(__file__).resolve().parents[1]
POLL_S = 0.05
ROUTER_LAUNCH = (
    "import sys\n"
    "from sglang_router.launch_router import launch_router, parse_router_args\n"
    "args = parse_router_args(sys.argv[2:])\n"
    "args.policy = sys.argv[1]\n"
    "launch_router(args)\n"
)  # 0.3.2's --policy choices omit consistent_hashing: it is set on the parsed RouterArgs, as slime does


class ProcessUnavailable(RuntimeError):
    """A server or router that did not come up; the message has the tail of its log."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Process:
    what = "process"
    startup_timeout_s = 60.0

    def __init__(self, log_path: Path):
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def is_ready(self, client: httpx.Client) -> bool:
        raise NotImplementedError

    @property
    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("a") as log:
            self.process = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True
            )
        deadline = time.monotonic() + self.startup_timeout_s
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise ProcessUnavailable(f"{self.what} exited with {self.process.returncode}:\n{self.log_tail()}")
                try:
                    if self.is_ready(client):
                        return self
                except httpx.TransportError:
                    pass
                time.sleep(POLL_S)
        self.stop()
        raise ProcessUnavailable(f"{self.what} not ready after {self.startup_timeout_s:.0f} s:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL, no goodbye: connections drop, nothing is flushed."""
        if self.is_running:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def stop(self, grace_s: float = 10.0) -> None:
        if not self.is_running:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SimProcess(_Process):
    """`python -m benchmarks.simserver` on one port for its whole life: `kill()` then `start()` restarts it there."""

    what = "simulated SGLang server"
    startup_timeout_s = 30.0

    def __init__(self, config: SimConfig, *, port: int | None = None, log_path: Path | None = None):
        self.config = config
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__(log_path or Path(tempfile.gettempdir()) / f"turnstile-simserver-{self.port}.log")

    def command(self) -> list[str]:
        flags = []
        for name, value in asdict(self.config).items():
            flag = "--" + name.replace("_", "-")
            flags += [flag if value else "--no-" + flag[2:]] if isinstance(value, bool) else [flag, str(value)]
        return [sys.executable, "-m", "benchmarks.simserver", "--port", str(self.port), *flags]

    def is_ready(self, client: httpx.Client) -> bool:
        return client.get(f"{self.url}/health").status_code == 200


class RouterProcess(_Process):
    """sglang-router in front of `worker_urls`. Health checks every `health_interval_s` with one failure marking a
    worker unhealthy, so a dead worker leaves the ring quickly; the router's own retries are on (its default)."""

    what = "sglang-router"

    def __init__(
        self,
        worker_urls: Sequence[str],
        *,
        policy: str = "consistent_hashing",
        health_interval_s: int = 1,
        log_path: Path | None = None,
        extra: Sequence[str] = (),
    ):
        self.worker_urls, self.policy, self.health_interval_s = list(worker_urls), policy, health_interval_s
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.extra = tuple(extra)
        super().__init__(log_path or Path(tempfile.gettempdir()) / f"turnstile-router-{self.port}.log")

    def command(self) -> list[str]:
        return [
            sys.executable, "-c", ROUTER_LAUNCH, self.policy, "--host", "127.0.0.1", "--port", str(self.port),
            "--worker-urls", *self.worker_urls,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--health-check-interval-secs", str(self.health_interval_s), "--health-failure-threshold", "1",
            "--health-check-timeout-secs", "1", "--shutdown-grace-period-secs", "1", "--log-level", "warn",
            *self.extra,
        ]  # fmt: skip

    def is_ready(self, client: httpx.Client) -> bool:
        response = client.get(f"{self.url}/readiness")
        return response.status_code == 200 and response.json().get("healthy_workers") == len(self.worker_urls)

    def healthy_workers(self) -> list[str]:
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            workers = client.get(f"{self.url}/workers").json().get("workers", [])
        return [w["url"] for w in workers if w.get("is_healthy")]


def router_available() -> str | None:
    """None when sglang-router can be imported here, else why not."""
    import importlib.util

    if importlib.util.find_spec("sglang_router") is None:
        return f"sglang-router is not installed in {sys.prefix} (`pip install -e '.[dev]'` installs 0.3.2)"
    return None
