"""`turnstile check-template`: is delta encoding exact for a chat template, and if not, where and why.

The engine never re-renders a conversation: it encodes the prompt once, appends the model's tokens as
generated and each observation as a delta (`engine.encoding`). That equals the template's render of the
whole conversation only when the template appends. Templates that rewrite earlier turns (Qwen3 drops
the reasoning of replies before the last user message; Llama trims the model's text), move the system
prompt, force roles to alternate or raise on a message shape make frameworks that re-render drift
silently, and make the engine's drift check fire or its encoding fail.

This module builds the trajectories the engine would build, with the engine's own turn steps
(`engine.turn`: encode the prompt, append the model's reply, append the observation) over a replayed
model, for a set of conversation shapes (`engine.template_drift.SCENARIOS`; images when a processor is
given), re-renders the conversation after every turn with `ChatEncoder.drift_check`, and for the first
difference says where, why (`engine.template_drift.Cause`) and what the engine does about it.

    target = load_target("path/to/tokenizer")        # a directory, a .jinja file, "qwen2.5" or "qwen2.5-vl"
    report = check_template(target)
    print(report.describe()); sys.exit(report.exit_code)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import anyio

from engine.backends.base import GenerateResult, SamplingParams
from engine.encoding import ChatEncoder
from engine.template_drift import (
    ENGINE_DOES,
    NUM_TURNS,
    SCENARIOS,
    Cause,
    Finding,
    Scenario,
    TemplateReport,
    cause_of_error,
    classify,
    tools_are_rendered,
)
from engine.trajectory import Trajectory
from engine.turn import TurnLimits, encode_prompt, generate_turn, observe

LIMITS = TurnLimits(max_turns=NUM_TURNS, max_tokens=1_000_000)
CONTROL_TOKEN = re.compile(r"<\|[A-Za-z0-9_]+\|>")  # the `<|eot_id|>` kind: written by a template, one token each


class TemplateInputError(ValueError):
    """The input is not a template that can be checked (no such file, not Jinja, does not render)."""


@dataclass(frozen=True, slots=True)
class Target:
    """What is checked: a tokenizer (or a VLM processor and its tokenizer), and how it was found."""

    name: str
    tokenizer: Any
    processor: Any = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # as the engine's chat_template_kwargs
    notes: tuple[str, ...] = ()


# -- loading ----------------------------------------------------------------------------------------------
def load_target(
    spec: str,
    *,
    chat_template: str | None = None,
    vision: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> Target:
    """A tokenizer or processor directory, a `.jinja` file over the embedded Qwen vocabulary (the embedded
    Qwen2.5-VL processor with `vision`), or "qwen2.5" / "qwen2.5-vl". `chat_template` (a file) replaces the
    template of a directory. Raises TemplateInputError naming what is wrong, before or after loading (a
    template that does not render one user message)."""
    target = _load(spec, chat_template, vision)
    target = replace(target, template_kwargs=dict(template_kwargs or {}))
    _check_renders(target)
    return target


def _load(spec: str, chat_template: str | None, vision: bool) -> Target:
    from engine.models import load_processor, load_tokenizer

    override = None if chat_template is None else _read_jinja(Path(chat_template))
    path = Path(spec)
    if vision and not path.is_file():
        raise TemplateInputError(f"{spec}: --vision applies to a .jinja file (a directory brings its own processor)")
    if spec in ("qwen2.5", "qwen2.5-vl") or path.is_dir():
        try:
            if spec == "qwen2.5-vl" or (path.is_dir() and _is_processor_dir(path)):
                processor = load_processor(spec)
                _set_template(processor, override)
                target = Target(spec, processor.tokenizer, processor)
            else:
                target = Target(spec, load_tokenizer(spec, chat_template=override))
        except (OSError, ValueError) as exc:
            raise TemplateInputError(f"{spec}: does not load as a tokenizer or processor: {exc}") from exc
    elif path.is_file():
        if override is not None:
            raise TemplateInputError(f"{spec} is a template already; --chat-template replaces a directory's")
        template = _read_jinja(path)
        if vision:
            processor = load_processor("qwen2.5-vl")
            _set_template(processor, template)
            target = Target(spec, processor.tokenizer, processor)
        else:
            target = Target(spec, load_tokenizer("qwen2.5", chat_template=template))
        added = _add_control_tokens(target.tokenizer, template)
        vocabulary = "the embedded Qwen2.5-VL processor" if vision else "the embedded Qwen vocabulary"
        extra = f"; control tokens it lacks, added as special tokens: {' '.join(added)}" if added else ""
        return replace(target, notes=(f"rendered with {vocabulary}{extra}",))
    else:
        raise TemplateInputError(f"{spec}: no such file or directory (nor 'qwen2.5' / 'qwen2.5-vl')")
    return target


def _read_jinja(path: Path) -> str:
    if not path.is_file():
        raise TemplateInputError(f"{path}: no such file")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise TemplateInputError(f"{path}: not a readable text file: {exc}") from exc
    if "{{" not in text and "{%" not in text:
        raise TemplateInputError(f"{path}: not a chat template (no Jinja `{{{{ }}}}` or `{{% %}}` in it)")
    return text


def _is_processor_dir(path: Path) -> bool:
    return any((path / name).is_file() for name in ("processor_config.json", "preprocessor_config.json"))


def _set_template(processor: Any, template: str | None) -> None:
    if template is not None:
        processor.chat_template = processor.tokenizer.chat_template = template


def _add_control_tokens(tokenizer: Any, template: str) -> list[str]:
    """The template's `<|...|>` literals the vocabulary lacks, added as special tokens (Llama's headers over
    the Qwen vocabulary), so the check sees the template's structure and not a foreign vocabulary's."""
    vocab = tokenizer.get_vocab()
    missing = sorted(set(CONTROL_TOKEN.findall(template)) - set(vocab))
    if missing:
        tokenizer.add_special_tokens({"additional_special_tokens": missing}, replace_extra_special_tokens=False)
    return missing


def _check_renders(target: Target) -> None:
    """The simplest conversation, one user message, must render; anything else is not a usable template."""
    renderer = target.processor if target.processor is not None else target.tokenizer
    if not getattr(renderer, "chat_template", None):
        raise TemplateInputError(f"{target.name}: has no chat template (give one with --chat-template FILE)")
    try:
        renderer.apply_chat_template(
            [{"role": "user", "content": "Hello"}],
            tokenize=False,
            add_generation_prompt=True,
            **target.template_kwargs,
        )
    except Exception as exc:  # noqa: BLE001 -- Jinja syntax, a raise_exception, a missing filter: all unusable
        raise TemplateInputError(
            f"{target.name}: the chat template does not render a one-message conversation: {type(exc).__name__}: {exc}"
        ) from exc


# -- checking ---------------------------------------------------------------------------------------------
def check_template(target: Target) -> TemplateReport:
    """Every scenario (those with images only when the target has a processor), and notes on what the
    template ignores."""
    notes = list(target.notes)
    if target.template_kwargs:
        notes.append(f"template kwargs: {json.dumps(target.template_kwargs)}")
    scenarios = [s for s in SCENARIOS if target.processor is not None or not s.images]
    if target.processor is None:
        notes.append("images not checked: a tokenizer, not a processor (give a processor directory, or --vision)")
    findings = [_check_scenario(target, scenario) for scenario in scenarios]
    renderer = target.processor if target.processor is not None else target.tokenizer
    if tools_are_rendered(renderer, target.template_kwargs) is False:
        notes.append("the template ignores the tools list: tools given to the engine never reach the model")
    return TemplateReport(target.name, findings, notes)


def _check_scenario(target: Target, scenario: Scenario) -> Finding:
    try:
        encoder = ChatEncoder(
            target.tokenizer,
            processor=target.processor,
            tools=scenario.tools,
            chat_template_kwargs=target.template_kwargs,
        )
    except Exception as exc:  # noqa: BLE001 -- any error here is the engine refusing the template
        return _raised(scenario, "encoder", exc, "the dummy conversation the encoder probes (system, user, assistant)")
    return anyio.run(_run_scenario, encoder, scenario)


async def _run_scenario(encoder: ChatEncoder, scenario: Scenario) -> Finding:
    """The engine's steps, turn by turn; after each observation (and at the end) the conversation is
    re-rendered and compared with the trajectory."""
    trajectory = Trajectory(prompt=scenario.prompt())
    replies = [encoder.tokenizer(text, add_special_tokens=False)["input_ids"] for text in scenario.replies()]
    backend = _Replay([ids + [encoder.end_of_turn_id] for ids in replies])
    sampling = SamplingParams(max_new_tokens=4096, stop_token_ids=encoder.stop_token_ids)
    try:
        await encode_prompt(trajectory, encoder)
    except Exception as exc:  # noqa: BLE001 -- reported as the template's failure on this shape
        return _raised(scenario, "prompt", exc, "the prompt")
    for index, observation in enumerate([*scenario.observations(), None]):
        await generate_turn(trajectory, backend, sampling, LIMITS)
        if observation is not None:
            try:
                await observe(trajectory, observation, encoder, LIMITS)
            except Exception as exc:  # noqa: BLE001
                return _raised(scenario, "observation", exc, f"a {observation['role']!r} observation")
        try:
            report = encoder.drift_check(trajectory)
        except Exception as exc:  # noqa: BLE001
            return _raised(scenario, "rerender", exc, f"the whole conversation after turn {index}")
        if not report.exact:
            cause, why = classify(encoder, trajectory, report)
            checkpoint = "at the end" if observation is None else f"after turn {index}"
            return Finding(
                scenario.name, scenario.description, False, cause, why, ENGINE_DOES["drift"], checkpoint,
                report.position, report.turn, report.part, report.expected, report.actual,
            )  # fmt: skip
    return Finding(scenario.name, scenario.description, True)


def _raised(scenario: Scenario, stage: str, exc: Exception, what: str) -> Finding:
    message = " ".join(str(exc.__cause__ or exc).split())
    if stage == "encoder" and isinstance(exc, ValueError):
        cause, why = Cause.NO_TURN_BOUNDARY, message
    else:
        cause = cause_of_error(message)
        why = f"the template raises on {what}: {message}"
    return Finding(scenario.name, scenario.description, False, cause, why, ENGINE_DOES[stage])


class _Replay:
    """The model, replayed: each generate call answers the next scripted reply (ending in its stop token).
    The turn steps call nothing else of a backend."""

    def __init__(self, replies: list[list[int]]):
        self.replies = replies

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplingParams,
        image_data: Sequence[str] | None = None,
        *,
        rid: str | None = None,
        session_id: str | None = None,
    ) -> GenerateResult:
        ids = self.replies.pop(0)
        return GenerateResult(ids, [0.0] * len(ids), "", "stop", prompt_tokens=len(input_ids))


# -- the command ----------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", help="a tokenizer or processor directory, a .jinja file, qwen2.5 or qwen2.5-vl")
    parser.add_argument("--chat-template", help="a .jinja file replacing the directory's chat template")
    parser.add_argument("--vision", action="store_true", help="a .jinja file: check it with the Qwen2.5-VL processor")
    parser.add_argument(
        "--template-kwargs",
        default="{}",
        help="JSON keyword arguments of the template, e.g. '{\"enable_thinking\": false}'",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def main(args: argparse.Namespace) -> int:
    """0: exact in every scenario; 1: drifts (or fails) in one; 2: bad input, with one error line."""
    try:
        kwargs = json.loads(args.template_kwargs)
        if not isinstance(kwargs, dict):
            raise TemplateInputError(f"--template-kwargs {args.template_kwargs}: expected a JSON object")
        target = load_target(args.target, chat_template=args.chat_template, vision=args.vision, template_kwargs=kwargs)
    except json.JSONDecodeError as exc:
        print(f"turnstile check-template: --template-kwargs is not JSON: {exc}", file=sys.stderr)
        return 2
    except TemplateInputError as exc:
        print(f"turnstile check-template: {exc}", file=sys.stderr)
        return 2
    report = check_template(target)
    print(json.dumps(report.to_json(), indent=2) if args.json else report.describe())
    return report.exit_code
