"""A session gateway in a process of its own, for benchmarks that measure it from outside (its RSS is its alone):
`GatewayHost` starts it on a free port, and it answers one JSON command a line on its stdin.

    with GatewayHost() as host:                        # an instant backend; GatewayHost(backend=URL): an SGLang server
        opened = host.ask("open", n=10)["sessions"]    # [{"id", "key", "openai", "anthropic"}, ...]: keys, base URLs
        host.ask("finish", ids=[...])                  # {"finished", "chains", "turns", "statuses", "stamps"}
        host.ask("stats")                              # {"rss_mib", "peak_rss_mib", "cached_tool_sets", ...}
        host.ask("reset_peak")                         # the peak RSS (VmHWM) set back to the RSS now; then stats
        host.ask("census")                             # {"objects": {type: count}} alive after a full collection

Over the instant backend (benchmarks/agents/gateway.py's) only the gateway's and the engine's cost count. Over an SGLang
server (engine.backends.sglang.SGLangBackend, which streams a turn when the gateway sets a listener) the host notes,
for each turn, when the server sent its first chunk (`first_chunk_at`) and when the backend's listener first got
tokens (`listener_at`), both `time.monotonic()` (one clock for every process of the machine): `finish` gives them
per session, in `stamps`. A census counts the objects the collector tracks that were made since serving started
(what was alive then is frozen, and `gc.get_objects` leaves frozen objects out).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import select
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import anyio

from benchmarks.agents.gateway import scheduler_for
from engine.agents.gateway import Gateway
from engine.agents.limits import GatewayLimits
from engine.backends.sglang import SGLangBackend
from engine.encoding import ChatEncoder
from engine.models import load_tokenizer

REPO = Path(__file__).resolve().parents[2]


class GatewayHost:
    """The gateway's process, seen from the benchmark's: `ask` sends a command and waits for its answer (at most
    `timeout` seconds); leaving the block closes its stdin, and the process ends its serving and exits."""

    def __init__(
        self, backend: str = "instant", *, max_body_bytes: int | None = None, max_new_tokens: int = 64,
        timeout: float = 600.0,
    ):  # fmt: skip
        self.command = [sys.executable, "-m", "benchmarks.agents.gateway_host", "--backend", backend]
        self.command += ["--max-new-tokens", str(max_new_tokens)]
        if max_body_bytes is not None:
            self.command += ["--max-body-bytes", str(max_body_bytes)]
        self.timeout = timeout
        self.process: subprocess.Popen | None = None
        self.url = ""
        self.pid = 0

    def __enter__(self) -> GatewayHost:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        self.process = subprocess.Popen(
            self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO, env=env
        )
        try:
            hello = self._answer()
        except BaseException:
            self.__exit__()
            raise
        self.url, self.pid = hello["url"], hello["pid"]
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.process is not None
        with self.process:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def ask(self, op: str, **fields: Any) -> dict[str, Any]:
        assert self.process is not None
        self.process.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.process.stdin.flush()
        return self._answer()

    def _answer(self) -> dict[str, Any]:
        assert self.process is not None
        ready, _, _ = select.select([self.process.stdout], [], [], self.timeout)
        line = self.process.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(f"the gateway's process did not answer (exit code {self.process.poll()})")
        return json.loads(line)


class Stamped:
    """A streaming backend that notes, per trajectory (its `session_id`), each turn's `first_chunk_at` (the
    server's stamp) and when the listener first got tokens."""

    streams = True

    def __init__(self, backend: SGLangBackend):
        self.backend = backend
        self.stamps: dict[str | None, list[dict[str, float | None]]] = {}

    async def generate(self, input_ids, sampling_params, image_data=None, *, session_id=None, on_tokens=None, **rest):
        heard: list[float] = []

        def listen(token_ids: list[int]) -> None:
            if not heard:
                heard.append(time.monotonic())
            on_tokens(token_ids)

        result = await self.backend.generate(
            input_ids, sampling_params, image_data, session_id=session_id,
            on_tokens=listen if on_tokens is not None else None, **rest,
        )  # fmt: skip
        stamp = {"first_chunk_at": result.meta.get("first_chunk_at"), "listener_at": heard[0] if heard else None}
        self.stamps.setdefault(session_id, []).append(stamp)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)


def status_mib(field: str) -> float:
    """A size from /proc/self/status (VmRSS, VmHWM), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError(f"/proc/self/status has no {field}")


class Commands:
    """What the host answers: each command a method, its fields its arguments."""

    def __init__(self, gateway: Gateway, stamped: Stamped | None):
        self.gateway, self.stamped = gateway, stamped

    def open(self, n: int) -> dict[str, Any]:
        opened = [self.gateway.open_session() for _ in range(n)]
        return {"sessions": [
            {"id": s.id, "key": s.key, "openai": self.gateway.base_url(s),
             "anthropic": self.gateway.base_url(s, "anthropic")} for s in opened
        ]}  # fmt: skip

    async def finish(self, ids: list[str]) -> dict[str, Any]:
        statuses: Counter[str] = Counter()
        stamps: dict[str, list[dict[str, float | None]]] = {}
        chains = turns = 0
        for session_id in ids:
            trajectories = await self.gateway.finish(session_id)
            chains += len(trajectories)
            turns += sum(len(t.turns) for t in trajectories)
            statuses.update(str(t.status) for t in trajectories)
            if self.stamped is not None:
                stamps[session_id] = [s for t in trajectories for s in self.stamped.stamps.pop(t.session_id, [])]
        return {"finished": len(ids), "chains": chains, "turns": turns, "statuses": statuses, "stamps": stamps}

    def stats(self) -> dict[str, Any]:
        encoder = self.gateway.scheduler.encoder
        return {
            "rss_mib": status_mib("VmRSS"), "peak_rss_mib": status_mib("VmHWM"),
            "sessions_open": len(self.gateway.sessions), "cached_tool_sets": encoder.cached_tool_sets,
            "max_tool_sets": encoder.max_tool_sets, "counts": dict(self.gateway.counts),
        }  # fmt: skip

    def reset_peak(self) -> dict[str, Any]:
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to VmRSS
        return self.stats()

    def census(self) -> dict[str, Any]:
        gc.collect()
        return {"objects": dict(Counter(type(o).__qualname__ for o in gc.get_objects()))}


async def serve(args: argparse.Namespace) -> None:
    encoder = ChatEncoder(load_tokenizer("qwen2.5"))
    async with contextlib.AsyncExitStack() as stack:
        stamped = None
        if args.backend != "instant":
            stamped = Stamped(await stack.enter_async_context(SGLangBackend(args.backend, timeout=120)))
        scheduler = scheduler_for(encoder, 1024, backend=stamped, max_new_tokens=args.max_new_tokens)
        limits = GatewayLimits(max_body_bytes=args.max_body_bytes) if args.max_body_bytes else GatewayLimits()
        gateway = Gateway(scheduler, limits=limits)
        commands = Commands(gateway, stamped)
        async with gateway.serving():
            print(json.dumps({"url": gateway.url, "pid": os.getpid()}), flush=True)
            async for line in anyio.wrap_file(sys.stdin):
                command = json.loads(line)
                answer = getattr(commands, command.pop("op"))(**command)
                print(json.dumps(await answer if hasattr(answer, "__await__") else answer), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="instant", help='"instant", or an SGLang server\'s URL')
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-body-bytes", type=int, help="the gateway's bound on a body (GatewayLimits' default)")
    anyio.run(serve, parser.parse_args())


if __name__ == "__main__":
    main()
