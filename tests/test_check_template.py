"""`turnstile check-template` on every official template in the fixtures, on templates written to show
each cause of drift, and on bad input.

The verdict of each fixture is written down below with the reason, read off the template's Jinja: a
template that appends gives the trajectory the engine builds token for token; one that rewrites what
it already wrote does not. The real Qwen vocabulary renders every template (Llama's header tokens are
added to it by the check itself, as it says in its notes).
"""

from __future__ import annotations

import functools
import json
from dataclasses import replace

import pytest

from engine import cli
from engine.models import load_tokenizer
from engine.template_check import Target, check_template, load_target
from engine.template_drift import SCENARIOS, Cause
from tests.conftest import chat_templates_dir

H, SEP, SYS = Cause.HISTORY_REWRITTEN, Cause.SEPARATORS, Cause.SYSTEM_MOVED
TEXT_SCENARIOS = [s.name for s in SCENARIOS if not s.images]
QWEN3_PLAIN_REPLIES = ["user", "no-system", "user+tools", "tool", "tool+tools", "trailing-space"]  # + "reasoning"

VERDICTS: dict[str, dict[str, Cause]] = {
    # Every message is `<|im_start|>role\n` + content + `<|im_end|>\n`, content as written; the default system
    # prompt and the tools preamble only at the start; consecutive tool results share one user turn that the
    # delta after the assistant opens the same way. It only appends: exact everywhere.
    "Qwen2.5-7B-Instruct": {},
    # The same layout without tools support (a tool message is rendered under its own role): exact.
    "Qwen2.5-VL-7B-Instruct": {},
    # Appends (system header with the date once, tools in the first user message, tool results as
    # `ipython`), but writes `message['content'] | trim`: a reply ending in blank lines re-renders without them.
    "Llama-3.1-8B-Instruct": {"trailing-space": H},
    "Llama-3.2-3B-Instruct": {"trailing-space": H},
    # Drops the reasoning of replies before the last user query (`reasoning`). The model (family qwen25) writes
    # each reply as the template writes a last reply, with a think block, empty where it did not reason
    # (`loop.last`); history drops it. Tool results are not queries, so with tool observations every reply
    # keeps its reasoning: `reasoning+tool` is exact.
    "Qwen3-0.6B": dict.fromkeys(QWEN3_PLAIN_REPLIES, H) | {"reasoning": H},
}

FIXTURES = chat_templates_dir()
NAMES = sorted(path.stem for path in FIXTURES.glob("*.jinja")) if FIXTURES else []
MISSING = "chat-template fixtures not found: set TURNSTILE_FIXTURES to a folder holding chat_templates/"


@functools.cache
def fixture_target(name: str, vision: bool = False) -> Target:
    return load_target(str(FIXTURES / f"{name}.jinja"), vision=vision)


def drifts(report) -> dict[str, Cause]:
    return {f.scenario: f.cause for f in report.findings if not f.exact}


def finding(report, scenario: str):
    return next(f for f in report.findings if f.scenario == scenario)


@pytest.mark.parametrize("name", NAMES or [pytest.param("none", marks=pytest.mark.skip(reason=MISSING))])
def test_every_fixture_template_gets_its_verdict(name):
    assert name in VERDICTS, f"{name}.jinja has no verdict written down in this test: read the template, add one"
    report = check_template(fixture_target(name))
    assert [f.scenario for f in report.findings] == TEXT_SCENARIOS
    assert drifts(report) == VERDICTS[name]
    assert report.exit_code == (1 if VERDICTS[name] else 0)
    for f in report.findings:
        if not f.exact:  # a drift says where: the first re-render that differs, the token, the turn
            assert f.position is not None and f.checkpoint and f.expected != f.actual and f.engine


def test_qwen3_drops_earlier_reasoning_at_the_first_user_observation(templates_dir):
    report = check_template(fixture_target("Qwen3-0.6B"))
    drift = finding(report, "reasoning")
    assert (drift.checkpoint, drift.turn, drift.part) == ("after turn 0", 0, "generated")
    assert "I add 17" in drift.actual and "I add 17" not in drift.expected
    assert "drops the reasoning" in drift.why
    assert "drift_check_every" in drift.engine and "nothing is re-rendered" in drift.engine
    plain = finding(report, "user")  # the model's empty think block, which history drops
    assert (plain.checkpoint, plain.turn, plain.part) == ("after turn 0", 0, "generated")
    assert "<think>" in plain.actual and "<think>" not in plain.expected
    assert "drops the reasoning (<think>) of reply 0" in plain.why


