"""`turnstile run`: everything a run reads, checked and loaded before it starts (`Run.load`: one ValueError
naming what is wrong), then the run itself (`Run.execute`): the turn-level engine over the prompts, each
group's trajectories written as one JSON line each as it finishes, a live line and a summary on stderr.
At exit, env calls left running in their threads are named and waited for a little (`EXIT_WAIT_S`).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from contextlib import AsyncExitStack, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import httpx2
import jinja2

from engine.backends.base import Backend
from engine.config import Settings
from engine.encoding import ChatEncoder
from engine.engine import RolloutEngine
from engine.envs.base import AbandonedCalls
from engine.envs.loader import EnvFactory, load_env_module
from engine.envs.ray_workers import hosted
from engine.errors import BackendError
from engine.metrics.live import LiveView
from engine.metrics.logging import TurnLogger
from engine.metrics.recorder import MetricsRecorder
from engine.source import jsonl_rows
from engine.trajectory import Status, Trajectory

EXIT_WAIT_S = 3.0  # at exit, how long to wait for env calls still running past their timeout


@dataclass
class Run:
    """One `turnstile run`, loaded: its settings, options, envs, prompt rows, encoder and local model."""

    config: Settings
    args: argparse.Namespace  # the run's own options: num_prompts, prompts, out, text
    make_env: EnvFactory
    rows: list[dict[str, Any]]
    encoder: ChatEncoder
    model: Any

    @classmethod
    def load(cls, config: Settings, args: argparse.Namespace) -> Run:
        """Everything the run reads, checked and loaded; a ValueError (or OSError) names what is wrong."""
        _check_run(config)
        check_out(args.out)
        check_metrics(config)
        make_env = EnvFactory(
            config.env_path, args=SimpleNamespace(**config.model_dump()), step_timeout=config.retry.env_step_timeout_s
        )
        rows = _load_rows(args, config)  # after the env module is checked: its make_prompts, if no --prompts
        encoder = load_encoder(config)
        encoder.check_env(
            config.env_path, make_env.observation_roles, skip_special_tokens=config.skip_special_tokens,
            read_by_server=config.calls_read_by_server,
        )  # fmt: skip
        model = load_local_model(config)
        make_env = hosted(
            make_env,
            env_workers=config.env_workers,
            capacity=config.env_worker_capacity,
            ray_address=config.ray_address,
        )
        return cls(config, args, make_env, rows, encoder, model)

    def execute(self) -> int:
        """Run it: 0; 1 when every trajectory failed; 2 when the backend failed as the engine started;
        130 on Ctrl-C (the trajectories written stay written, and the last line counts them)."""
        ran: list[RolloutEngine] = []  # the engine, once built: what it leaves running is said at exit
        written: list[Trajectory] = []  # each as its line is written
        interrupted = False
        try:
            return anyio.run(self._run, ran, written)
        except BackendError as exc:  # the backend failed outside any trajectory: one line
            print(f"turnstile: {exc.message}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            interrupted = True
            return 130
        finally:
            self.make_env.close()  # env workers, when the envs run in them
            if ran:
                _wait_for(ran[0].abandoned_env_calls)
            if interrupted:  # the last line: what the run leaves behind it
                where = "stdout" if self.args.out == "-" else self.args.out
                count = f"{len(written)} trajector{'y' if len(written) == 1 else 'ies'}"
                print(f"turnstile: interrupted; {count} written to {where}", file=sys.stderr)

    async def _run(self, ran: list[RolloutEngine], finished: list[Trajectory]) -> int:
        started = time.monotonic()
        decode = decoder(self.encoder) if self.args.text else None
        async with AsyncExitStack() as stack:
            backend = await open_backend(stack, self.config, self.encoder, self.model)
            if backend is None:
                return 2
            sink = stack.enter_context(nullcontext(sys.stdout) if self.args.out == "-" else _open_out(self.args.out))
            recorder = MetricsRecorder()
            level, sample = self.config.log_level, self.config.log_sample
            turn_text = decode or decoder(self.encoder) if level == "debug" else None  # debug: each turn's text
            observers = (recorder, TurnLogger(level=level, sample=sample, decode=turn_text))
            engine = RolloutEngine(
                backend=backend,
                encoder=self.encoder,
                env_factory=self.make_env,
                source=self.rows,
                config=self.config.engine_config(self.encoder.stop_token_ids),
                observers=observers,
                reader=self.config.server_reader(backend, self.encoder.tokenizer),
            )
            ran.append(engine)
            async with engine, anyio.create_task_group() as view:
                if engine.exporter is not None:
                    print(f"turnstile: metrics at {engine.exporter.url}", file=sys.stderr)
                view.start_soon(LiveView(engine, recorder, total_groups=len(self.rows)).run)
                async for group in engine.stream():
                    for trajectory in group.trajectories:
                        sink.write(json.dumps(trajectory.to_record(decode), default=str) + "\n")
                        finished.append(trajectory)
                view.cancel_scope.cancel()
        _summary(finished, time.monotonic() - started, self.args.out)
        return 1 if finished and all(t.status is Status.FAILED for t in finished) else 0  # nothing succeeded


def _wait_for(left: AbandonedCalls) -> None:
    """Env calls left running in their threads (past their timeout, or interrupted): said, and waited for a
    little; `console` then exits without them."""
    if not len(left):
        return
    print(
        f"turnstile: waiting at most {EXIT_WAIT_S:g}s for {len(left)} env call(s) left running in their threads "
        f"(past their timeout, or interrupted): {left.describe()}",
        file=sys.stderr,
    )
    if not left.wait(EXIT_WAIT_S):
        print(f"turnstile: exiting; {len(left)} still running, their envs not closed", file=sys.stderr)


def _check_run(config: Settings) -> None:
    """Settings `turnstile run` would not honour, refused before anything loads."""
    if config.vision and (config.tokenizer != "qwen2.5" or config.chat_template is not None):
        raise ValueError(
            "--vision runs the embedded Qwen2.5-VL processor with its own template: "
            "--tokenizer and --chat-template are not read with it"
        )
    other = {"local": ("request_timeout_s",), "sglang": ("model", "max_batch_size")}[config.backend_kind]
    if unread := sorted(set(other) & config.model_fields_set):
        raise ValueError(f"{', '.join(unread)}: not read by the {config.backend_kind} backend")
    if config.backend_kind == "local":
        refused = replace(config.sampling, sampling_seed=config.sampling_seed_base).unsupported_locally()
        if refused:
            raise ValueError(f"the local backend cannot honour {', '.join(refused)}: give an SGLang server (--url)")


def _load_rows(args: argparse.Namespace, config: Settings) -> list[dict[str, Any]]:
    """The rows of `--prompts`, else `--num-prompts` rows from the env module's own `make_prompts`."""
    if args.prompts is None:
        make_prompts = getattr(load_env_module(config.env_path), "make_prompts", None)
        if not callable(make_prompts):
            raise ValueError(
                f"env module {config.env_path!r} has no make_prompts(n, seed=, vision=): "
                "give prompt rows with --prompts"
            )
        return make_prompts(args.num_prompts, seed=config.seed, vision=config.vision)
    rows = list(jsonl_rows(args.prompts))
    if not rows:
        raise ValueError(f"{args.prompts}: no prompt rows in the file")
    return rows


