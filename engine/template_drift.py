"""The conversations `turnstile check-template` runs, and why a re-render of one differs from its trajectory.

Each `Scenario` is one conversation shape a multi-turn run meets: user or tool observations (tool ones
with a `tool_call_id`), with or without a tools list, replies with `<think>` reasoning blocks or with
blank lines at their end, images in the prompt and the observations. The model's replies are scripted
text, encoded as canonical tokens: what differs is then the template's doing, not the model's
tokenization. `classify` reads a `DriftReport` (where the trajectory and the full render first differ)
and names the cause; a `Finding` per scenario and the `TemplateReport` of them all carry the results,
with what the engine does about each (`ENGINE_DOES`).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from PIL import Image

from engine.encoding import DUMMY_MESSAGES, ChatEncoder, DriftReport
from engine.trajectory import Trajectory

NUM_TURNS = 4  # replies of the model; an observation follows each but the last


class Cause(StrEnum):
    """Why a scenario is not exact."""

    HISTORY_REWRITTEN = "history rewritten"  # earlier turns re-render differently (reasoning dropped, text trimmed)
    SYSTEM_MOVED = "system prompt moved"  # the start of the conversation, or the system text, moves as it grows
    SEPARATORS = "separators differ"  # only whitespace between turns differs
    MERGED_TOKEN = "token merged at a boundary"  # the same text, tokenized across where two parts meet
    ROLES_ALTERNATE = "roles forced to alternate"  # the template raises on a role order
    TEMPLATE_RAISES = "template raises on a shape"  # the template raises on some other message shape
    NO_ROLE = "no such role"  # the template cannot render a message of the observation's role at all (gemma-3's tool)
    NO_TURN_BOUNDARY = "no turn boundary"  # the encoder cannot find where the model's turn ends


# What the engine does, by where a scenario went wrong.
ENGINE_DOES = {
    "drift": (
        "the trajectory keeps what the model saw and generated (prompt once, replies as sampled, observations as "
        "deltas); nothing is re-rendered, so training tokens stay the sampled ones. A re-render of the messages (a "
        "trainer or server applying the template) differs from it; with drift_check_every > 0 the engine counts "
        'these trajectories in turnstile_drift_checks_total{result="drift"} and still trains on them.'
    ),
    "encoder": "the engine refuses to start: building its encoder raises this error (turnstile run exits 2).",
    "prompt": "each prompt of this shape fails to encode: its trajectory ends FAILED (encode_error), the run goes on.",
    "observation": (
        "each observation of this shape fails to encode: its trajectory ends FAILED (encode_error; bad_observation "
        "has no retries by default), the run goes on."
    ),
    "role": (
        "an env that declares observations of this role (OBSERVATION_ROLES) is refused at start with this error; "
        "one that sends them undeclared fails each such trajectory (encode_error)."
    ),
    "rerender": (
        "delta encoding works, but the whole conversation does not render: with drift_check_every > 0 each checked "
        "trajectory ends FAILED (encode_error)."
    ),
}


@dataclass(frozen=True, slots=True)
class Finding:
    """One scenario's result. Not exact: its `cause`, `why` in a sentence, what the `engine` does; for a drift
    also the first re-render that differs (`checkpoint`: "after turn N" or "at the end"), the token `position`,
    the `turn` and `part` ("prompt", "generated", "observation") holding it, and the decoded context of each
    side. A template that raises has no position."""

    scenario: str
    description: str
    exact: bool
    cause: Cause | None = None
    why: str = ""
    engine: str = ""
    checkpoint: str | None = None
    position: int | None = None
    turn: int | None = None
    part: str | None = None
    expected: str = ""  # the full render around the difference
    actual: str = ""  # the trajectory around the difference


@dataclass(frozen=True, slots=True)
class TemplateReport:
    """Every scenario's finding for one template, and notes on what it ignores; exact only if all are."""

    target: str
    findings: list[Finding]
    notes: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return all(f.exact for f in self.findings)

    @property
    def exit_code(self) -> int:
        return 0 if self.exact else 1

    def to_json(self) -> dict[str, Any]:
        scenarios = [asdict(f) for f in self.findings]
        return {"target": self.target, "exact": self.exact, "scenarios": scenarios, "notes": self.notes}

    def describe(self) -> str:
        """The report for people: one line per scenario, where and why for each that is not exact."""
        lines = [f"check-template {self.target}"]
        for finding in self.findings:
            lines.extend(_lines_of(finding))
        lines.extend(f"note: {note}" for note in self.notes)
        failing = [f for f in self.findings if not f.exact]
        if not failing:
            lines.append(
                f"verdict: exact in all {len(self.findings)} scenarios; delta encoding equals a full re-render"
            )
            return "\n".join(lines)
        lines.append(f"verdict: not exact in {len(failing)} of {len(self.findings)} scenarios")
        for engine in dict.fromkeys(f.engine for f in failing):
            names = ", ".join(f.scenario for f in failing if f.engine == engine)
            lines.append(f"what the engine does ({names}): {engine}")
        return "\n".join(lines)


