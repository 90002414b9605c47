"""`turnstile gateway`: the session gateway as a standing server, over the embedded model or SGLang servers
(`--url`), for agent programs and CLIs a user runs by hand (engine/agents, docs/agents.md).

    turnstile gateway                                   # the embedded tiny model, at http://127.0.0.1:8100
    turnstile gateway --url http://10.0.0.5:30000 --tokenizer /models/Qwen3-8B --host 0.0.0.0

It prints the base URLs, its key and the environment Claude Code and Codex need. A session is opened by its
first request (any name in the URL: `/sessions/<name>/v1`) or by `POST /sessions` (a fresh id and a key of its
own); it is finished by `POST /sessions/<name>/finish`, by `--session-idle-s` without a request, or by Ctrl-C,
which finishes every session. Each finished session's chains (one trajectory each: tokens, loss mask, log-probs,
turns) are appended to `--out` as JSON lines, which `turnstile show` reads.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import anyio

from engine.agents import needs_agents_extra
from engine.config import Settings
from engine.encoding import ChatEncoder
from engine.engine import RolloutEngine
from engine.errors import BackendError
from engine.run import check_metrics, check_out, decoder, load_encoder, load_local_model, open_backend
from engine.trajectory import Trajectory

if TYPE_CHECKING:
    from engine.agents.gateway import Gateway
    from engine.agents.session import Session

# Settings a gateway does not read: its sessions' agents, not an env, make the turns
NOT_READ = ("env_path", "env_workers", "env_worker_capacity", "ray_address", "n_samples_per_prompt", "agent_command",
            "agent_reward_command", "partial_rollout", "over_sampling", "refill", "turn_parser")  # fmt: skip
IDLE_CHECK_S = 5.0  # how often sessions are checked for idleness


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8100, help="port (default 8100; 0: any free port)")
    parser.add_argument("--public-url", help="the address agents reach it by (default http://host:port)")
    parser.add_argument(
        "--key", help="the gateway's key, which reaches every session (default: a fresh one, printed at start)"
    )
    parser.add_argument(
        "--out", default="out/sessions.jsonl", help="finished sessions' chains, as JSON lines (default %(default)s)"
    )
    parser.add_argument(
        "--session-idle-s", type=float, default=600.0,
        help="a session without a request this long is finished (default %(default)s; 0: only by Ctrl-C or POST)",
    )  # fmt: skip
    parser.add_argument(
        "--client-sampling", choices=("ignore", "refuse"), default="ignore",
        help="a client's temperature, top_p, forced tool_choice and the like: ignored and counted, or refused",
    )  # fmt: skip


@dataclass
class GatewayCommand:
    """One `turnstile gateway`, loaded: its settings, options, encoder and local model."""

    config: Settings
    args: argparse.Namespace
    encoder: ChatEncoder
    model: Any

    @classmethod
    def load(cls, config: Settings, args: argparse.Namespace) -> GatewayCommand:
        """Everything it reads, checked and loaded; a ValueError (or OSError) names what is wrong."""
        needs_agents_extra("`turnstile gateway`", "engine.agents.gateway")
        unread = sorted(set(NOT_READ) & config.model_fields_set)
        if unread:
            raise ValueError(f"{', '.join(unread)}: not read by `turnstile gateway` (its agents make the turns)")
        if config.sglang_only_parsers:  # the gateway reads replies as it streams them, with the engine's parsers
            raise ValueError(
                f"{' and '.join(config.sglang_only_parsers)}: `turnstile gateway` reads replies with the engine's own "
                f"parsers, and has none of this name"
            )
        if not 0 <= args.port <= 65535:
            raise ValueError(f"--port {args.port}: a port is 0 to 65535")
        check_out(args.out)
        check_metrics(config)
        return cls(config, args, load_encoder(config), load_local_model(config))

    def execute(self) -> int:
        """Serve until Ctrl-C (or SIGTERM): 0 once every session is finished and written; 2 when the backend or
        the address fails at start."""
        try:
            return anyio.run(self._serve)
        except BackendError as exc:
            print(f"turnstile: {exc.message}", file=sys.stderr)
            return 2

    async def _serve(self) -> int:
        from engine.agents.gateway import Gateway  # the agents extra's (checked by load)

        config, args = self.config, self.args
        async with AsyncExitStack() as stack:
            backend = await open_backend(stack, config, self.encoder, self.model)
            if backend is None:
                return 2
            settings = config.engine_config(self.encoder.stop_token_ids)
            engine = RolloutEngine(backend=backend, encoder=self.encoder, config=settings)  # its chains only
            writer = ChainWriter(Path(args.out), decoder(self.encoder))
            gateway = Gateway(
                engine.scheduler, model_name=_model_name(config), client_sampling=args.client_sampling,
                idle_timeout_s=max(args.session_idle_s, 3600.0), key=args.key, open_on_first_use=True,
                on_finished=writer.write, gc_freeze=config.gc_freeze,
            )  # fmt: skip
            # held until every session is finished: a second Ctrl-C meanwhile is taken, not a KeyboardInterrupt
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async with engine:
                    if engine.exporter is not None:
                        engine.exporter.registry.register(gateway.collector)
                    try:
                        async with gateway.serving(args.host, args.port, public_url=args.public_url):
                            _announce(gateway, config, engine, args.out)
                            await _until_stopped(gateway, signals, args.session_idle_s)
                    except OSError as exc:
                        where = f"{args.host}:{args.port}"
                        print(f"turnstile: cannot serve at {where}: {exc.strerror or exc}", file=sys.stderr)
                        return 2
        writer.close()
        print(f"turnstile: stopped; {writer.summary()}", file=sys.stderr)
        return 0


class ChainWriter:
    """Finished sessions' chains, one JSON line each (`Trajectory.to_record`, with the text), to `path`."""

    def __init__(self, path: Path, decode: Any):
        self.path, self.decode = path, decode
        self._out: TextIO | None = None
        self.sessions = self.chains = 0
        self.statuses: dict[str, int] = {}

    def write(self, session: Session, chains: list[Trajectory]) -> None:
        if self._out is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._out = self.path.open("a")
        for trajectory in chains:
            self._out.write(json.dumps(trajectory.to_record(self.decode), default=str) + "\n")
            self.statuses[str(trajectory.status)] = self.statuses.get(str(trajectory.status), 0) + 1
        self._out.flush()
        self.sessions, self.chains = self.sessions + 1, self.chains + len(chains)

    def close(self) -> None:
        if self._out is not None:
            self._out.close()

    def summary(self) -> str:
        if not self.sessions:
            return "no session finished, nothing written"
        return f"{self.sessions} sessions finished, {self.chains} chains {self.statuses} written to {self.path}"


