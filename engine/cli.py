"""`turnstile run`: multi-turn trajectories of a model against an env, one JSON line per trajectory;
`turnstile serve`: the rollout service for slime as a named Ray actor.

Runs the turn-level engine (`engine.engine.RolloutEngine`) over the prompts and writes each group's
trajectories as it finishes.

turnstile run                                   # tiny local model, built-in arithmetic env
turnstile run --vision                          # the tiny Qwen2.5-VL model, images in observations
turnstile run --backend sglang --url http://127.0.0.1:30000 --tokenizer PATH --prompts rows.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections import Counter
from contextlib import AsyncExitStack, nullcontext
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio

from engine.backends.base import Backend
from engine.config import BackendConfig, RunConfig
from engine.encoding import ChatEncoder
from engine.engine import RolloutEngine
from engine.envs.loader import EnvFactory
from engine.errors import BackendError
from engine.metrics.live import LiveView
from engine.metrics.logging import TurnLogger
from engine.metrics.recorder import MetricsRecorder
from engine.scheduler.queue import Policy
from engine.source import jsonl_rows
from engine.trajectory import StopReason, Trajectory

FAILED_REASONS = (StopReason.BACKEND_ERROR, StopReason.ENV_ERROR)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="turnstile", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run trajectories and write them as JSON lines")
    run.add_argument("--config", help="a YAML file of RunConfig settings (flags override it)")
    run.add_argument("--num-prompts", type=int, default=16, help="prompts of the built-in env (default 16)")
    run.add_argument("--prompts", help="a JSONL file of rows {prompt: [messages], label, metadata} instead")
    run.add_argument("--out", default="out/trajectories.jsonl", help="where the JSON lines go ('-' for stdout)")
    run.add_argument("--backend", choices=["local", "sglang"])
    run.add_argument("--url", help="SGLang server or sglang-router URL, or several, comma-separated (--backend sglang)")
    run.add_argument("--model", help="local backend: tiny-qwen2, tiny-qwen2.5-vl or a model directory")
    for flag in ("tokenizer", "chat-template", "env-path"):
        run.add_argument(f"--{flag}")
    run.add_argument("--policy", choices=[p.value for p in Policy], help="which ready turn goes next")
    run.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="turn logs (default warning)")
    run.add_argument("--vision", action="store_true", default=None, help="VLM: Qwen2.5-VL processor and model")
    numbers = {"max-turns": int, "max-tokens": int, "max-new-tokens": int, "max-context-len": int,
               "temperature": float, "seed": int, "env-step-timeout": float, "n-samples-per-prompt": int,
               "max-inflight": int, "max-generating": int, "max-env-steps": int, "metrics-port": int,
               "log-sample": float}  # fmt: skip
    for flag, kind in numbers.items():
        run.add_argument(f"--{flag}", type=kind)
    serve = commands.add_parser("serve", help="start the rollout service as a named Ray actor")
    serve.add_argument(
        "--name", help="the actor's name, namespace `turnstile` (default: the YAML's ray_actor, else turnstile-rollout)"
    )
    serve.add_argument("--config", help="a YAML as slime's --custom-config-path takes (its `turnstile:` section)")
    serve.add_argument("--detach", action="store_true", help="leave the actor running and return")
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    try:
        config = _config_from(args)
        rows = _load_rows(args, config)
        make_env = EnvFactory(
            config.env_path, args=SimpleNamespace(**config.model_dump()), step_timeout=config.env_step_timeout
        )
    except (ValueError, OSError) as exc:  # bad settings, prompts or env: one error naming it
        parser.error(str(exc))
    try:
        return anyio.run(_run, config, rows, make_env, args.out)
    except BackendError as exc:  # the backend failed outside any trajectory (as the engine started): one line
        print(f"turnstile: {exc.message}", file=sys.stderr)
        return 2


def _serve(args: argparse.Namespace) -> int:
    """Start (or attach to) the named service actor; without --detach, hold it until interrupted."""
    import signal
    import threading

    import ray
    import yaml

    from bridge.ray_actor import NAMESPACE, attach_or_create
    from bridge.settings import settings_from_args

    values = yaml.safe_load(Path(args.config).read_text()) if args.config else {}
    slime_args = SimpleNamespace(**(values or {}))
    settings = settings_from_args(slime_args)
    name = args.name or settings.turnstile.ray_actor or "turnstile-rollout"
    if args.detach and not ray.is_initialized():
        try:  # a detached actor outlives this process only on a cluster that does too
            ray.init(address="auto", namespace=NAMESPACE)
        except ConnectionError:
            message = "serve --detach needs a running Ray cluster; start one with `ray start --head`"
            print(f"turnstile: {message}", file=sys.stderr)
            return 2
    service = attach_or_create(name, settings, slime_args)
    print(f"turnstile: service {name!r} is up: {json.dumps(service.status())}", file=sys.stderr)
    if args.detach:
        return 0
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with contextlib.suppress(KeyboardInterrupt):
        stop.wait()
    service.shutdown()
    return 0


def _config_from(args: argparse.Namespace) -> RunConfig:
    skip = {"command", "config", "num_prompts", "prompts", "out", "backend", "url", "model"}
    overrides = {k: v for k, v in vars(args).items() if k not in skip and v is not None}
    base = RunConfig.from_yaml(args.config) if args.config else RunConfig()
    backend = base.backend.model_dump()
    backend.update({k: v for k, v in (("kind", args.backend), ("url", args.url), ("model", args.model)) if v})
    if overrides.get("vision") and not args.model and backend.get("kind") == "local":
        backend["model"] = "tiny-qwen2.5-vl"
    return RunConfig.model_validate({**base.model_dump(), **overrides, "backend": BackendConfig(**backend)})


def _load_rows(args: argparse.Namespace, config: RunConfig) -> list[dict[str, Any]]:
    if args.prompts is None:
        from engine.envs.arith import make_prompts

        return make_prompts(args.num_prompts, seed=config.seed, vision=config.vision)
    return list(jsonl_rows(args.prompts))


async def _run(config: RunConfig, rows: list[dict[str, Any]], make_env: EnvFactory, out: str) -> int:
    from engine.models import load_processor, load_tokenizer

    processor = load_processor("qwen2.5-vl") if config.vision else None
    tokenizer = processor.tokenizer if processor is not None else load_tokenizer(config.tokenizer, config.chat_template)
    encoder = ChatEncoder(tokenizer, processor=processor)
    finished: list[Trajectory] = []
    started = time.monotonic()
    async with AsyncExitStack() as stack:
        try:  # an SGLang URL is found to be a server or a router (and its workers) on entering
            backend = await stack.enter_async_context(_backend(config, encoder))
            is_healthy, why = await backend.health(), ""
        except BackendError as exc:
            is_healthy, why = False, f": {exc.message}"
        if not is_healthy:
            where = f"the {config.backend.kind} backend at {config.backend.url}"
            print(f"turnstile: {where} is not healthy{why}", file=sys.stderr)
            return 2
        sink = stack.enter_context(nullcontext(sys.stdout) if out == "-" else _open_out(out))
        recorder = MetricsRecorder()
        observers = (recorder, TurnLogger(level=config.log_level, sample=config.log_sample))
        engine = RolloutEngine(
            backend=backend,
            encoder=encoder,
            env_factory=make_env,
            source=rows,
            config=config.engine(encoder.stop_token_ids),
            observers=observers,
        )
        async with engine, anyio.create_task_group() as view:
            if engine.exporter is not None:
                print(f"turnstile: metrics at {engine.exporter.url}", file=sys.stderr)
            view.start_soon(LiveView(engine, recorder, total_groups=len(rows)).run)
            async for group in engine.stream():
                for trajectory in group.trajectories:
                    sink.write(json.dumps(trajectory.to_record(), default=str) + "\n")
                finished.extend(group.trajectories)
            view.cancel_scope.cancel()
    _summary(finished, time.monotonic() - started, out)
    return 1 if finished and all(t.stop_reason in FAILED_REASONS for t in finished) else 0


def _backend(config: RunConfig, encoder: ChatEncoder) -> Backend:
    if config.backend.kind == "sglang":
        from engine.backends.pool import BackendPool
        from engine.backends.sglang import SGLangBackend

        urls = [url.strip() for url in config.backend.url.split(",") if url.strip()]
        image_token_id = encoder.image_token_id
        servers = [SGLangBackend(url, timeout=config.backend.timeout, image_token_id=image_token_id) for url in urls]
        return servers[0] if len(servers) == 1 else BackendPool(servers)
    from engine.backends.local import LocalBackend
    from engine.models import load_model

    model = load_model(config.backend.model, seed=config.seed)
    return LocalBackend(
        model, encoder.tokenizer, processor=encoder.processor, max_batch_size=config.backend.max_batch_size
    )


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


if __name__ == "__main__":
    sys.exit(main())
