"""Model families on the official templates of 2026 models (tests/fixtures/chat_templates, with the models'
own special tokens over the Qwen vocabulary): each template is found as its family, and `turnstile
check-template` runs each scenario with replies in the family's real shape (reasoning, tool calls as the
family writes them, harmony's channels). The verdicts below are read off each template; a template that
cannot take a tool message at all (gemma-3) is named as such, and an env that declares tool observations
with it is refused at start.

A template of a family the engine has no parser for (SGLang's minimax-m2, minimax-m3, ling3, minicpm5) gets the
parser read off its template (engine/probe.py), and replies in that shape; where none is found (MiniMax-M3),
plain-text replies ended by the template's end-of-turn token. Its verdict is written down so that a change either
way shows here."""

from __future__ import annotations

import json

import anyio
import pytest

from engine.config import EngineConfig
from engine.encoding import ChatEncoder
from engine.engine import RolloutEngine
from engine.envs.base import EnvRunner
from engine.families import FAMILIES, family_named, find_family
from engine.metrics.recorder import MetricsRecorder
from engine.scheduler.retry import RetryPolicy
from engine.template_check import EMPTY_THINK, Target, check_template, sampled_reply
from engine.template_drift import SCENARIOS, Cause
from engine.trajectory import Status
from engine.turn import TurnLimits
from tests.fakes import ScriptedBackend, ScriptedEnv
from tests.family_fixtures import FAMILY_TEMPLATES, NAMES, family_tokenizer

H, SYS, MERGED = Cause.HISTORY_REWRITTEN, Cause.SYSTEM_MOVED, Cause.MERGED_TOKEN
RAISES, NO_ROLE = Cause.TEMPLATE_RAISES, Cause.NO_ROLE
TEXT = [s.name for s in SCENARIOS if not s.images]
TOOL_SCENARIOS = ("tool", "tool+tools", "reasoning+tool")

FAMILY_OF = {
    "Qwen-Qwen3-4B-Thinking-2507": "qwen25",
    "Qwen-Qwen3-Coder-30B-A3B-Instruct": "qwen3_coder",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": "deepseekv31",
    "deepseek-ai-DeepSeek-V3.1": "deepseekv31",
    "google-gemma-3-4b-it": None,
    "mistralai-Mistral-Nemo-Instruct-2407": "mistral",
    "moonshotai-Kimi-K2-Instruct": "kimi_k2",
    "moonshotai-Kimi-K2-Thinking": "kimi_k2",
    "openai-gpt-oss-120b": "gpt-oss",
    "zai-org-GLM-4.7-Flash": "glm47",
    "Qwen-Qwen3.5-4B": "qwen3_coder",
    "stepfun-ai-Step-3.5-Flash": "qwen3_coder",  # SGLang's step3p5: ChatML with Qwen3-Coder's XML calls
    "moonshotai-Kimi-K2.5": "kimi_k2",
    "zai-org-GLM-5.1": "glm47",
    "zai-org-GLM-4.6V-Flash": "glm45",  # a newline between a call's parts: GLM-4.5's form
    "mistralai-Devstral-Small-2-24B-Instruct-2512": "mistral",
    "MiniMaxAI-MiniMax-M2.7": None,  # minimax-m2
    "MiniMaxAI-MiniMax-M3": None,  # minimax-m3
    "inclusionAI-Ling-3.0-flash": None,  # ling3
    "openbmb-MiniCPM5-1B": None,  # minicpm5
}