def _lines_of(finding: Finding) -> list[str]:
    label = "exact" if finding.exact else "drift" if finding.position is not None else "fails"
    lines = [f"  {label:5}  {finding.scenario:15} {finding.description}"]
    indent = " " * 25
    if not finding.exact:
        lines.append(f"{indent}{finding.cause}: {finding.why}")
    if finding.position is not None:
        where = "the prompt" if finding.turn is None else f"turn {finding.turn} ({finding.part})"
        lines.append(
            f"{indent}re-render {finding.checkpoint}: first difference at token {finding.position}, in {where}"
        )
        lines.append(f"{indent}  render has     {finding.expected!r}")
        lines.append(f"{indent}  trajectory has {finding.actual!r}")
    return lines


# -- the conversations ------------------------------------------------------------------------------------
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc_score",
            "description": "Check an answer",
            "parameters": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
        },
    }
]
SYSTEM = "You solve arithmetic problems step by step."
QUESTION = "What is 17 + 25?"
PLAIN = "The answer is {answer}."
TOOL_CALL = '{{"name": "calc_score", "arguments": {{"answer": "{answer}"}}}}'
THINKING = "I add 17 and 25, attempt {i}."
TRAILING_NEWLINE = "The answer is {answer}.\n\n"


@dataclass(frozen=True, slots=True)
class Scenario:
    """One conversation shape: the model's replies (`reply`: plain text, reasoning, a tool call or both, or
    text ending in a blank line), each answered by an observation of `observation_role`, under `tools` (or
    none). Each reply is an assistant message; `engine.template_check` writes it as the model samples it."""

    name: str
    description: str
    reply: str = "plain"  # plain | trailing | reasoning | call | reasoning+call
    observation_role: str = "user"
    tools: list[dict[str, Any]] | None = None
    has_system: bool = True
    images: bool = False

    def prompt(self) -> list[dict[str, Any]]:
        system = [{"role": "system", "content": SYSTEM}] if self.has_system else []
        return [*system, {"role": "user", "content": self._content(QUESTION, 84)}]

    def replies(self, encoder: ChatEncoder | None = None) -> list[dict[str, Any]]:
        """The model's replies as assistant messages: for an encoder with a parser (its family's, or one read off
        its template), reasoning in `reasoning_content` (and harmony's `thinking`) and calls in `tool_calls` as
        its template takes them, as that parser reads them; otherwise as text in the content: a call as its JSON,
        reasoning as a `<think>` block."""
        return [self._reply(i, 40 + i, encoder) for i in range(NUM_TURNS)]

    def _reply(self, i: int, answer: int, encoder: ChatEncoder | None) -> dict[str, Any]:
        text = (TRAILING_NEWLINE if self.reply == "trailing" else PLAIN).format(answer=answer)
        calls = self.reply.endswith("call")
        thinking = THINKING.format(i=i) if self.reply.startswith("reasoning") else ""
        if encoder is None or encoder.parser is None:
            body = TOOL_CALL.format(answer=answer) if calls else text
            return {"role": "assistant", "content": f"<think>\n{thinking}\n</think>\n\n{body}" if thinking else body}
        message: dict[str, Any] = {"role": "assistant", "content": "" if calls else text}
        if thinking:
            message["reasoning_content"] = message["thinking"] = thinking
        if calls:
            call_id = _call_id(i, encoder)
            message["tool_calls"] = [encoder.tool_call(call_id, "calc_score", {"answer": str(answer)})]
        return message

    def observations(self, encoder: ChatEncoder | None = None) -> list[dict[str, Any]]:
        if self.observation_role == "tool":
            return [
                {
                    "role": "tool", "tool_call_id": _call_id(i, encoder), "name": "calc_score",
                    "content": f"{40 + i} is wrong.",
                }
                for i in range(NUM_TURNS - 1)
            ]  # fmt: skip
        text = "Feedback {i}: {answer} is not right, try again."
        return [
            {"role": "user", "content": self._content(text.format(i=i, answer=40 + i), 28 * (i + 2))}
            for i in range(NUM_TURNS - 1)
        ]

    def _content(self, text: str, image_size: int) -> str | list[dict[str, Any]]:
        if not self.images:
            return text
        image = Image.new("RGB", (image_size, image_size), (200, 30, 30))
        return [{"type": "image", "image": image}, {"type": "text", "text": text}]


