"""The fault suite's processes: simulated SGLang servers that can be killed and restarted on their port, and
sglang-router (PyPI `sglang-router` 0.3.2, as slime runs it) in front of them; and `SimServers`, what the suite
asks of its servers (a fresh start per case, injected faults and their counts, weight updates, a restart) done
on simulated ones. benchmarks/faults/sglang.py's `SGLangServers` does the same on real SGLang servers.

    with SimProcess(SimConfig(max_running=16)) as server:     # python -m benchmarks.longtail.simserver on a free port
        server.kill()                                         # SIGKILL: requests in flight see the connection drop
        server.start()                                        # the same port again, a fresh server
    with RouterProcess([a.url, b.url]) as router:             # policy consistent_hashing, health checks every second
        ... router.url ...

Every process runs in a process group of its own, logging to a file, and is stopped with SIGTERM, then SIGKILL.
Readiness is polled (a starting process sends no event), bounded by `startup_timeout_s`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import anyio
import httpx2

from benchmarks.longtail.simserver import SimConfig

REPO = Path(__file__).resolve().parents[2]
POLL_S = 0.05
WEIGHTS_PATH = "/sim/weights"  # what the simulated server is told to load (it loads nothing)
CONTROL_TIMEOUT_S = 10.0
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

    def is_ready(self, client: httpx2.Client) -> bool:
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
        with httpx2.Client(timeout=5.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise ProcessUnavailable(f"{self.what} exited with {self.process.returncode}:\n{self.log_tail()}")
                try:
                    if self.is_ready(client):
                        return self
                except httpx2.TransportError:
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
    """`python -m benchmarks.longtail.simserver` on one port for its whole life: `kill()` then `start()` restarts it
    there."""

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
        return [sys.executable, "-m", "benchmarks.longtail.simserver", "--port", str(self.port), *flags]

    def is_ready(self, client: httpx2.Client) -> bool:
        return client.get(f"{self.url}/health").status_code == 200


class RouterProcess(_Process):
    """sglang-router in front of `worker_urls`. Health checks every `health_interval_s`, each given
    `health_timeout_s`, with one failure marking a worker unhealthy, so a dead worker leaves the ring quickly; the
    router's own retries are on (its default)."""

    what = "sglang-router"

    def __init__(
        self,
        worker_urls: Sequence[str],
        *,
        policy: str = "consistent_hashing",
        health_interval_s: int = 1,
        health_timeout_s: int = 1,
        log_path: Path | None = None,
        extra: Sequence[str] = (),
    ):
        self.worker_urls, self.policy, self.health_interval_s = list(worker_urls), policy, health_interval_s
        self.health_timeout_s = health_timeout_s
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
            "--health-check-timeout-secs", str(self.health_timeout_s), "--shutdown-grace-period-secs", "1",
            "--log-level", "warn",
            *self.extra,
        ]  # fmt: skip

    def is_ready(self, client: httpx2.Client) -> bool:
        response = client.get(f"{self.url}/readiness")
        return response.status_code == 200 and response.json().get("healthy_workers") == len(self.worker_urls)

    def healthy_workers(self) -> list[str]:
        with httpx2.Client(timeout=5.0, trust_env=False) as client:
            workers = client.get(f"{self.url}/workers").json().get("workers", [])
        return [w["url"] for w in workers if w.get("is_healthy")]


def router_available() -> str | None:
    """None when sglang-router can be imported here, else why not."""
    import importlib.util

    if importlib.util.find_spec("sglang_router") is None:
        return f"sglang-router is not installed in {sys.prefix} (`pip install -e '.[dev]'` installs 0.3.2)"
    return None


async def post_json(
    url: str, path: str, body: dict[str, Any] | None = None, *, timeout: float = CONTROL_TIMEOUT_S
) -> Any:
    async with httpx2.AsyncClient(base_url=url, trust_env=False, timeout=timeout) as client:
        response = (await client.post(path, json=body or {})).raise_for_status()
        return response.json() if response.content else None


async def get_json(url: str, path: str, *, timeout: float = CONTROL_TIMEOUT_S) -> Any:
    async with httpx2.AsyncClient(base_url=url, trust_env=False, timeout=timeout) as client:
        return (await client.get(path)).raise_for_status().json()