VERDICTS: dict[str, dict[str, Cause]] = {
    # The generation prompt opens `<think>\n`; history drops what the model reasoned before the last user query,
    # that `<think>` included. With tool observations every reply keeps its reasoning.
    "Qwen-Qwen3-4B-Thinking-2507": dict.fromkeys(set(TEXT) - {"reasoning+tool"}, H),
    # ChatML with its XML calls written as the model writes them; no reasoning: exact.
    "Qwen-Qwen3-Coder-30B-A3B-Instruct": {},
    # Its generation prompt opens `<think>\n`; history writes a reply without its think block (the reply closes the
    # block, `</think>`, as a model does) and writes no tool calls at all: a call or reasoning cannot be replayed.
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": dict.fromkeys(("user", "no-system", "user+tools", "trailing-space"), H)
    | dict.fromkeys(("tool", "tool+tools", "reasoning", "reasoning+tool"), RAISES),
    # thinking off (the template's default): `</think>` in the prompt, replies and calls appended as written.
    "deepseek-ai-DeepSeek-V3.1": {},
    # No tool role (roles must alternate), and the model's text trimmed in history.
    "google-gemma-3-4b-it": dict.fromkeys(TOOL_SCENARIOS, NO_ROLE) | {"trailing-space": H},
    # The system prompt goes into the last user message; without one, the dummy's system prompt shows up there.
    "mistralai-Mistral-Nemo-Instruct-2407": dict.fromkeys(TEXT, SYS),
    "moonshotai-Kimi-K2-Instruct": {},
    # The content trimmed in history; an earlier reply's reasoning left out (the template writes `<think></think>`
    # for a reply without reasoning_content, so a scenario that gives none to a model that reasons would pass).
    "moonshotai-Kimi-K2-Thinking": {"trailing-space": H, "reasoning": H},
    # History ends a final answer with <|end|> where the model sampled <|return|>, and drops its analysis
    # channel; a call ends in <|call|> as sampled, and its analysis stays until a final answer follows.
    "openai-gpt-oss-120b": dict.fromkeys(("user", "no-system", "user+tools", "reasoning", "trailing-space"), H),
    # The generation prompt opens `<think>`; history writes `</think>` alone for replies before the last user.
    "zai-org-GLM-4.7-Flash": dict.fromkeys(set(TEXT) - {"reasoning+tool"}, H),
    # The generation prompt opens `<think>\n`; history drops the reasoning of replies before the last user query,
    # that `<think>` included (Qwen3-Thinking's rule). A call without reasoning: the prompt's `<think>\n` and the
    # reply's `\n</think>` meet at a token boundary that a re-render tokenizes as one `\n\n` (Step-3.5 the same).
    "Qwen-Qwen3.5-4B": dict.fromkeys(set(TEXT) - {"reasoning+tool", "tool", "tool+tools"}, H)
    | dict.fromkeys(("tool", "tool+tools"), MERGED),
    "stepfun-ai-Step-3.5-Flash": dict.fromkeys(set(TEXT) - {"reasoning+tool", "tool", "tool+tools"}, H)
    | dict.fromkeys(("tool", "tool+tools"), MERGED),
    "moonshotai-Kimi-K2.5": {"trailing-space": H, "reasoning": H},  # Kimi-K2-Thinking's layout
    # GLM-4.7's rule (`<think>` opened by the prompt, `</think>` alone in history before the last user message), but
    # with tool observations only the reply keeps its think block as sampled: both tool scenarios are exact.
    "zai-org-GLM-5.1": dict.fromkeys(set(TEXT) - {"reasoning+tool", "tool", "tool+tools"}, H),
    # No think block in the generation prompt; history writes `<think></think>` for replies before the last user,
    # and the content stripped.
    "zai-org-GLM-4.6V-Flash": {"reasoning": H, "trailing-space": H},
    # The system prompt stays first ([SYSTEM_PROMPT]); replies and calls are appended as written: exact.
    "mistralai-Devstral-Small-2-24B-Instruct-2512": {},
    # Families the engine has no parser for: M2.7's, Ling-3's and MiniCPM5's call syntax is read off their templates
    # (engine/probe.py), so their replies are in the model's shape, calls structured. M2.7's prompt opens `<think>\n`,
    # which history leaves out of a reply without reasoning (the reply that reasons and calls keeps it: exact).
    "MiniMaxAI-MiniMax-M2.7": dict.fromkeys(set(TEXT) - {"reasoning+tool"}, H),
    # M3's arguments close with a tag named after each (no probed layout reads them): replies are plain text. Its
    # history writes `</mm:think>` before such a reply, which its prompt did not; a tool message after a reply
    # without a structured call makes the whole conversation raise.
    "MiniMaxAI-MiniMax-M3": dict.fromkeys(set(TEXT) - set(TOOL_SCENARIOS), H) | dict.fromkeys(TOOL_SCENARIOS, RAISES),
    # The content trimmed in history; everything else appended as written.
    "inclusionAI-Ling-3.0-flash": {"trailing-space": H},
    # ChatML that drops the reasoning of replies before the last user query.
    "openbmb-MiniCPM5-1B": {"reasoning": H},
}