def load_encoder(config: Settings) -> ChatEncoder:
    """The tokenizer (or VLM processor) and its chat template, checked by rendering it once."""
    from engine.models import load_processor, load_tokenizer

    if config.vision:
        _need_torch("--vision (the Qwen2.5-VL processor)")
    processor = load_processor("qwen2.5-vl") if config.vision else None
    name = config.tokenizer
    if config.backend_kind == "sglang" and not config.vision and "tokenizer" not in config.model_fields_set:
        name = _server_tokenizer(config.url.split(",")[0].strip())
        print(f"turnstile: tokenizer {name} (the server's, from GET /model_info)", file=sys.stderr)
    tokenizer = processor.tokenizer if processor is not None else load_tokenizer(name, config.chat_template)
    try:
        return ChatEncoder.for_settings(tokenizer, config, processor=processor)
    except jinja2.TemplateError as exc:
        raise ValueError(f"the chat template does not render: {type(exc).__name__}: {exc}") from exc


def _need_torch(what: str) -> None:
    """One error where torch (the `torch` extra) is missing, rather than an ImportError deep in a load."""
    try:
        import torch  # noqa: F401
        import torchvision  # noqa: F401
    except ImportError as exc:
        raise ValueError(
            f"{what} needs torch and torchvision, which do not import here ({exc}): pip install 'turnstile[torch]'"
        ) from exc


