"""TEST INFRASTRUCTURE: a real SGLang server on a CPU-only machine, for the end-to-end test tier.

    python -m tests.sglang_cpu.server install          # the SGLang venv (cached; ~4 min and ~11 GB once)
    python -m tests.sglang_cpu.server serve --port 30000  # serve the tiny Qwen2.5-VL model until Ctrl-C

    with SGLangServer(model_dir("tiny-qwen2.5-vl")) as server:   # in tests
        ... server.url ...

SGLang pins its own torch, so it lives in its own virtual environment: $TURNSTILE_SGLANG_VENV, else
`<turnstile cache>/sglang-venv`. A finished install leaves a marker naming the version, so a half-done
install is redone rather than used. The server runs SGLang's torch-native CPU path
(SGLANG_USE_CPU_ENGINE=1, --device cpu) with the stand-in `sgl_kernel` of `standin/` first on the
server process's PYTHONPATH (see standin/sgl_kernel/__init__.py for why and what it holds).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import httpx2

from engine.models import cache_dir, load_model, load_processor, load_tokenizer, save_atomically
from tests.net import free_port
from tests.processes import ServerProcess

SGLANG_VERSION = "0.5.23"
LOG_REQUESTS = ("--log-requests", "--log-requests-level", "0", "--log-requests-format", "json")
STANDIN = Path(__file__).parent / "standin"
STARTUP_TIMEOUT_S = 600.0  # ~25 s warm; a cold start compiles and loads far more on a busy 2-core machine


class SGLangUnavailable(RuntimeError):
    """The SGLang venv is missing or broken, or the server did not come up; the message says which and why."""


def venv_dir() -> Path:
    return Path(os.environ.get("TURNSTILE_SGLANG_VENV") or cache_dir() / "sglang-venv")


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def _marker() -> Path:
    return venv_dir() / f".turnstile-sglang-{SGLANG_VERSION}"


def is_installed() -> bool:
    return _marker().exists() and venv_python().exists()


def install(log=sys.stderr) -> Path:
    """Create the venv and `pip install sglang==SGLANG_VERSION` into it, unless already done.
    Raises SGLangUnavailable with pip's last lines when the install fails."""
    if is_installed():
        return venv_python()
    shutil.rmtree(venv_dir(), ignore_errors=True)
    venv_dir().parent.mkdir(parents=True, exist_ok=True)
    steps = [
        [sys.executable, "-m", "venv", str(venv_dir())],
        [str(venv_python()), "-m", "pip", "install", "-q", "--upgrade", "pip"],
        # torch first, pinned to the wheels this project uses; sglang then finds its pin satisfied
        [str(venv_python()), "-m", "pip", "install", "-q", "torch==2.14.1", "torchvision==0.29.1"],
        [str(venv_python()), "-m", "pip", "install", "-q", f"sglang=={SGLANG_VERSION}"],
    ]
    for step in steps:
        print(f"sglang-cpu: {' '.join(step[-3:])}", file=log, flush=True)
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
            raise SGLangUnavailable(f"installing SGLang {SGLANG_VERSION} failed at `{' '.join(step)}`:\n{tail}")
    probe = _import_probe()
    if probe:
        raise SGLangUnavailable(f"SGLang {SGLANG_VERSION} installed but does not import: {probe}")
    _marker().write_text(SGLANG_VERSION)
    return venv_python()


def _import_probe() -> str:
    """'' when sglang's server module imports in the venv with the stand-in kernels, else the error's tail."""
    done = subprocess.run(
        [str(venv_python()), "-c", "import sglang.launch_server"],
        capture_output=True, text=True, env=_server_env(),
    )  # fmt: skip
    return "" if done.returncode == 0 else "\n".join(done.stderr.strip().splitlines()[-5:])


def model_dir(name: str = "tiny-qwen2.5-vl") -> Path:
    """A directory SGLang can serve: the tiny model's config and weights with the processor's files
    (tokenizer, chat template, preprocessor config) beside them."""
    path = cache_dir() / "sglang-models" / name
    if (path / "config.json").exists():  # written by one rename, so never half there
        return path
    save_atomically(path, load_model(name), load_processor() if name == "tiny-qwen2.5-vl" else load_tokenizer())
    return path


def _server_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(STANDIN), *filter(None, [env.get("PYTHONPATH")])])
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env.pop("VIRTUAL_ENV", None)
    return env