@pytest.mark.parametrize("name", NAMES)
def test_each_template_is_found_as_its_family(name):
    family = find_family((FAMILY_TEMPLATES / f"{name}.jinja").read_text())
    assert (family.name if family else None) == FAMILY_OF[name]
    assert ChatEncoder(family_tokenizer(name)).family == family


@pytest.mark.parametrize("name", NAMES)
def test_each_family_template_gets_its_verdict(name):
    report = check_template(Target(name, family_tokenizer(name)))
    drifts = {f.scenario: f.cause for f in report.findings if not f.exact}
    assert drifts == VERDICTS[name]
    for f in report.findings:  # a drift says where and why: never a bare failure without a cause
        assert f.exact or (f.cause is not None and f.why)


@pytest.mark.parametrize("name", ["zai-org-GLM-4.7-Flash", "openai-gpt-oss-120b"])
def test_glm_and_gpt_oss_tool_observations_encode(name):
    """The issue's two failures: GLM's turn ends on the opener of the next message, gpt-oss names the call in
    the tool message's header. Their tool scenarios are exact or drift with a named cause, never fail."""
    report = check_template(Target(name, family_tokenizer(name)))
    for f in report.findings:
        if f.scenario in TOOL_SCENARIOS:
            assert f.exact or (f.position is not None and f.cause == H), f


def test_glm_observation_starts_after_the_opener_the_model_sampled():
    tokenizer = family_tokenizer("zai-org-GLM-4.7-Flash")
    encoder = ChatEncoder(tokenizer)
    observation_id, user_id = tokenizer.convert_tokens_to_ids(["<|observation|>", "<|user|>"])
    assert set(encoder.stop_token_ids) >= {observation_id, user_id}
    tool = {"role": "tool", "tool_call_id": "call00000", "name": "calc_score", "content": "41 is wrong."}
    delta = tokenizer.decode(encoder.encode_observation(tool).token_ids)
    assert delta == "<tool_response>41 is wrong.</tool_response><|assistant|><think>"
    assert encoder.closing_ids([5, observation_id], tool) == []  # the model's opener stays, mask 1
    assert encoder.closing_ids([5, user_id], tool) == [observation_id]  # another opener: the right one, mask 0
    assert encoder.closing_ids([5], {"role": "user", "content": "x"}) == [user_id]  # cut at the cap


def test_gpt_oss_tool_message_names_the_call_and_return_ends_a_turn():
    tokenizer = family_tokenizer("openai-gpt-oss-120b")
    encoder = ChatEncoder(tokenizer)
    call_id, return_id, end_id = tokenizer.convert_tokens_to_ids(["<|call|>", "<|return|>", "<|end|>"])
    assert set(encoder.stop_token_ids) >= {call_id, return_id}
    tool = {"role": "tool", "tool_call_id": "call00000", "name": "calc_score", "content": "41 is wrong."}
    delta = tokenizer.decode(encoder.encode_observation(tool).token_ids)
    assert delta.startswith("<|start|>functions.calc_score to=assistant<|channel|>commentary<|message|>")
    assert encoder.closing_ids([5, return_id], {"role": "user", "content": "x"}) == []  # <|return|> stands for <|end|>
    assert encoder.closing_ids([5], {"role": "user", "content": "x"}) == [end_id]


def test_an_env_that_declares_tool_observations_is_refused_at_start_where_the_template_has_no_tool_role():
    encoder = ChatEncoder(family_tokenizer("google-gemma-3-4b-it"))
    encoder.check_env("my_env", ("user",), skip_special_tokens=True)  # user observations: fine
    with pytest.raises(ValueError, match="env my_env sends 'tool' observations, but the chat template cannot render"):
        encoder.check_env("my_env", ("user", "tool"), skip_special_tokens=True)


