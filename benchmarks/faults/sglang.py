"""The fault suite's real-SGLang servers (`python -m benchmarks.faults --sglang`): SGLang 0.5.23 on CPU serving the
tiny random-weight Qwen2.5-VL model (tests/sglang_cpu/server.py, its own venv), in place of the simulated server.

What the suite asks of its servers, and how a real one gives it (`SimServers` in benchmarks/faults/servers.py is
the simulated counterpart):

  a weight update          in the calls slime's trainer makes (tests/sglang_cpu/server.py,
                           `update_weights_as_slime`): POST /pause_generation, which aborts every request on
                           the server, GET /flush_cache once it is idle, POST /update_weights_from_disk with the
                           model's own directory, POST /continue_generation
  a fresh start per case   a weight update to "v0" (a real reload): nothing of the case before is left running,
                           and every case starts at v0
  5xx, malformed replies   benchmarks/faults/proxy.py in front of the server: the real server's replies are what
                           gets corrupted; the engine is given the proxy's URL
  what was injected        counted by the proxy (the client side), not read from the server
  a weight update a step   the same, with the step's version
  a restart                SIGKILL to the server's process group (the HTTP server, scheduler and detokenizer
                           processes), a new server on the same port, then the weight version it had
  two servers              the suite's server and a second one started beside it for the case; the second is the
                           one killed for good

A server given by URL (`--sglang-url`) is used as it is: the suite does not kill or restart a server it did not
start, so the cases that would are skipped, saying so.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio

from benchmarks.faults.proxy import FaultProxy, ProxyFaults
from benchmarks.faults.servers import ProcessUnavailable, ServerFront, get_json
from tests.sglang_cpu.server import (
    SGLangServer,
    SGLangUnavailable,
    is_installed,
    model_dir,
    update_weights_as_slime,
    venv_dir,
)

MODEL = "tiny-qwen2.5-vl"
CONTROL_TIMEOUT_S = 120.0  # a weight reload or an abort on a busy 2-core machine
# An SGLang start is ~25 s on an idle 2-core machine; with other servers and test runs beside it, it has taken
# over 10 minutes (five processes importing torch and SGLang on two cores), past tests/sglang_cpu's 600 s.
STARTUP_TIMEOUT_S = 1500.0


def unavailable() -> str | None:
    """None when the SGLang venv is installed here, else why the suite cannot run against a real server."""
    if is_installed():
        return None
    return f"no SGLang venv at {venv_dir()}: run `python -m tests.sglang_cpu.server install`"


class AttachedServer:
    """A running SGLang server the suite did not start: used, never killed."""

    is_owned = False

    def __init__(self, url: str):
        self.url = url.rstrip("/")

    @property
    def is_running(self) -> bool:
        return True

    def start(self) -> AttachedServer:
        return self

    def stop(self) -> None:
        pass


class SGLangProcess(SGLangServer):
    """A real SGLang server on CPU, started by the suite, that can be SIGKILLed and started again on its port."""

    is_owned = True
    startup_timeout_s = STARTUP_TIMEOUT_S

    def __init__(self, log_path: Path | None = None):
        super().__init__(model_dir(MODEL), log_path=log_path)

    @property
    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> SGLangProcess:
        try:
            super().start()
        except SGLangUnavailable as exc:
            raise ProcessUnavailable(str(exc)) from exc
        return self

    def kill(self) -> None:
        """SIGKILL to the whole process group, no goodbye: connections drop, nothing is flushed."""
        if self.is_running:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


class SGLangServers:
    """The suite's real SGLang servers (see the module docstring). `url`: attach to a running server instead of
    starting one."""

    kind = "sglang"
    reuses_primary = True  # a two-server case runs on the suite's server and one started for it
    health_timeout_s = 20  # SGLang's /health runs a one-token generation: seconds on a busy 2-core machine
    # The fault-free case's steps set the hang limit of the others (10 x its slowest), but its own steps have only
    # this: a CPU server shared with other work has taken over a minute for a step of 8 trajectories.
    min_step_limit_s = 600.0

    def __init__(self, *, url: str | None = None):
        self.attached_url = url
        self._weights_path: str | None = None

    def new(self, log_path: Path | None) -> SGLangProcess:
        return SGLangProcess(log_path)

    def primary(self, log_path: Path | None) -> SGLangProcess | AttachedServer:
        return AttachedServer(self.attached_url) if self.attached_url else self.new(log_path)

    def cannot_kill(self, server: Any) -> str | None:
        """Why `server` may not be killed, or None."""
        if server.is_owned:
            return None
        return f"the server at {server.url} was given (--sglang-url): the suite does not kill a server it did not start"

    async def weights_path(self, server: Any) -> str:
        """The model directory the server serves (its /model_info), reloaded by every weight update."""
        if self._weights_path is None:
            info = await get_json(server.url, "/model_info", timeout=CONTROL_TIMEOUT_S)
            self._weights_path = str(info["model_path"])
        return self._weights_path

    async def reset(self, server: Any, *, seed: int) -> None:
        """A fresh start for a case: weight version v0 (a real reload), nothing left running (the update's pause
        aborts every request on the server)."""
        await self.update_weights(server, "v0")

    async def update_weights(self, server: Any, version: str) -> None:
        """A reload of the served directory, in the calls slime's trainer makes (raises RuntimeError if refused)."""
        update = functools.partial(
            update_weights_as_slime, server.url, await self.weights_path(server), version, timeout=CONTROL_TIMEOUT_S
        )
        await anyio.to_thread.run_sync(update)

    @contextlib.asynccontextmanager
    async def front(self, server: Any, faults: dict[str, float], *, seed: int) -> AsyncIterator[ServerFront]:
        """Where the engine sends its requests: the server itself, or, with faults, a FaultProxy in front of it."""
        if not faults:
            yield ServerFront(server.url)
            return
        async with FaultProxy(server.url, faults=ProxyFaults(**faults, seed=seed)) as proxy:

            async def counts() -> dict[str, int]:
                return {"server_error": 0, "malformed": 0, **proxy.injected, "connections_dropped": proxy.dropped}

            yield ServerFront(proxy.url, counts)

    async def restart(self, server: Any, *, faults: dict[str, float], version: str, seed: int) -> dict[str, int]:
        """SIGKILL, a new server on the same port, then the weight version it had. The proxy in front, if any,
        stays and keeps counting, so nothing needs reading from the dying server: returns {}."""
        await anyio.to_thread.run_sync(server.kill)
        await anyio.to_thread.run_sync(server.start)
        await self.update_weights(server, version)
        return {}