async def _until_stopped(gateway: Gateway, signals: AsyncIterator[int], idle_s: float) -> None:
    """Until the first of `signals` (Ctrl-C, SIGTERM); meanwhile, sessions idle past `idle_s` are finished."""
    async with anyio.create_task_group() as tasks:

        async def finish_idle() -> None:
            while idle_s > 0:
                await anyio.sleep(min(IDLE_CHECK_S, idle_s))
                for session in gateway.idle_sessions(time.monotonic() - idle_s):
                    await gateway.finish_session(session)

        tasks.start_soon(finish_idle)
        async for _ in signals:
            print("\nturnstile: finishing every session", file=sys.stderr)
            tasks.cancel_scope.cancel()
            return


def _announce(gateway: Gateway, config: Settings, engine: RolloutEngine, out: str) -> None:
    """What to point agents at: the base URLs of an example session, the key, Claude Code's and Codex's set-up."""
    policy = f"SGLang at {config.url}" if config.backend_kind == "sglang" else f"the embedded {config.local_model}"
    from engine.agents.session import Session

    example = Session("demo")
    openai_url, anthropic_url = gateway.base_url(example), gateway.base_url(example, "anthropic")
    codex = (
        f"-c model_provider=turnstile -c model={gateway.model_name} "
        f'-c \'model_providers.turnstile={{name="turnstile", base_url="{openai_url}", wire_api="responses", '
        'env_key="TURNSTILE_API_KEY"}\''
    )
    lines = [
        f"turnstile gateway: {policy}, serving at {gateway.url}",
        f"  key: {gateway.key}",
        "  a session per agent run: any name in place of `demo` opens one on its first request (or POST /sessions)",
        f"  OpenAI (Chat Completions, Responses) base URL: {openai_url}",
        f"  Anthropic (Messages) base URL:                 {anthropic_url}",
        f"  Claude Code: ANTHROPIC_BASE_URL={anthropic_url} ANTHROPIC_API_KEY={gateway.key} "
        'CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 claude -p "..."',
        f'  Codex:       TURNSTILE_API_KEY={gateway.key} codex exec {codex} "..."',
        f"  finished sessions' chains: {out} (turnstile show {out}); Ctrl-C finishes every session",
    ]
    if engine.exporter is not None:
        lines.append(f"  metrics: {engine.exporter.url}")
    print("\n".join(lines), file=sys.stderr, flush=True)


def _model_name(config: Settings) -> str:
    """The model name replies carry when a request names none: the tokenizer's, or the embedded model's."""
    return config.tokenizer.rstrip("/").rsplit("/", 1)[-1] if config.backend_kind == "sglang" else config.local_model
