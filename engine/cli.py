"""`turnstile run`: multi-turn trajectories of a model against an env, one JSON line per trajectory;
`turnstile gateway`: the session gateway for agent programs and CLIs, as a standing server (engine/gateway_command.py);
`turnstile serve`: the rollout service for slime as a named Ray actor;
`turnstile check-template`: whether delta encoding is exact for a tokenizer's chat template;
`turnstile show`: a JSON lines file's trajectories, turn by turn (engine/show.py).

This module holds the parser and the settings it builds; `turnstile run` itself is engine/run.py.

turnstile run                                   # tiny local model, built-in arithmetic env
turnstile run --vision                          # the tiny Qwen2.5-VL model, images in observations
turnstile run --env python_tool                 # a built-in env by short name (engine/envs/builtin.py)
turnstile run --backend sglang --url http://127.0.0.1:30000 --tokenizer PATH --prompts rows.jsonl
turnstile run --agent-command 'claude -p {prompt}' --prompts tasks.jsonl   # an agent CLI per sample
turnstile gateway                               # agents' sessions of the embedded model, at 127.0.0.1:8100
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
from collections.abc import Callable, Mapping
from enum import Enum
from types import SimpleNamespace, UnionType
from typing import Annotated, Any, Literal, NoReturn, Union, get_args, get_origin

from pydantic import ValidationError
from pydantic.fields import FieldInfo

from engine import gateway_command, show, template_check
from engine.config import RETRY_FLAGS, Flag, Settings, load_yaml, marker, problems, read_yaml
from engine.gateway_command import GatewayCommand
from engine.run import Run
from engine.scheduler.retry import RetryPolicy

SETTINGS_EPILOG = "Every setting, its default and what it does: docs/settings.md (python -m engine.config)."
# `turnstile run`'s own options, which its --config YAML may give by name too (a flag overrides it), and defaults
RUN_OPTIONS: dict[str, Any] = {"num_prompts": 16, "prompts": None, "out": "out/trajectories.jsonl", "text": True}


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
    command = GatewayCommand if args.command == "gateway" else Run
    try:  # everything a run (or a gateway) reads is checked, and loaded, before it starts
        loaded = command.load(settings_from_flags(args), args)
    except (ValueError, OSError) as exc:  # bad settings, prompts, env, tokenizer, template, model: one error
        _refuse(_describe(exc))
    return loaded.execute()


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
    default_prompts = RUN_OPTIONS["num_prompts"]
    run.add_argument(
        "--num-prompts", type=_positive, help=f"rows from the env's make_prompts (default: {default_prompts})"
    )
    run.add_argument("--prompts", help="a JSONL file of rows {prompt: [messages], label, metadata} instead")
    run.add_argument("--out", help=f"where the JSON lines go ('-' for stdout; default: {RUN_OPTIONS['out']})")
    run.add_argument(
        "--no-text",
        dest="text",
        action="store_false",
        default=None,
        help="leave the decoded text (prompt, each turn's response and observation) out of the JSON lines",
    )
    _add_settings_flags(run)
    gateway = commands.add_parser(
        "gateway",
        help="serve agent programs and CLIs (Claude Code, Codex) sessions of the policy, over the embedded model "
        "or --url",
        usage="turnstile gateway [--url URL] [--host HOST] [--port PORT] [options]",
        description=gateway_command.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=SETTINGS_EPILOG,
        allow_abbrev=False,  # `--env`, which it does not take, is not `--env-...`
    )
    gateway.add_argument("--config", help="a YAML file of settings, flat keys (flags override it)")
    gateway_command.add_arguments(gateway)
    _add_settings_flags(gateway, leave_out=gateway_command.NOT_READ, retry=False)
    serve = commands.add_parser("serve", help="start the rollout service as a named Ray actor")
    serve.add_argument(
        "--name", help="the actor's name, namespace `turnstile` (default: the YAML's ray_actor, else turnstile-rollout)"
    )
    serve.add_argument("--config", help="a YAML as slime's --custom-config-path takes (its `turnstile:` section)")
    serve.add_argument("--detach", action="store_true", help="leave the actor running and return")
    serve.add_argument(
        "--shards", type=int, help="run the rollout on this many shards, each a Ray actor <name>-shard-<i> "
        "(default: the YAML's shards, else 1)",
    )  # fmt: skip
    check = commands.add_parser(
        "check-template", help="say whether delta encoding is exact for a chat template (exit 0), or where it drifts"
    )
    template_check.add_arguments(check)
    view = commands.add_parser("show", help="print trajectories of a JSON lines file, turn by turn")
    show.add_arguments(view)
    for command in (run, gateway, serve, check, view):
        command.set_defaults(command_parser=command)
    return parser


def _add_settings_flags(
    parser: argparse.ArgumentParser, leave_out: tuple[str, ...] = (), *, retry: bool = True
) -> None:
    """A flag per knob marked as one in engine.config (those in `leave_out` excepted), and the retry flags."""
    for name, field in Settings.model_fields.items():
        if marker(field, Flag) is not None and name not in leave_out:
            _add_flag(parser, name, field)
    for name, flag in RETRY_FLAGS.items() if retry else ():
        _add_flag(parser, flag.replace("-", "_"), RetryPolicy.model_fields[name])


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
        if args.shards is not None:
            settings = settings.model_validate({**settings.model_dump(), "shards": args.shards})
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
    if settings.shards > 1:
        from bridge.shards import ray_shards

        service = ray_shards(settings.model_copy(update={"ray_actor": name}), slime_args)
        name = f"{name}-shard-0 .. {settings.shards - 1}"
    else:
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


class _NotGiven:
    """The value of a knob's flag left out (`None` is a value: `--metrics-port none`)."""

    def __repr__(self) -> str:
        return "NOT_GIVEN"