def _server_tokenizer(url: str) -> str:
    """--url without --tokenizer: the tokenizer directory the server names (GET /model_info), where it is one on
    this machine; else one error saying to give it (or, where nothing answers at `url`, that the server is
    unreachable). The built-in Qwen2.5 tokenizer is never guessed."""
    try:
        reply = httpx2.get(f"{url}/model_info", timeout=10.0, trust_env=False)
        info = reply.json() if reply.status_code == 200 else None
    except httpx2.TransportError as exc:  # nothing answered: the server, not the tokenizer, is what is wrong
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else f"{type(exc).__name__} (connection closed)"
        raise ValueError(
            f"the server at {url} is unreachable: GET /model_info: {detail} (asked for its tokenizer, "
            "as --tokenizer is not given)"
        ) from exc
    except (httpx2.HTTPError, ValueError) as exc:
        info, why = None, f"{type(exc).__name__}: {exc}"
    else:
        why = f"HTTP {reply.status_code}" if info is None else "no tokenizer_path or model_path in its reply"
    if isinstance(info, Mapping):
        model, path = info.get("model_path"), info.get("tokenizer_path") or info.get("model_path")
        if isinstance(path, str) and Path(path).is_dir():
            return path
        if isinstance(path, str):
            why = f"the server serves {model!r}, whose tokenizer {path!r} is not a directory here"
    raise ValueError(
        f"--url without --tokenizer: the server's tokenizer is not known ({url}/model_info: {why}): give it with "
        "--tokenizer DIR (--tokenizer qwen2.5 for the built-in Qwen2.5 one)"
    )


def load_local_model(config: Settings) -> Any:
    """The local backend's model (None for SGLang)."""
    if config.backend_kind != "local":
        return None
    _need_torch("the local backend (no --url)")
    from engine.models import load_model

    return load_model(config.local_model, seed=config.seed)


def check_metrics(config: Settings) -> None:
    """/metrics can be served where the settings say: the host is this machine's and the port free."""
    if config.metrics_port is None:
        return
    host, port = config.metrics_host, config.metrics_port
    try:
        family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the exporter's server does
            probe.bind(address)
    except OSError as exc:
        raise ValueError(
            f"--metrics-host {host} --metrics-port {port}: cannot serve there: {exc.strerror or exc}"
        ) from exc


def check_out(out: str) -> None:
    """`--out` can be written: a file, or a path whose nearest existing folder is writable (nothing is created)."""
    if out == "-":
        return
    path = Path(out).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if existing == path and path.is_dir():
        why = "it is a directory"
    elif existing != path and not existing.is_dir():
        why = f"{existing} is not a directory"
    elif not os.access(existing, os.W_OK):
        why = f"{existing} is not writable"
    else:
        return
    raise ValueError(f"--out {out}: cannot write there: {why}")


def decoder(encoder: ChatEncoder) -> Callable[[Sequence[int]], str]:
    """Token ids to text as a person reads them: special tokens (turn ends, roles) kept."""
    tokenizer = encoder.tokenizer
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False)


async def open_backend(stack: AsyncExitStack, config: Settings, encoder: ChatEncoder, model: Any) -> Backend | None:
    """The backend, entered on `stack` (an SGLang URL is found to be a server or a router, and its workers), and
    healthy; None, its problem said on stderr, when it is not."""
    try:
        backend = await stack.enter_async_context(_backend(config, encoder, model))
        problem = await backend.health_problem()
    except BackendError as exc:
        problem = exc.message
    if problem is None:
        return backend
    print(f"turnstile: the {config.backend_kind} backend at {config.url} is not healthy: {problem}", file=sys.stderr)
    return None


def _backend(config: Settings, encoder: ChatEncoder, model: Any) -> Backend:
    if config.backend_kind == "sglang":
        from engine.backends.pool import BackendPool
        from engine.backends.sglang import SGLangBackend

        urls = [url.strip() for url in (config.url or "").split(",") if url.strip()]
        image_token_id = encoder.image_token_id
        servers = [SGLangBackend(url, timeout=config.request_timeout_s, image_token_id=image_token_id) for url in urls]
        return servers[0] if len(servers) == 1 else BackendPool(servers, policy=config.routing)
    from engine.backends.local import LocalBackend

    return LocalBackend(model, encoder.tokenizer, processor=encoder.processor, max_batch_size=config.max_batch_size)


def _open_out(out: str):
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.open("w")


def _summary(finished: list[Trajectory], seconds: float, out: str) -> None:
    generated = sum(t.num_generated for t in finished)
    turns = sum(len(t.turns) for t in finished)
    statuses = Counter(str(t.status) for t in finished)
    reasons = Counter(str(t.stop_reason) for t in finished)
    print(
        f"{len(finished)} trajectories in {seconds:.1f}s: {dict(statuses)}; stop reasons {dict(reasons)}; "
        f"{turns / max(len(finished), 1):.1f} turns each; {generated} tokens generated ({generated / seconds:.0f}/s)"
        + ("" if out == "-" else f"; written to {out}"),
        file=sys.stderr,
    )
