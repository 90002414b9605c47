"""`turnstile run`: multi-turn trajectories of a model against an env, one JSON line per trajectory;
`turnstile serve`: the rollout service for slime as a named Ray actor;
`turnstile check-template`: whether delta encoding is exact for a tokenizer's chat template.

Runs the turn-level engine (`engine.engine.RolloutEngine`) over the prompts and writes each group's
trajectories as it finishes.

turnstile run                                   # tiny local model, built-in arithmetic env
turnstile run --vision                          # the tiny Qwen2.5-VL model, images in observations
turnstile run --env python_tool                 # a built-in env by short name (engine/envs/builtin.py)
turnstile run --backend sglang --url http://127.0.0.1:30000 --tokenizer PATH --prompts rows.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from contextlib import AsyncExitStack, nullcontext
from dataclasses import replace
from enum import Enum
from pathlib import Path
from types import SimpleNamespace, UnionType
from typing import Annotated, Any, Literal, NoReturn, Union, get_args, get_origin

import anyio
import httpx2
import jinja2
from pydantic import ValidationError
from pydantic.fields import FieldInfo

from engine import show, template_check
from engine.backends.base import Backend
from engine.config import RETRY_FLAGS, Flag, Settings, load_yaml, marker, problems, read_yaml
from engine.encoding import ChatEncoder
from engine.engine import RolloutEngine
from engine.envs.base import AbandonedCalls
from engine.envs.loader import EnvFactory, hosted, load_env_module
from engine.errors import BackendError
from engine.metrics.live import LiveView
from engine.metrics.logging import TurnLogger
from engine.metrics.recorder import MetricsRecorder
from engine.scheduler.retry import RetryPolicy
from engine.source import jsonl_rows
from engine.trajectory import Status, Trajectory

SETTINGS_EPILOG = "Every setting, its default and what it does: docs/settings.md (python -m engine.config)."
# `turnstile run`'s own options, which its --config YAML may give by name too (a flag overrides it), and defaults
RUN_OPTIONS: dict[str, Any] = {"num_prompts": 16, "prompts": None, "out": "out/trajectories.jsonl", "text": True}
EXIT_WAIT_S = 3.0  # at exit, how long to wait for env calls still running past their timeout


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # told by the command's own parser, after its own (short) usage line
        args.command_parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "serve":
        return _serve(args)
    if args.command == "check-template":
        return template_check.main(args)
    if args.command == "show":
        return show.main(args)
    try:  # everything a run reads is checked, and loaded, before it starts
        config = settings_from_flags(args)
        _check_run(config)
        _check_out(args.out)
        _check_metrics(config)
        make_env = EnvFactory(
            config.env_path, args=SimpleNamespace(**config.model_dump()), step_timeout=config.retry.env_step_timeout_s
        )
        rows = _load_rows(args, config)  # after the env module is checked: its make_prompts, if no --prompts
        encoder = _encoder(config)
        model = _local_model(config)
        make_env = hosted(
            make_env,
            env_workers=config.env_workers,
            capacity=config.env_worker_capacity,
            ray_address=config.ray_address,
        )
    except (ValueError, OSError) as exc:  # bad settings, prompts, env, tokenizer, template, model: one error
        _refuse(_describe(exc))
    ran: list[RolloutEngine] = []  # the engine, once built: what it leaves running is said at exit
    try:
        return anyio.run(_run, config, rows, make_env, args, encoder, model, ran)
    except BackendError as exc:  # the backend failed outside any trajectory (as the engine started): one line
        print(f"turnstile: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        where = "" if args.out == "-" else f"; the trajectories that ended are in {args.out}"
        print(f"turnstile: interrupted{where}", file=sys.stderr)
        return 130
    finally:
        make_env.close()  # env workers, when the envs run in them
        if ran:
            _wait_for(ran[0].abandoned_env_calls)


def console() -> None:
    """The `turnstile` command. Once `main` has returned (and said what it leaves running), the process
    exits without waiting for threads still running: an env call past its timeout is not worth a hang."""
    try:
        code = main()
    except KeyboardInterrupt:  # before the run started (loading a model, say)
        print("turnstile: interrupted", file=sys.stderr)
        code = 130
    sys.stdout.flush()
    sys.stderr.flush()
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        os._exit(code)
    sys.exit(code)


def _refuse(message: str) -> NoReturn:
    """One error about the run's input, and exit status 2, before anything starts."""
    print(f"turnstile: error: {message}", file=sys.stderr)
    raise SystemExit(2)


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