def _call_id(i: int, encoder: ChatEncoder | None) -> str:
    return encoder.call_id("calc_score", i) if encoder is not None else f"call{i:05d}"


SCENARIOS = (
    Scenario("user", "user observations, no tools list"),
    Scenario("no-system", "no system prompt, user observations", has_system=False),
    Scenario("user+tools", "user observations, a tools list", tools=TOOLS),
    Scenario("tool", "tool observations (tool_call_id), no tools list", "call", "tool"),
    Scenario("tool+tools", "tool observations, a tools list, replies that call it", "call", "tool", TOOLS),
    Scenario("reasoning", "replies with reasoning, user observations", "reasoning"),
    Scenario(
        "reasoning+tool", "replies with reasoning and a call, tool observations, tools", "reasoning+call", "tool", TOOLS
    ),
    Scenario("trailing-space", "replies ending in a blank line, user observations", "trailing"),
    Scenario("images", "images in the prompt and in user observations", images=True),
)


def classify(encoder: ChatEncoder, trajectory: Trajectory, report: DriftReport) -> tuple[Cause, str]:
    """Why the full render differs from the trajectory at `report.position`, and one sentence saying so."""
    if _same_text(report.expected, report.actual):
        return Cause.MERGED_TOKEN, _where_merged(trajectory, report)
    if report.part == "generated":
        return Cause.HISTORY_REWRITTEN, _how_reply_changed(encoder, report)
    if _whitespace_only(report.expected, report.actual):
        return Cause.SEPARATORS, "the full render has other whitespace between turns than the prompt and deltas carry"
    if report.part == "prompt":
        start, end, reply = 0, trajectory.prompt_length, 0
    else:
        turn = trajectory.turns[report.turn]
        start = trajectory.prompt_length + turn.start + turn.num_generated
        end, reply = start + turn.num_observation, report.turn + 1
    tail = _generation_prompt(encoder)
    if tail and report.position >= end - len(encoder.tokenizer(tail, add_special_tokens=False)["input_ids"]):
        return Cause.HISTORY_REWRITTEN, (
            f"the full render drops what the generation prompt wrote before reply {reply} ({tail!r}): "
            "the model saw it, a re-render does not have it"
        )
    if report.part == "prompt":
        return Cause.SYSTEM_MOVED, (
            "the start of the conversation renders differently once later turns exist (the template places the "
            "system prompt or the tools relative to later messages)"
        )
    delta = encoder.tokenizer.decode(trajectory.tokens[start:end].tolist())
    systems = [m["content"] for m in [DUMMY_MESSAGES[0], *trajectory.prompt] if m.get("role") == "system"]
    if any(isinstance(text, str) and text in delta for text in systems):
        dummy = " (the encoder's dummy one)" if DUMMY_MESSAGES[0]["content"] in delta else ""
        return Cause.SYSTEM_MOVED, (
            f"the observation after turn {report.turn} carries a system prompt{dummy}: the template writes system "
            "text next to later user messages, so each delta repeats it where the full render does not"
        )
    return Cause.HISTORY_REWRITTEN, f"the full render writes the observation after turn {report.turn} differently"