def update_weights_as_slime(url: str, model_path: str | Path, version: str, *, timeout: float = 120.0) -> dict:
    """The trainer's weight update of one engine, in the calls slime makes (slime/ray/actor_group.py at 624b824):
    POST /pause_generation (SGLang's default mode aborts what runs), flush the cache, POST
    /update_weights_from_disk, POST /continue_generation. Returns the update's reply; raises RuntimeError naming
    the call SGLang refused and its reply.

    The flush comes first because SGLang is not idle for a moment after a request ends, and an update's own flush
    then fails the update ("the cache was not flushed because requests are still running or queued"). slime
    retries GET /flush_cache until it answers 200; SGLang's `timeout` query has the server wait for idle instead.
    """
    with httpx2.Client(base_url=url, trust_env=False, timeout=timeout) as client:

        def call(method: str, path: str, body: dict[str, Any] | None = None, **params: Any) -> httpx2.Response:
            reply = client.request(method, path, json=body, params=params)
            if reply.status_code != 200:  # a refused update is HTTP 400 with `success: false`
                raise RuntimeError(f"SGLang at {url} refused {method} {path} (HTTP {reply.status_code}): {reply.text}")
            return reply

        call("POST", "/pause_generation", {})
        call("GET", "/flush_cache", timeout=timeout / 2)
        update = call("POST", "/update_weights_from_disk", {"model_path": str(model_path), "weight_version": version})
        call("POST", "/continue_generation", {})
        return update.json()


def routed_requests(log_paths: list[Path] | list[str]) -> dict[str, Counter[int]]:
    """Routing key (the `X-SMG-Routing-Key` header) -> how many /generate requests carrying it each worker (by
    position in `log_paths`) received, from the servers' request logs (started with LOG_REQUESTS)."""
    seen: dict[str, Counter[int]] = defaultdict(Counter)
    for position, path in enumerate(log_paths):
        for line in Path(path).read_text(errors="replace").splitlines():
            start = line.find('{"timestamp"')
            if start < 0:
                continue
            try:
                event = json.loads(line[start:])
            except json.JSONDecodeError:
                continue
            key = (event.get("headers") or {}).get("x-smg-routing-key")
            if event.get("event") == "request.received" and key:
                seen[key][position] += 1
    return dict(seen)


class SGLangServer(ServerProcess):
    """`sglang.launch_server` on CPU in its own process group; ready when /health answers 200."""

    what = "SGLang"
    unavailable = SGLangUnavailable
    startup_timeout_s = STARTUP_TIMEOUT_S

    def __init__(self, model_path: Path, *, port: int | None = None, log_path: Path | None = None, extra: tuple = ()):
        self.model_path, self.port = Path(model_path), port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__(log_path or cache_dir() / "sglang-logs" / f"server-{self.port}.log")
        self.extra = tuple(extra)

    def command(self) -> list[str]:
        return [
            str(venv_python()), "-m", "sglang.launch_server",
            "--model-path", str(self.model_path), "--host", "127.0.0.1", "--port", str(self.port),
            "--device", "cpu", "--max-total-tokens", "65536", "--disable-overlap-schedule",
            "--mem-fraction-static", "0.5", "--max-running-requests", "64", "--skip-server-warmup",
            "--sleep-on-idle",  # an idle scheduler otherwise polls without pause, taking a core from everything else
            *self.extra,
        ]  # fmt: skip

    def start(self) -> SGLangServer:
        if not is_installed():
            raise SGLangUnavailable(
                f"no SGLang venv at {venv_dir()}: run `python -m tests.sglang_cpu.server install` (.ci/run does)"
            )
        self._launch(self.command(), env=_server_env())
        self._wait_ready(lambda client: client.get(f"{self.url}/health").status_code == 200, "SGLang not healthy")
        return self


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.sglang_cpu.server")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("install", help="create the SGLang venv (cached)")
    serve = commands.add_parser("serve", help="serve a tiny model until interrupted")
    serve.add_argument("--model", default="tiny-qwen2.5-vl", choices=["tiny-qwen2.5-vl", "tiny-qwen2"])
    serve.add_argument("--port", type=int, default=30000)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # so the server below is stopped, not orphaned
    try:
        if args.command == "install":
            print(install())
            return 0
        with SGLangServer(model_dir(args.model), port=args.port) as server:
            print(f"SGLang serving {args.model} at {server.url} (log: {server.log_path})", flush=True)
            server.process.wait()
    except SGLangUnavailable as error:
        print(f"sglang-cpu: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