async def _no_counts() -> dict[str, int]:
    return {"server_error": 0, "malformed": 0}


@dataclass(frozen=True)
class ServerFront:
    """Where the engine sends a case's requests, and `counts()`: what was injected there so far, by kind."""

    url: str
    counts: Callable[[], Awaitable[dict[str, int]]] = _no_counts


class Servers(Protocol):
    """What the fault suite asks of its servers; `SimServers` below and sglang.py's `SGLangServers` give it.
    A server is a process object with `url`, `is_running`, `start()`, `kill()` (SIGKILL) and `stop()`."""

    kind: str  # "simulated" | "sglang": the report's "server"
    reuses_primary: bool  # a two-server case runs on the suite's server and one more (else on two of its own)
    health_timeout_s: int  # what sglang-router gives one health check of a server (SGLang's /health generates)
    min_step_limit_s: float  # a rollout step (or a pause) past this is reported as a hang, whatever the baseline

    def new(self, log_path: Path | None) -> Any: ...  # a server, not started
    def primary(self, log_path: Path | None) -> Any: ...  # the suite's server, not started
    def cannot_kill(self, server: Any) -> str | None: ...  # why the suite may not kill it, or None
    async def weights_path(self, server: Any) -> str: ...  # what a weight update loads
    async def reset(self, server: Any, *, seed: int) -> None: ...  # a fresh start for a case, at version v0
    async def update_weights(self, server: Any, version: str) -> None: ...

    def front(
        self, server: Any, faults: dict[str, float], *, seed: int
    ) -> contextlib.AbstractAsyncContextManager[ServerFront]: ...  # where the engine sends requests, injecting faults

    async def restart(self, server: Any, *, faults: dict[str, float], version: str, seed: int) -> dict[str, int]:
        """Kill the server and start it again on its port, at `version`; returns what it had injected, if that
        dies with it."""
        ...


class SimServers:
    """The suite's simulated servers (`SimProcess`, configured by `config`): each server injects its own faults
    (/sim/faults) and counts them (/stats); /sim/reset gives each case a fresh start."""

    kind = "simulated"
    reuses_primary = False  # a two-server case starts two of its own
    health_timeout_s = 1
    min_step_limit_s = 60.0

    def __init__(self, config: SimConfig):
        self.config = config

    def new(self, log_path: Path | None) -> SimProcess:
        return SimProcess(self.config, log_path=log_path)

    def primary(self, log_path: Path | None) -> SimProcess:
        return self.new(log_path)

    def cannot_kill(self, server: SimProcess) -> str | None:
        return None

    async def weights_path(self, server: SimProcess) -> str:
        return WEIGHTS_PATH

    async def reset(self, server: SimProcess, *, seed: int) -> None:
        await post_json(server.url, "/sim/reset", {"weight_version": "v0"})
        await post_json(server.url, "/sim/faults", {"error_rate": 0.0, "malformed_rate": 0.0, "fault_seed": seed})
        await post_json(server.url, "/stats/reset")

    async def update_weights(self, server: SimProcess, version: str) -> None:
        await post_json(
            server.url, "/update_weights_from_disk", {"model_path": WEIGHTS_PATH, "weight_version": version}
        )

    @contextlib.asynccontextmanager
    async def front(self, server: SimProcess, faults: dict[str, float], *, seed: int) -> AsyncIterator[ServerFront]:
        """The server itself, told to inject `faults`; its counts are its /stats."""
        if faults:
            await post_json(server.url, "/sim/faults", {**faults, "fault_seed": seed})

        async def counts() -> dict[str, int]:
            return dict((await get_json(server.url, "/stats")).get("injected", {}))

        yield ServerFront(server.url, counts)

    async def restart(self, server: SimProcess, *, faults: dict[str, float], version: str, seed: int) -> dict[str, int]:
        """SIGKILL and a new server on the same port, at `version`, injecting `faults` again (from another seed).
        Returns what the killed one had injected (its counts die with it)."""
        before: dict[str, int] = {}
        with contextlib.suppress(httpx2.HTTPError):
            before = dict((await get_json(server.url, "/stats")).get("injected", {}))
        await anyio.to_thread.run_sync(server.kill)
        server.config = replace(self.config, weight_version=version, fault_seed=seed + 1, **faults)
        await anyio.to_thread.run_sync(server.start)
        return before