def test_qwen3_without_thinking_loses_the_empty_think_block_of_the_generation_prompt(templates_dir):
    """enable_thinking=false writes `<think>\\n\\n</think>\\n\\n` after the generation prompt: the model sees it
    before every reply, a re-render of the history drops it, from the prompt on. A reply with reasoning cannot
    follow that prompt at all: the model was told not to reason."""
    target = replace(fixture_target("Qwen3-0.6B"), template_kwargs={"enable_thinking": False})
    report = check_template(target)
    reasoning = ("reasoning", "reasoning+tool")
    assert drifts(report) == {s: Cause.TEMPLATE_RAISES if s in reasoning else H for s in TEXT_SCENARIOS}
    assert "does not follow its generation prompt" in finding(report, "reasoning").why
    first = finding(report, "user")
    assert (first.checkpoint, first.part, first.turn) == ("after turn 0", "prompt", None)
    assert "generation prompt" in first.why and "<think>" in first.why
    assert any("enable_thinking" in note for note in report.notes)


def test_llama_trims_the_models_reply(templates_dir):
    report = check_template(fixture_target("Llama-3.1-8B-Instruct"))
    drift = finding(report, "trailing-space")
    assert (drift.checkpoint, drift.turn, drift.part) == ("after turn 0", 0, "generated")
    assert "whitespace of reply 0" in drift.why
    assert "\n\n<|eot_id|>" in drift.actual and "\n\n<|eot_id|>" not in drift.expected
    assert "<|eot_id|>" in report.notes[0] and "<|start_header_id|>" in report.notes[0]  # added to the vocabulary


@pytest.mark.slow
def test_qwen25_vl_with_its_processor_is_exact_with_images_and_ignores_tools(templates_dir):
    report = check_template(fixture_target("Qwen2.5-VL-7B-Instruct", vision=True))
    assert [f.scenario for f in report.findings] == [s.name for s in SCENARIOS]
    assert report.exact and report.exit_code == 0
    assert any("ignores the tools list" in note for note in report.notes)
    assert not any("images not checked" in note for note in report.notes)


# -- each cause, on a template written to show it ----------------------------------------------------------
MESSAGE = "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
SYSTEM = "{%- set system = messages[0]['content'] if messages[0]['role'] == 'system' else '' %}"


def chatml(body: str = MESSAGE, *, before: str = "") -> str:
    """A ChatML template (Qwen's turn tokens): `before`, then `body` for each message `m`."""
    generation = "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    return before + "{%- for m in messages %}" + body + "{%- endfor %}" + generation


ALTERNATE = chatml(  # after an optional system message: user, assistant, user, ... (Mistral's and Gemma's check)
    "{%- if m['role'] != 'system' and (m['role'] == 'user') != ((loop.index0 - offset) % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}"
    + MESSAGE,
    before="{%- set offset = 1 if messages[0]['role'] == 'system' else 0 %}",
)
TOOL_CALL_ID = chatml(  # a check of tool call ids (Mistral's kind) that the scenarios' ids fail
    "{%- if m['role'] == 'tool' and m.tool_call_id.startswith('call') %}"
    "{{- raise_exception('Tool call IDs should not start with call!') }}{%- endif %}" + MESSAGE
)
SYSTEM_IN_LAST_USER = chatml(  # the system prompt goes into the last user message (Mistral's older templates)
    "{%- if m['role'] == 'system' %}{%- elif loop.index0 == ns.last and system %}"
    "{{- '<|im_start|>user\\n' + system + '\\n\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- else %}" + MESSAGE + "{%- endif %}",
    before=SYSTEM + "{%- set ns = namespace(last=-1) %}{%- for m in messages %}{%- if m['role'] == 'user' %}"
    "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}",
)
SYSTEM_BEFORE_EACH_USER = chatml(  # the system prompt again before every user message that follows a reply
    "{%- if system and m['role'] == 'user' and not loop.first and messages[loop.index0 - 1]['role'] == 'assistant' %}"
    "{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' }}{%- endif %}" + MESSAGE,
    before=SYSTEM,
)
NEWLINE_BETWEEN_MESSAGES_ONLY = chatml(  # a newline between messages, none before the generation prompt
    "{%- if not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' }}"
)
PLAIN_TEXT_TURNS = (  # no end-of-turn token at all
    "{%- for m in messages %}{{- m['role'] + ': ' + m['content'] + '\\n\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'assistant: ' }}{%- endif %}"
)
SHORT_CONVERSATIONS_ONLY = chatml(
    "{%- if messages | length > 7 %}{{- raise_exception('at most three replies') }}{%- endif %}" + MESSAGE
)