def build_parser() -> argparse.ArgumentParser:
    """`turnstile run`'s options: its own, and one per knob marked as a flag in engine.config; `serve`'s."""
    parser = argparse.ArgumentParser(
        prog="turnstile", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "run",
        help="run trajectories and write them as JSON lines",
        usage="turnstile run [--config FILE] [--env NAME] [--prompts FILE] [--url URL] [options]",
        epilog=SETTINGS_EPILOG,
    )
    run.add_argument(
        "--config", help="a YAML file of settings, flat keys, and of the options below by name (flags override it)"
    )
    run.add_argument("--num-prompts", type=_positive, help=f"rows from the env's make_prompts (default: {RUN_OPTIONS['num_prompts']})")
    run.add_argument("--prompts", help="a JSONL file of rows {prompt: [messages], label, metadata} instead")
    run.add_argument("--out", help=f"where the JSON lines go ('-' for stdout; default: {RUN_OPTIONS['out']})")
    run.add_argument(
        "--no-text",
        dest="text",
        action="store_false",
        default=None,
        help="leave the decoded text (prompt, each turn's response and observation) out of the JSON lines",
    )
    for name, field in Settings.model_fields.items():
        if marker(field, Flag) is not None:
            _add_flag(run, name, field)
    for name, flag in RETRY_FLAGS.items():
        _add_flag(run, flag.replace("-", "_"), RetryPolicy.model_fields[name])
    serve = commands.add_parser("serve", help="start the rollout service as a named Ray actor")
    serve.add_argument(
        "--name", help="the actor's name, namespace `turnstile` (default: the YAML's ray_actor, else turnstile-rollout)"
    )
    serve.add_argument("--config", help="a YAML as slime's --custom-config-path takes (its `turnstile:` section)")
    serve.add_argument("--detach", action="store_true", help="leave the actor running and return")
    check = commands.add_parser(
        "check-template", help="say whether delta encoding is exact for a chat template (exit 0), or where it drifts"
    )
    template_check.add_arguments(check)
    view = commands.add_parser("show", help="print trajectories of a JSON lines file, turn by turn")
    show.add_arguments(view)
    for command in (run, serve, check, view):
        command.set_defaults(command_parser=command)
    return parser


def _serve(args: argparse.Namespace) -> int:
    """Start (or attach to) the named service actor; without --detach, hold it until interrupted."""
    import signal
    import threading

    from bridge.settings import settings_from_args

    try:
        values = (load_yaml(args.config) if args.config else None) or {}
        if not isinstance(values, Mapping):
            raise ValueError(f"{args.config}: expected a mapping, got {type(values).__name__}")
        slime_args = SimpleNamespace(**values)
        settings = settings_from_args(slime_args)
    except (ValueError, OSError) as exc:  # one error naming the file, the key or the value
        print(f"turnstile: {_describe(exc)}", file=sys.stderr)
        return 2

    import ray

    from bridge.ray_actor import NAMESPACE, attach_or_create

    name = args.name or settings.ray_actor or "turnstile-rollout"
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


def _add_flag(parser: argparse.ArgumentParser, dest: str, field: FieldInfo) -> None:
    """`--dest` (dashed) for the knob `field`: its type, choices and description. A flag left out leaves
    the YAML's value or the knob's default."""
    kind = _scalar(field.annotation)
    flag = marker(field, Flag)
    names = ["--" + name.replace("_", "-") for name in (*(flag.aliases if flag else ()), dest)]
    description = f"{field.description} (default: {field.default})".replace("%", "%%")
    options: dict[str, Any] = {"dest": dest, "default": None, "help": description}
    if kind is bool:
        options["action"] = "store_true"
    elif get_origin(kind) is Literal:
        options["choices"] = list(get_args(kind))
    elif isinstance(kind, type) and issubclass(kind, Enum):
        options["choices"] = [member.value for member in kind]
    else:
        options["type"] = kind
    parser.add_argument(*names, **options)


