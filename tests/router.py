"""TEST INFRASTRUCTURE: a real sglang-router (PyPI `sglang-router`, the Rust gateway slime runs in front of its
SGLang engines) in front of given workers, on a free loopback port.

    with SGLangRouter([a.url, b.url]) as router:                  # policy consistent_hashing
        ... router.url ...
        router.add_worker(c.url)                                  # registered and healthy when it returns
    with SGLangRouter(urls, wait_for_workers=False) as router:    # workers down: ready once it listens

It runs from this venv's `sglang_router` package, in its own process group, logging to `log_path`. It is
ready when GET /readiness answers 200 with every given worker healthy (the router registers workers in the
background), or, with `wait_for_workers=False`, when GET /liveness answers 200. Startup is bounded; a router
that exits or never gets ready raises RouterUnavailable with the tail of its log.

sglang-router 0.3.2's `--policy` choices (random, round_robin, cache_aware, power_of_two, manual) omit
policies its Rust router has (consistent_hashing, prefix_hash, bucket), so the launcher below parses the
command line and sets the policy afterwards, as slime does when it builds RouterArgs itself.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx2

from tests.net import free_port
from tests.processes import ServerProcess

ROUTER_VERSION = "0.3.2"  # what pyproject's dev extra pins
STARTUP_TIMEOUT_S = 60.0
POLL_S = 0.05
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # the router colours its log
LAUNCH = (
    "import sys\n"
    "from sglang_router.launch_router import launch_router, parse_router_args\n"
    "args = parse_router_args(sys.argv[2:])\n"
    "args.policy = sys.argv[1]\n"
    "launch_router(args)\n"
)


class RouterUnavailable(RuntimeError):
    """sglang-router is not installed, or did not come up; the message says which and why."""


class SGLangRouter(ServerProcess):
    what = "sglang-router"
    unavailable = RouterUnavailable
    startup_timeout_s = STARTUP_TIMEOUT_S
    poll_s = POLL_S
    stop_grace_s = 15.0

    def __init__(
        self,
        worker_urls: Sequence[str],
        policy: str = "consistent_hashing",
        *,
        wait_for_workers: bool = True,
        port: int | None = None,
        log_path: Path | None = None,
        extra: Sequence[str] = (),
    ):
        self.worker_urls, self.policy, self.wait_for_workers = list(worker_urls), policy, wait_for_workers
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__(log_path or Path(tempfile.gettempdir()) / f"sglang-router-{self.port}.log")
        self.extra = tuple(extra)

    def command(self) -> list[str]:
        workers = ["--worker-urls", *self.worker_urls] if self.worker_urls else []
        return [
            sys.executable, "-c", LAUNCH, self.policy, "--host", "127.0.0.1", "--port", str(self.port), *workers,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--shutdown-grace-period-secs", "1", "--log-level", "info", *self.extra,
        ]  # fmt: skip

    def start(self) -> SGLangRouter:
        if importlib.util.find_spec("sglang_router") is None:
            raise RouterUnavailable(
                f"sglang-router is not installed in {sys.prefix}: `pip install -e '.[dev]'` installs "
                f"sglang-router=={ROUTER_VERSION}"
            )
        self._launch(self.command())
        self._wait_ready(self._is_ready, f"sglang-router at {self.url} not ready (workers {self.worker_urls})")
        return self

    def _is_ready(self, client: httpx2.Client) -> bool:
        if not self.wait_for_workers:
            return client.get(f"{self.url}/liveness").status_code == 200
        response = client.get(f"{self.url}/readiness")
        return response.status_code == 200 and response.json().get("healthy_workers") == len(self.worker_urls)

    def add_worker(self, url: str) -> None:
        """POST /workers (the router queues the registration, 202) and wait, bounded, until it lists `url` healthy."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        with httpx2.Client(timeout=5.0, trust_env=False) as client:
            client.post(f"{self.url}/workers", json={"url": url}).raise_for_status()
            while time.monotonic() < deadline:
                workers = client.get(f"{self.url}/workers").json()["workers"]
                if any(w["url"] == url and w.get("is_healthy") for w in workers):
                    self.worker_urls.append(url)
                    return
                time.sleep(POLL_S)  # the router registers it in the background: there is no event to wait on
        raise RouterUnavailable(
            f"sglang-router at {self.url} did not list {url} within {STARTUP_TIMEOUT_S:.0f} s:\n{self.log_tail()}"
        )

    def _clean(self, text: str) -> str:
        return ANSI.sub("", text)