@pytest.fixture(scope="module")
def scratch():
    """A Qwen tokenizer of this module's own: its chat template is replaced by each test."""
    return load_tokenizer("qwen2.5")


def check(tokenizer, template: str):
    tokenizer.chat_template = template
    return check_template(Target("written", tokenizer))


TOOL_SCENARIOS = ["tool", "tool+tools", "reasoning+tool"]


def test_roles_forced_to_alternate_name_the_tool_role_the_template_cannot_take(scratch):
    report = check(scratch, ALTERNATE)
    assert drifts(report) == dict.fromkeys(TOOL_SCENARIOS, Cause.NO_ROLE)
    failed = finding(report, "tool")
    assert failed.position is None and "must alternate" in failed.why and "'tool' message" in failed.why
    assert "refused at start" in failed.engine
    assert report.exit_code == 1


def test_a_template_that_raises_on_a_tool_call_id_is_named(scratch):
    report = check(scratch, TOOL_CALL_ID)
    assert drifts(report) == dict.fromkeys(TOOL_SCENARIOS, Cause.TEMPLATE_RAISES)
    assert "should not start with call" in finding(report, "tool").why


def test_a_system_prompt_moved_to_the_last_user_message(scratch):
    report = check(scratch, SYSTEM_IN_LAST_USER)
    drift = finding(report, "user")
    assert (drift.cause, drift.part, drift.checkpoint) == (SYS, "prompt", "after turn 0")
    assert "You solve arithmetic" in drift.actual and "You solve arithmetic" not in drift.expected
    # Without a system prompt of its own, each observation's delta carries the encoder's dummy one.
    bare = finding(report, "no-system")
    assert (bare.cause, bare.part) == (SYS, "observation") and "dummy" in bare.why


def test_a_system_prompt_repeated_before_each_user_message(scratch):
    report = check(scratch, SYSTEM_BEFORE_EACH_USER)
    drift = finding(report, "user")
    assert (drift.cause, drift.part, drift.turn) == (SYS, "observation", 0)
    assert "You are a helpful assistant." in drift.actual and "You solve arithmetic" in drift.expected
    assert all(f.exact for f in report.findings if f.scenario.startswith("tool") or f.scenario == "reasoning+tool")


def test_separators_that_differ_between_turns(scratch):
    report = check(scratch, NEWLINE_BETWEEN_MESSAGES_ONLY)
    assert drifts(report) == dict.fromkeys(TEXT_SCENARIOS, SEP)
    drift = finding(report, "user")
    assert drift.part == "prompt"  # the prompt ends `<|im_end|><|im_start|>assistant`; the render has a newline there
    assert "<|im_end|>\n<|im_start|>assistant" in drift.expected and "<|im_end|><|im_start|>" in drift.actual


def test_a_template_without_an_end_of_turn_token_is_refused_as_the_engine_would(scratch):
    report = check(scratch, PLAIN_TEXT_TURNS)
    assert drifts(report) == dict.fromkeys(TEXT_SCENARIOS, Cause.NO_TURN_BOUNDARY)
    assert "refuses to start" in finding(report, "user").engine
    assert "not an end-of-turn token" in finding(report, "user").why


