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
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import anyio

from engine.backends.base import GenerateResult, SamplingParams
from engine.encoding import ChatEncoder
from engine.families import ModelFamily, find_family
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
        added = _add_control_tokens(target.tokenizer, template, find_family(template))
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


def _add_control_tokens(tokenizer: Any, template: str, family: ModelFamily | None) -> list[str]:
    """The template's `<|...|>` literals and its family's special tokens that the vocabulary lacks, added as
    special tokens (Llama's headers over the Qwen vocabulary), so the check sees the template's structure and
    not a foreign vocabulary's."""
    vocab = tokenizer.get_vocab()
    wanted = set(CONTROL_TOKEN.findall(template)) | set(family.special_tokens if family is not None else ())
    missing = sorted(wanted - set(vocab))
    if missing:
        tokenizer.add_special_tokens({"additional_special_tokens": missing}, replace_extra_special_tokens=False)
    if family is not None:  # the templates that write the model's BOS or EOS write its own
        for name in ("bos_token", "eos_token"):
            if (token := getattr(family, name)) is not None:
                setattr(tokenizer, name, token)
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
    if scenario.observation_role != "user" and (problem := encoder.role_problem(scenario.observation_role)):
        return Finding(
            scenario.name, scenario.description, False, Cause.NO_ROLE, f"the template {problem}", ENGINE_DOES["role"]
        )
    return anyio.run(_run_scenario, encoder, scenario)


async def _run_scenario(encoder: ChatEncoder, scenario: Scenario) -> Finding:
    """The engine's steps, turn by turn; after each observation (and at the end) the conversation is
    re-rendered and compared with the trajectory."""
    trajectory = Trajectory(prompt=scenario.prompt())
    observations = scenario.observations(encoder)
    try:
        replies = [
            sampled_reply(encoder, scenario.prompt(), reply, following)
            for reply, following in zip(scenario.replies(encoder), [*observations, None], strict=True)
        ]
    except Exception as exc:  # noqa: BLE001 -- the template cannot write the family's replies at all
        return _raised(scenario, "prompt", exc, "a reply of the model")
    backend = _Replay(replies)
    sampling = SamplingParams(max_new_tokens=4096, stop_token_ids=encoder.stop_token_ids)
    try:
        await encode_prompt(trajectory, encoder)
    except Exception as exc:  # noqa: BLE001 -- reported as the template's failure on this shape
        return _raised(scenario, "prompt", exc, "the prompt")
    for index, observation in enumerate([*observations, None]):
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


CONTENT_MARK = "REPLYCONTENTMARK"  # stands for a reply's content while the template writes the reply
REASONING_MARK = "REPLYREASONINGMARK"  # and for its reasoning


