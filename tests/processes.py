"""TEST INFRASTRUCTURE: a server run as a child process in a process group of its own, logging to a file,
ready when its own readiness check says so (polled, bounded: a starting process sends no event), and
stopped with SIGTERM, then SIGKILL after a grace period. tests/sglang_cpu/server.py (SGLang) and
tests/router.py (sglang-router) are built on it."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx2


class ServerProcess:
    """Subclasses set `what` (for messages), `unavailable` (the error they raise), the timeouts, and
    call `_launch` then `_wait_ready` from their `start`."""

    what = "server"
    unavailable: type[Exception] = RuntimeError
    startup_timeout_s = 60.0
    poll_s = 0.5
    stop_grace_s = 30.0

    def __init__(self, log_path: Path):
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    def start(self) -> ServerProcess:
        raise NotImplementedError

    def _launch(self, command: list[str], env: dict[str, str] | None = None) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def _wait_ready(self, is_ready: Callable[[httpx2.Client], bool], not_ready: str) -> None:
        """Poll `is_ready` until it holds; the error names `not_ready` and the log's tail otherwise, the
        process stopped."""
        deadline = time.monotonic() + self.startup_timeout_s
        try:
            with httpx2.Client(timeout=5.0, trust_env=False) as client:
                while time.monotonic() < deadline:
                    if self.process.poll() is not None:
                        code = self.process.returncode
                        raise self.unavailable(f"{self.what} exited with {code} at startup:\n{self.log_tail()}")
                    try:
                        if is_ready(client):
                            return
                    except httpx2.TransportError:
                        pass
                    time.sleep(self.poll_s)  # polling a process that is starting: there is no event to wait on
            raise self.unavailable(f"{not_ready} after {self.startup_timeout_s:.0f} s:\n{self.log_tail()}")
        except BaseException:
            self.stop()
            raise

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self._clean(self.log_path.read_text(errors="replace")).splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _clean(self, text: str) -> str:
        return text

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=self.stop_grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