def test_tool_calls_written_in_special_tokens_need_them_kept_in_the_env_text():
    encoder = ChatEncoder(family_tokenizer("moonshotai-Kimi-K2-Instruct"))
    encoder.check_env("my_env", ("tool",), skip_special_tokens=False)
    with pytest.raises(ValueError, match="skip_special_tokens drops"):
        encoder.check_env("my_env", ("tool",), skip_special_tokens=True)


def test_family_names_follow_sglang_and_unknown_ones_are_one_error():
    assert {f.name for f in FAMILIES} >= {"qwen25", "qwen3_coder", "glm45", "kimi_k2", "gpt-oss", "deepseekv31"}
    assert family_named("glm").name == "glm45"  # SGLang's alias
    with pytest.raises(ValueError, match="model family 'hermes2': not one of gpt-oss, glm47"):
        family_named("hermes2")


def test_a_tool_message_without_the_call_it_answers_gets_the_models_call():
    """Harmony names the tool in the tool message's header, Kimi-K2 the call id: an env that sends a bare tool
    message (python_tool does) gets the model's call; one that names it keeps its own; a malformed turn's stays."""
    tokenizer = family_tokenizer("moonshotai-Kimi-K2-Instruct")
    encoder = ChatEncoder(tokenizer)
    call = encoder.family.parser.format_call("run_python", {"code": "print(1)"}, index=3)
    generated = tokenizer(call, add_special_tokens=False)["input_ids"]
    bare = {"role": "tool", "content": "1"}
    assert encoder.naming_the_calls(bare, generated) == bare | {
        "tool_call_id": "functions.run_python:3",
        "name": "run_python",
    }
    named = bare | {"tool_call_id": "mine", "name": "other"}
    assert encoder.naming_the_calls(named, generated) == named
    broken = tokenizer("<|tool_calls_section_begin|><|tool_call_begin|>", add_special_tokens=False)["input_ids"]
    assert encoder.naming_the_calls(bare, broken) == bare
    assert encoder.naming_the_calls({"role": "user", "content": "1"}, generated) == {"role": "user", "content": "1"}


# -- check-template against the runtime's own drift check -------------------------------------------------------


async def runtime_verdict(tokenizer, scenario) -> str:
    """The scenario's conversation run by the engine itself (RolloutEngine, an env answering with the scenario's
    observations, the replies check-template samples), with the runtime drift check on every trajectory: "exact",
    "drift", or "fails" (the trajectory failed: a template that raises)."""
    encoder = ChatEncoder(tokenizer, tools=scenario.tools)
    prompt, observations = scenario.prompt(), scenario.observations(encoder)
    replies = [
        sampled_reply(encoder, prompt, reply, following)
        for reply, following in zip(scenario.replies(encoder), [*observations, None], strict=True)
    ]
    recorder = MetricsRecorder()
    config = EngineConfig(
        n_samples_per_prompt=1, drift_check_every=1, max_failed_share=1.0, retry=RetryPolicy(backoff_base_s=0.0),
        limits=TurnLimits(max_turns=len(replies), max_tokens=8192), max_new_tokens=4096,
    )  # fmt: skip
    env = ScriptedEnv(observations=[*observations, {"role": "user", "content": "done"}], done_at_end=False)
    async with RolloutEngine(
        backend=ScriptedBackend(replies), encoder=encoder, env_factory=lambda sample: EnvRunner(env),
        source=[{"prompt": prompt, "label": ""}], config=config, observers=[recorder],
    ) as engine:  # fmt: skip
        [group] = await engine.rollout(1)
    [trajectory] = group.trajectories
    if trajectory.status is Status.FAILED:
        return "fails"
    assert len(trajectory.turns) == len(replies) and sum(recorder.drift_checks.values()) == 1
    return next(iter(recorder.drift_checks))