def sampled_reply(
    encoder: ChatEncoder,
    context: list[dict[str, Any]],
    message: dict[str, Any],
    following: dict[str, Any] | None,
) -> list[int]:
    """The tokens a model of the encoder's family samples for an assistant `message` after `context`,
    stop token included: what the template writes for it as the conversation's last message after its
    generation prompt (its reasoning, its tool calls in the family's syntax: the form the model was trained
    to write), with the content exactly as given (a template that trims it in history does not trim what
    the model samples), cut at its end token; a family whose turn ends on the next message's opener (GLM)
    samples the opener of `following` (a user message's at the end). It is cut at the first stop token,
    not at an end token of history (harmony ends its analysis message with `<|end|>` inside one turn)."""
    content = message.get("content") or ""
    if encoder.parser is None:  # no syntax known to write: the content as text, then the template's end token
        return [*encoder.tokenizer(content, add_special_tokens=False)["input_ids"], encoder.end_of_turn_id]
    reasoning = message.get("reasoning_content") or message.get("thinking") or ""
    stand_in = {**message, "content": CONTENT_MARK} if content else dict(message)
    if reasoning:
        stand_in |= {key: REASONING_MARK for key in ("reasoning_content", "thinking") if key in message}
    for shown in (context, [m for m in context if m.get("role") != "system"]):  # a template may move the system
        before = encoder.render(shown, add_generation_prompt=True)  # prompt once a reply follows (Mistral)
        after = encoder.render([*shown, stand_in], add_generation_prompt=False)
        if after.startswith(before):
            break
    history = encoder.render(shown, add_generation_prompt=False)
    if after.startswith(before):
        text = after[len(before) :]
    elif after.startswith(history) and encoder.opens_reasoning and "</think>" in after[len(history) :]:
        # the template writes the reply otherwise than after its own generation prompt (DeepSeek and GLM-4.7
        # write `</think>` where the prompt opened `<think>`): the reasoning, `</think>`, then what follows it
        text = f"{REASONING_MARK if reasoning else ''}</think>{after[len(history) :].split('</think>', 1)[1]}"
    else:  # the reply makes the template write history otherwise (Kimi-K2-Thinking and gpt-oss drop earlier turns'
        # reasoning once a final answer follows them): what it writes after the generation prompt that opens it
        # (a prompt that opens `<think>` may be written without it before a reply that has no reasoning: MiniMax-M2)
        marks = [after.rfind(mark) for mark in (REASONING_MARK, CONTENT_MARK) if mark in after]
        limit = min(marks) if marks else len(after)
        openers = [encoder.generation_prompt]
        if encoder.opens_reasoning and not reasoning:
            openers.append(encoder.generation_prompt.rpartition("<think>")[0])
        starts = [(at, opener) for opener in openers if opener and (at := after.rfind(opener, 0, limit)) >= 0]
        if not starts:
            rest = after[len(os.path.commonprefix([before, after])) :]
            raise ValueError(f"the template's assistant message does not follow its generation prompt: {rest[:60]!r}")
        at, opener = starts[0]
        text = after[at + len(opener) :]
        if opener != encoder.generation_prompt:  # the model closes the block its prompt opened, as when it reasons
            text = _closing_reasoning(encoder, shown, stand_in) + text.lstrip()
    if CONTENT_MARK not in text and content:
        raise ValueError(f"the template does not write an assistant message's content: {text[:60]!r}")
    names = [call["function"]["name"] for call in message.get("tool_calls") or []]
    if any(name not in text for name in names):
        raise ValueError(f"the template does not write an assistant message's tool calls: {text[:60]!r}")
    if reasoning and REASONING_MARK not in text:  # the template leaves it out: the model still writes it
        text = _with_reasoning(text, encoder.opens_reasoning)
    stops = [t for t in encoder.end_texts if encoder.family is None or t in encoder.family.stop_tokens]
    at, token = min(((text.find(t), t) for t in stops if t in text), default=(len(text), None))
    written = text[:at].replace(CONTENT_MARK, content).replace(REASONING_MARK, reasoning)
    ids = encoder.tokenizer(written, add_special_tokens=False)["input_ids"]
    if token is None:  # the template writes no end after it: the model stops on the next message's opener
        return ids + encoder.closing_ids(ids, following)
    return [*ids, encoder.tokenizer.convert_tokens_to_ids(token)]


def _closing_reasoning(encoder: ChatEncoder, context: list[dict[str, Any]], message: dict[str, Any]) -> str:
    """What the template writes between a reply's reasoning and the rest (`\n</think>\n\n`): how a model whose
    prompt opened the reasoning block closes it, an empty one included."""
    reasoned = {**message, "content": CONTENT_MARK, "reasoning_content": REASONING_MARK}
    text = encoder.render([*context, reasoned], add_generation_prompt=False)
    if REASONING_MARK not in text or CONTENT_MARK not in text:
        return "</think>"
    return text[text.rindex(REASONING_MARK) + len(REASONING_MARK) : text.rindex(CONTENT_MARK)]


EMPTY_THINK = re.compile(r"<think>(\s*)</think>")


def _with_reasoning(text: str, opened: bool) -> str:
    """A reply the template writes without its reasoning, as a model that reasons samples it: the empty think
    block the template writes (Kimi-K2-Thinking's `<think></think>`) filled, or the reasoning before the
    `</think>` that closes the block the generation prompt opened (Kimi-K2.5's). A template that writes no think
    block at all is of a model that does not reason there: its reply stays as written."""
    if (empty := EMPTY_THINK.search(text)) is not None:
        return f"{text[: empty.start()]}<think>{REASONING_MARK}</think>{text[empty.end() :]}"
    if opened and text.lstrip().startswith("</think>"):
        return REASONING_MARK + text
    return text


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
        self.replies = list(replies)

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