def test_a_template_that_refuses_a_system_role_runs_prompts_without_one(scratch):
    """Gemma's templates refuse a system message: the encoder probes without one, so a prompt without a
    system message encodes exactly and only prompts that carry one fail (their own trajectories)."""
    report = check(
        scratch,
        chatml(
            "{%- if m['role'] == 'system' %}{{- raise_exception('System role not supported') }}{%- endif %}" + MESSAGE
        ),
    )
    assert finding(report, "no-system").exact
    assert drifts(report) == dict.fromkeys(set(TEXT_SCENARIOS) - {"no-system"}, Cause.TEMPLATE_RAISES)
    assert "System role not supported" in finding(report, "user").why
    assert "ends FAILED" in finding(report, "user").engine


def test_a_template_that_raises_on_the_whole_conversation_only(scratch):
    """Every delta encodes, but the re-render of three turns raises: the drift check could not run."""
    report = check(scratch, SHORT_CONVERSATIONS_ONLY)
    assert drifts(report) == dict.fromkeys(TEXT_SCENARIOS, Cause.TEMPLATE_RAISES)
    failed = finding(report, "user")
    assert "whole conversation after turn 2" in failed.why and "at most three replies" in failed.why
    assert "drift_check_every" in failed.engine


# -- the command: exit codes, directories, bad input -------------------------------------------------------
def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["check-template", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_embedded_tokenizer_is_exact_and_exits_0(capsys):
    """The default vocabulary's own template (Qwen2.5's), without the fixtures."""
    code, out, _ = run(capsys, "qwen2.5")
    assert code == 0
    assert "verdict: exact in all 8 scenarios" in out and out.count("  exact  ") == len(TEXT_SCENARIOS)


def test_a_tokenizer_directory_exits_1_when_it_drifts_and_0_with_an_exact_template(
    capsys, tmp_path, templates_dir, scratch
):
    scratch.chat_template = (templates_dir / "Qwen3-0.6B.jinja").read_text()
    scratch.save_pretrained(tmp_path / "qwen3")
    code, out, _ = run(capsys, str(tmp_path / "qwen3"), "--json")
    report = json.loads(out)
    assert code == 1 and report["exact"] is False
    assert {s["scenario"]: s["cause"] for s in report["scenarios"] if not s["exact"]} == VERDICTS["Qwen3-0.6B"]
    exact_template = str(templates_dir / "Qwen2.5-7B-Instruct.jinja")
    code, out, _ = run(capsys, str(tmp_path / "qwen3"), "--chat-template", exact_template)
    assert code == 0 and "verdict: exact" in out


@pytest.mark.slow
def test_a_processor_directory_checks_images(capsys, tmp_path, processor):
    processor.save_pretrained(tmp_path / "vl")
    code, out, _ = run(capsys, str(tmp_path / "vl"))
    assert code == 0
    assert "exact  images" in out and "images not checked" not in out


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "make_argv, message",
    [
        (lambda d: [str(d / "nope.jinja")], "nope.jinja: no such file or directory"),
        (lambda d: [write(d, "notes.txt", "hello, no template here")], "notes.txt: not a chat template"),
        (
            lambda d: [
                write(d, "t.jinja", "{% for m in messages %}{{ m.content }"),
            ],
            "does not render",
        ),
        (lambda d: [write(d, "t.jinja", "{{ raise_exception('no chat here') }}")], "no chat here"),
        (lambda d: ["qwen2.5", "--template-kwargs", "{enable"], "--template-kwargs is not JSON"),
        (lambda d: ["qwen2.5", "--template-kwargs", "[1]"], "expected a JSON object"),
        (lambda d: [str(d), "--vision"], "--vision applies to a .jinja file"),
        (
            lambda d: [write(d, "t.jinja", "{{ x }}"), "--chat-template", write(d, "u.jinja", "{{ y }}")],
            "template already",
        ),
        (lambda d: [str(d)], "does not load as a tokenizer or processor"),
    ],
    ids=[
        "missing",
        "not-jinja",
        "syntax",
        "raises",
        "kwargs-json",
        "kwargs-list",
        "vision-dir",
        "two-templates",
        "empty-dir",
    ],
)
def test_bad_input_is_one_error_and_exit_2(capsys, tmp_path, make_argv, message):
    code, out, err = run(capsys, *make_argv(tmp_path))
    assert code == 2 and out == ""
    assert err.startswith("turnstile check-template: ") and err.count("\n") == 1
    assert message in err