@pytest.mark.parametrize("name", NAMES)
def test_no_scenario_passes_that_the_runtime_drift_check_flags(name):
    """check-template's verdict per scenario against the engine's own run of the same replies with
    `drift_check_every=1`: exact in check-template is exact at runtime, and a drift at the end is one there."""
    tokenizer = family_tokenizer(name)
    report = {f.scenario: f for f in check_template(Target(name, tokenizer)).findings}
    disagree = {}
    for scenario in SCENARIOS:
        finding = report.get(scenario.name)
        if scenario.images or finding is None or finding.cause in (NO_ROLE, Cause.NO_TURN_BOUNDARY):
            continue  # no images here; a template the engine refuses at start has no runtime to compare
        if not finding.exact and "a reply of the model" in finding.why:
            continue  # the template does not write the reply (R1-Distill's calls and reasoning): none to replay
        if finding.exact or finding.checkpoint == "at the end" or finding.cause is RAISES:
            runtime = anyio.run(runtime_verdict, tokenizer, scenario)
            expected = "exact" if finding.exact else ("fails" if finding.cause is RAISES else "drift")
            if runtime != expected and not (expected == "fails" and runtime == "drift"):
                disagree[scenario.name] = (expected, runtime)
    assert disagree == {}


@pytest.mark.parametrize("name", [n for n in NAMES if n not in ("google-gemma-3-4b-it", "MiniMaxAI-MiniMax-M3")])
def test_check_templates_replies_are_what_the_family_writes_read_back_by_its_parser(name):
    """The replies check-template samples are in the model's own shape: its parser reads back each reply's calls,
    and its reasoning wherever the model reasons (the generation prompt opens the think block, or the template
    writes an empty one for a reply): a template that leaves reasoning out of what it writes for a reply does not
    leave it out of what the model samples (else the reasoning scenario passes where the runtime check drifts).
    The parser is the family's, or the one read off the template (all but the two with none: gemma-3, MiniMax-M3)."""
    tokenizer = family_tokenizer(name)
    assert ChatEncoder(tokenizer).parser is not None
    for scenario in SCENARIOS:
        if not scenario.reply.startswith("reasoning") and not scenario.reply.endswith("call"):
            continue
        encoder = ChatEncoder(tokenizer, tools=scenario.tools)
        replies, observations = scenario.replies(encoder), scenario.observations(encoder)
        plain = encoder.render([*scenario.prompt(), {"role": "assistant", "content": "x"}], add_generation_prompt=False)
        reasons = encoder.opens_reasoning or EMPTY_THINK.search(plain) is not None
        for reply, following in zip(replies, [*observations, None], strict=True):
            try:
                sampled = sampled_reply(encoder, scenario.prompt(), reply, following)
            except ValueError:
                assert name == "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B"  # writes no reply after its own prompt
                break
            read = encoder.parse_turn(sampled)
            written = [(c["function"]["name"], c["function"]["arguments"]) for c in reply.get("tool_calls", [])]
            written = [(n, a if isinstance(a, dict) else json.loads(a)) for n, a in written]
            # values written as bare text decode by the tools' declared types: without a tools list "40" reads as 40
            assert [(c.name, as_text(c.arguments)) for c in read.tool_calls] == [(n, as_text(a)) for n, a in written], (
                scenario.name,
                reply,
            )
            if reasons and reply.get("reasoning_content"):
                assert read.reasoning.strip() == reply["reasoning_content"], (scenario.name, read)


def as_text(arguments: dict) -> dict:
    return {key: str(value) for key, value in arguments.items()}


def test_a_token_merged_where_the_prompt_and_the_reply_meet_is_named_so():
    """Qwen3.5's generation prompt ends `<think>\\n` and a reply without reasoning starts `\\n</think>`: the same
    text, which a re-render tokenizes as one `\\n\\n` token. Not "separators between turns": a merged token, and
    where."""
    name = "Qwen-Qwen3.5-4B"
    [finding] = [f for f in check_template(Target(name, family_tokenizer(name))).findings if f.scenario == "tool"]
    assert finding.cause is MERGED and finding.part == "prompt"
    assert "where the generation prompt's end and reply 0 meet" in finding.why