def _how_reply_changed(encoder: ChatEncoder, report: DriftReport) -> str:
    n, family = report.turn, encoder.family
    if _whitespace_only(report.expected, report.actual):
        return f"the template changes the whitespace of reply {n} (it trims the model's text)"
    for opener in ("<think>", "<|channel|>analysis"):
        if opener in report.actual and opener not in report.expected:
            return f"the template drops the reasoning ({opener}) of reply {n}"
    if "<think>" in report.expected and "<think>" not in report.actual:
        return f"the template adds a <think> block to reply {n} that the model did not write"
    if family is not None:
        sampled = [t for t in family.stop_tokens if t in report.actual and t not in report.expected]
        written = [t for t in family.history_ends if t in report.expected]
        if sampled and written:
            return f"the template ends reply {n} with {written[0]} where the model sampled {sampled[0]}"
        if "</think>" in report.actual and "</think>" not in report.expected:
            return (
                f"the template drops the reasoning of reply {n} (its </think>, after the generation prompt's <think>)"
            )
    return f"the template writes reply {n} differently from what the model generated (its text, or its tool call)"


def _same_text(expected: str, actual: str) -> bool:
    """The two contexts are one text (as far as the shorter one goes), tokenized differently."""
    return expected != actual and _one_begins_the_other(expected, actual)


def _one_begins_the_other(a: str, b: str) -> bool:
    return a.startswith(b) or b.startswith(a)


def _where_merged(trajectory: Trajectory, report: DriftReport) -> str:
    """Which two parts meet where the full render tokenizes their text as one token."""
    if report.part == "prompt":
        where = "the generation prompt's end and reply 0"
    elif report.part == "generated":
        turn = trajectory.turns[report.turn]
        at_start = report.position <= trajectory.prompt_length + turn.start
        where = f"what precedes reply {report.turn} and the reply" if at_start else f"reply {report.turn}'s own tokens"
    else:
        where = f"the observation after turn {report.turn} and what follows it"
    return (
        f"the text is the same, but the full render tokenizes it otherwise where {where} meet: the model sampled "
        "across that boundary token by token, and a re-render merges them"
    )


def _whitespace_only(expected: str, actual: str) -> bool:
    """The two contexts differ, but not once whitespace is dropped (as far as the shorter one goes)."""
    return expected != actual and _one_begins_the_other(re.sub(r"\s+", "", expected), re.sub(r"\s+", "", actual))


def _generation_prompt(encoder: ChatEncoder) -> str:
    """What the template writes for `add_generation_prompt` after a user message ("" when not a suffix)."""
    messages = [*DUMMY_MESSAGES, {"role": "user", "content": "x"}]
    with_prompt = encoder.render(messages, add_generation_prompt=True)
    without = encoder.render(messages, add_generation_prompt=False)
    return with_prompt[len(without) :] if with_prompt.startswith(without) else ""


def tools_are_rendered(renderer: Any, template_kwargs: dict[str, Any]) -> bool | None:
    """Whether a tools list changes the render at all (None: the template raises on one of the two)."""
    try:
        renders = [
            renderer.apply_chat_template(
                list(DUMMY_MESSAGES), tools=tools, tokenize=False, add_generation_prompt=True, **template_kwargs
            )
            for tools in (None, TOOLS)
        ]
    except Exception:  # noqa: BLE001 -- the scenarios report the error itself
        return None
    return renders[0] != renders[1]


def cause_of_error(message: str) -> Cause:
    """A template's error message: a role-order check, or some other shape it refuses."""
    return Cause.ROLES_ALTERNATE if re.search(r"alternat", message, re.IGNORECASE) else Cause.TEMPLATE_RAISES