def _scalar(annotation: Any) -> Any:
    """The type a flag parses: `annotation` without None and without Annotated constraints."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) in (Union, UnionType):
        (annotation,) = [a for a in get_args(annotation) if a is not type(None)]
        return _scalar(annotation)
    return annotation


def settings_from_flags(args: argparse.Namespace) -> Settings:
    """The defaults, under the YAML of `--config`, under the flags given."""
    values = read_yaml(args.config, Settings, "run", own=set(RUN_OPTIONS)) if args.config else {}
    given = values.get("num_prompts", 1)
    if isinstance(given, bool) or not isinstance(given, int) or given < 1:
        raise ValueError(f"{args.config}: num_prompts: must be a whole number of at least 1, got {given!r}")
    for name, default in RUN_OPTIONS.items():  # the run's own options: a flag, else the YAML, else the default
        value = values.pop(name, default)
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    given_in_yaml = set(values)
    for name, field in Settings.model_fields.items():
        if marker(field, Flag) is not None and getattr(args, name) is not None:
            values[name] = getattr(args, name)
    retry = {name: getattr(args, flag.replace("-", "_")) for name, flag in RETRY_FLAGS.items()}
    retry = {name: value for name, value in retry.items() if value is not None}
    given = values.get("retry") or {}
    if retry and isinstance(given, Mapping):  # a flag sets one retry knob; the YAML's others stay
        values["retry"] = {**given, **retry}
    try:
        return Settings.model_validate(values)
    except ValidationError as exc:  # each problem named by where its value came from
        flags = {name for name, field in Settings.model_fields.items() if marker(field, Flag) and getattr(args, name) is not None}
        from_yaml = given_in_yaml - flags - ({"retry"} if retry else set())
        raise ValueError(problems(exc, lambda knob: f"{args.config}: {knob}" if knob in from_yaml else knob)) from exc


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _describe(exc: Exception) -> str:
    """The error as one line: pydantic's as `key: why (given value)` per problem, anything else as its text."""
    return problems(exc) if isinstance(exc, ValidationError) else str(exc)


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


def _encoder(config: Settings) -> ChatEncoder:
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
        return ChatEncoder(tokenizer, processor=processor, chat_template_kwargs=config.chat_template_kwargs)
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
    this machine; else one error saying to give it. The built-in Qwen2.5 tokenizer is never guessed."""
    try:
        reply = httpx2.get(f"{url}/model_info", timeout=10.0, trust_env=False)
        info = reply.json() if reply.status_code == 200 else None
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


def _local_model(config: Settings) -> Any:
    """The local backend's model (None for SGLang)."""
    if config.backend_kind != "local":
        return None
    _need_torch("the local backend (no --url)")
    from engine.models import load_model

    return load_model(config.local_model, seed=config.seed)


def _check_metrics(config: Settings) -> None:
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


def _check_out(out: str) -> None:
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


async def _run(
    config: Settings,
    rows: list[dict[str, Any]],
    make_env: EnvFactory,
    args: argparse.Namespace,
    encoder: ChatEncoder,
    model: Any,
    ran: list[RolloutEngine],
) -> int:
    finished: list[Trajectory] = []
    started = time.monotonic()
    decode = _decoder(encoder) if args.text else None
    async with AsyncExitStack() as stack:
        try:  # an SGLang URL is found to be a server or a router (and its workers) on entering
            backend = await stack.enter_async_context(_backend(config, encoder, model))
            problem = await backend.health_problem()
        except BackendError as exc:
            problem = exc.message
        if problem is not None:
            print(f"turnstile: the {config.backend_kind} backend at {config.url} is not healthy: {problem}", file=sys.stderr)
            return 2
        sink = stack.enter_context(nullcontext(sys.stdout) if args.out == "-" else _open_out(args.out))
        recorder = MetricsRecorder()
        observers = (recorder, TurnLogger(level=config.log_level, sample=config.log_sample))
        engine = RolloutEngine(
            backend=backend,
            encoder=encoder,
            env_factory=make_env,
            source=rows,
            config=config.engine_config(encoder.stop_token_ids),
            observers=observers,
        )
        ran.append(engine)
        async with engine, anyio.create_task_group() as view:
            if engine.exporter is not None:
                print(f"turnstile: metrics at {engine.exporter.url}", file=sys.stderr)
            view.start_soon(LiveView(engine, recorder, total_groups=len(rows)).run)
            async for group in engine.stream():
                for trajectory in group.trajectories:
                    sink.write(json.dumps(trajectory.to_record(decode), default=str) + "\n")
                finished.extend(group.trajectories)
            view.cancel_scope.cancel()
    _summary(finished, time.monotonic() - started, args.out)
    return 1 if finished and all(t.status is Status.FAILED for t in finished) else 0  # nothing succeeded


def _decoder(encoder: ChatEncoder) -> Callable[[Sequence[int]], str]:
    """Token ids to text as a person reads them: special tokens (turn ends, roles) kept."""
    tokenizer = encoder.tokenizer
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False)


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


if __name__ == "__main__":
    console()