NOT_GIVEN: Any = _NotGiven()


def _add_flag(parser: argparse.ArgumentParser, dest: str, field: FieldInfo) -> None:
    """`--dest` (dashed) for the knob `field`: its type, choices and description; `none` where the knob may be
    None. A flag left out (NOT_GIVEN) leaves the YAML's value or the knob's default."""
    kind = _scalar(field.annotation)
    flag = marker(field, Flag)
    names = ["--" + name.replace("_", "-") for name in (*(flag.aliases if flag else ()), dest)]
    description = f"{field.description} (default: {_shown(field.default)})".replace("%", "%%")
    options: dict[str, Any] = {"dest": dest, "default": NOT_GIVEN, "help": description}
    if kind is bool:
        options["action"] = "store_true"
    elif get_origin(kind) is Literal:
        options["choices"] = list(get_args(kind))
    elif isinstance(kind, type) and issubclass(kind, Enum):
        options["choices"] = [member.value for member in kind]
    else:
        options["type"] = kind
    if kind is not bool and _takes_none(field.annotation):
        options["type"] = _or_none(options.get("type", str))
        if "choices" in options:
            options["choices"] = _ChoicesOrNone(options["choices"])
    parser.add_argument(*names, **options)


def _scalar(annotation: Any) -> Any:
    """The type a flag parses: `annotation` without None and without Annotated constraints."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) in (Union, UnionType):
        (annotation,) = [a for a in get_args(annotation) if a is not type(None)]
        return _scalar(annotation)
    return annotation


def _takes_none(annotation: Any) -> bool:
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return get_origin(annotation) in (Union, UnionType) and type(None) in get_args(annotation)


def _shown(default: Any) -> Any:
    """A default as the flag is given it: `none` for None."""
    return "none" if default is None else default


def _or_none(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    """`kind`, or None for `none`; named as `kind` in argparse's `invalid int value` errors."""

    def parse(text: str) -> Any:
        return None if text.lower() == "none" else kind(text)

    parse.__name__ = getattr(kind, "__name__", "value")
    return parse


class _ChoicesOrNone(list):
    """A choice flag's choices and `none` (shown so in its help and errors), which parses to None."""

    def __init__(self, choices: list[Any]):
        super().__init__([*choices, "none"])

    def __contains__(self, value: object) -> bool:
        return value is None or super().__contains__(value)


def settings_from_flags(args: argparse.Namespace) -> Settings:
    """The defaults, under the YAML of `--config`, under the flags given."""
    values = read_yaml(args.config, Settings, "run", own=set(RUN_OPTIONS)) if args.config else {}
    num_prompts = values.get("num_prompts", 1)
    if isinstance(num_prompts, bool) or not isinstance(num_prompts, int) or num_prompts < 1:
        raise ValueError(f"{args.config}: num_prompts: must be a whole number of at least 1, got {num_prompts!r}")
    for name, default in RUN_OPTIONS.items():  # the run's own options: a flag, else the YAML, else the default
        value = values.pop(name, default)
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    from_yaml = set(values)  # the knobs whose values the YAML gives, unless a flag overrides them below
    for name, field in Settings.model_fields.items():
        if marker(field, Flag) is not None and getattr(args, name, NOT_GIVEN) is not NOT_GIVEN:
            values[name] = getattr(args, name)
            from_yaml.discard(name)
    retry = {name: getattr(args, flag.replace("-", "_"), NOT_GIVEN) for name, flag in RETRY_FLAGS.items()}
    retry = {name: value for name, value in retry.items() if value is not NOT_GIVEN}
    given = values.get("retry") or {}
    if retry and isinstance(given, Mapping):  # a flag sets one retry knob; the YAML's others stay
        values["retry"] = {**given, **retry}
        from_yaml.discard("retry")
    try:
        return Settings.model_validate(values)
    except ValidationError as exc:  # each problem named by where its value came from
        raise ValueError(problems(exc, lambda knob: f"{args.config}: {knob}" if knob in from_yaml else knob)) from exc


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _describe(exc: Exception) -> str:
    """The error as one line: pydantic's as `key: why (given value)` per problem, anything else as its text."""
    return problems(exc) if isinstance(exc, ValidationError) else str(exc)


if __name__ == "__main__":
    console()
