"""A five-turn tool-using trajectory per model family, through the engine's turn loop (`run_trajectory`), on
the official templates (tests/fixtures/chat_templates). The model reasons and calls a tool as its family
writes it; a tool env reads the call through `parse_tool_calls` and answers with a tool message that names no
call (as the built-in python_tool does); one answer is a user message. What must hold:

- each turn's tokens are exactly what the model sampled, loss mask 1;
- each observation's tokens, loss mask 0, are the closing token (if any) and then exactly what the template
  writes after the model's turn: the conversation so far rendered whole, with the turn as a structured message
  (reasoning, tool calls) and the observation naming the call, ends with the model's turn as sampled followed
  by those tokens' text. Where the template itself rewrites the turn once a user message follows (drops its
  reasoning), that is listed below, and the observation is still exactly the template's tail."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict

from engine.backends.base import SamplingParams
from engine.encoding import DUMMY_MESSAGES, ChatEncoder
from engine.envs.base import BaseInteractionEnv, EnvRunner
from engine.envs.tool_calls import Tool, ToolCall, parse_tool_calls
from engine.scheduler.reference import run_trajectory
from engine.template_check import sampled_reply
from engine.trajectory import Status, StopReason, Trajectory
from engine.turn import TurnLimits
from tests.fakes import ScriptedBackend
from tests.family_fixtures import family_tokenizer

TEMPLATES = [
    "Qwen-Qwen3-4B-Thinking-2507",
    "Qwen-Qwen3-Coder-30B-A3B-Instruct",
    "deepseek-ai-DeepSeek-V3.1",
    "mistralai-Mistral-Nemo-Instruct-2407",
    "moonshotai-Kimi-K2-Instruct",
    "moonshotai-Kimi-K2-Thinking",
    "openai-gpt-oss-120b",
    "zai-org-GLM-4.7-Flash",
    "Qwen-Qwen3.5-4B",
    "stepfun-ai-Step-3.5-Flash",
    "moonshotai-Kimi-K2.5",
    "zai-org-GLM-5.1",
    "zai-org-GLM-4.6V-Flash",
    "mistralai-Devstral-Small-2-24B-Instruct-2512",
]  # gemma-3 has no tool role (refused at start); R1-Distill writes no reply after its own `<think>` prompt; the
# templates of families the engine does not know have their own test below

# Turns the template writes otherwise once a user message follows it (the third): it drops the turn's reasoning
# (history keeps reasoning only after the last user message; harmony also ends the final answer in <|end|>).
REWRITTEN = {
    "Qwen-Qwen3-4B-Thinking-2507": {2},
    "openai-gpt-oss-120b": {2},
    "zai-org-GLM-4.7-Flash": {2},
    "Qwen-Qwen3.5-4B": {2},
    "stepfun-ai-Step-3.5-Flash": {2},
    "zai-org-GLM-5.1": {2},
    "zai-org-GLM-4.6V-Flash": {2},
    # Their history writes an empty `<think></think>` (K2.5: `</think>`) where the model wrote its reasoning.
    "moonshotai-Kimi-K2-Thinking": {2},
    "moonshotai-Kimi-K2.5": {2},
}

# Mistral's template writes the system prompt into the last user message: a user observation carries the system
# prompt of the encoder's dummy conversation where a re-render writes the trajectory's (check-template's verdict).
SYSTEM_MOVED = {"mistralai-Mistral-Nemo-Instruct-2407"}

SYSTEM = "You solve arithmetic problems. Check an answer with calc_score before you give it."
QUESTION = "What is 17 + 25?"


class Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")
    answer: str


CALC = Tool("calc_score", "Says whether an answer is right.", Answer, {"answer": "42"})


@dataclass
class CalcEnv(BaseInteractionEnv):
    """A tool env: a call gets a tool message (no tool_call_id, no name), a final answer without a call gets a
    user message until it is 42."""

    calls: list[ToolCall | None] = field(default_factory=list)

    def reset(self):
        return {}, {}

    def step(self, response_text: str):
        calls = parse_tool_calls(response_text, [CALC])
        self.calls.append(calls[0] if calls else None)
        if calls:
            answer = calls[0].arguments["answer"]
            return {"role": "tool", "content": f"{answer} is {'right' if answer == '42' else 'wrong'}."}, False, {}
        if "42" in response_text:
            return {"role": "user", "content": "Done."}, True, {"reward": 1.0}
        return {"role": "user", "content": "Check your answer with the tool first."}, False, {}

    def format_observation(self, observation):
        return observation


def model_turns(encoder: ChatEncoder) -> list[dict[str, Any]]:
    """The five turns as structured assistant messages: call 40, call 41, answer 41, call 42, answer 42."""
    turns: list[dict[str, Any]] = []
    calls = 0
    for i, (call, answer) in enumerate([(True, 40), (True, 41), (False, 41), (True, 42), (False, 42)]):
        thinking = f"I add 17 and 25, attempt {i}."
        message: dict[str, Any] = {
            "role": "assistant", "content": "" if call else f"The answer is {answer}.",
            "reasoning_content": thinking, "thinking": thinking,
        }  # fmt: skip
        if call:
            call_id = encoder.family.call_id("calc_score", calls)
            message["tool_calls"] = [encoder.tool_call(call_id, "calc_score", {"answer": str(answer)})]
            calls += 1
        turns.append(message)
    return turns


def observation_for(turn: dict[str, Any], answer_right: bool) -> dict[str, Any]:
    """What the env answers, as the template is to see it: a tool message naming the call it answers."""
    if "tool_calls" not in turn:
        return {"role": "user", "content": "Check your answer with the tool first."}
    call = turn["tool_calls"][0]
    answer = call["function"]["arguments"]
    answer = answer["answer"] if isinstance(answer, dict) else answer.split('"')[3]
    content = f"{answer} is {'right' if answer_right else 'wrong'}."
    return {"role": "tool", "tool_call_id": call["id"], "name": "calc_score", "content": content}


@pytest.mark.anyio
@pytest.mark.parametrize("name", TEMPLATES)
async def test_a_five_turn_tool_trajectory_is_token_exact(name):
    encoder = ChatEncoder(family_tokenizer(name)).for_tools([CALC.schema()])
    assert encoder.family is not None
    prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    turns = model_turns(encoder)
    observations = [observation_for(turn, i == 3) for i, turn in enumerate(turns[:-1])]
    conversation = list(prompt)
    sampled: list[list[int]] = []
    for i, turn in enumerate(turns):  # what the model samples after the conversation so far
        following = observations[i] if i < len(observations) else {"role": "user", "content": "Done."}
        sampled.append(sampled_reply(encoder, conversation, turn, following))
        if following["role"] == "tool" and (written := encoder.parse_turn(sampled[-1]).tool_calls[0].id):
            following["tool_call_id"] = written  # the id as the template made the model write it (K2: the index)
        conversation += [turn, following]

    trajectory = Trajectory(prompt=list(prompt))
    env = CalcEnv()
    try:  # as a run checks at start: calls written in special tokens need them kept in the text the env reads
        encoder.check_env("calc", ("user", "tool"), skip_special_tokens=True)
        skip = True
    except ValueError:
        skip = False
    sampling = SamplingParams(max_new_tokens=512, stop_token_ids=encoder.stop_token_ids, skip_special_tokens=skip)
    await run_trajectory(
        trajectory, backend=ScriptedBackend(sampled), env=EnvRunner(env), encoder=encoder, sampling=sampling,
        limits=TurnLimits(max_turns=8),
    )  # fmt: skip
    assert (trajectory.status, trajectory.stop_reason, trajectory.reward) == (
        Status.COMPLETED,
        StopReason.ENV_DONE,
        1.0,
    )
    assert len(trajectory.turns) == 5

    # The env read each call in the family's syntax.
    called = [("calc_score", {"answer": answer}) for answer in ("40", "41", "42")]
    assert [c and (c.name, c.arguments) for c in env.calls] == [called[0], called[1], None, called[2], None]

    trajectory.check_invariant()
    response = list(trajectory.response_ids)
    mask = list(trajectory.loss_mask)
    decode = lambda ids: encoder.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    rewritten = set()
    for i, turn in enumerate(trajectory.turns):
        generated = response[turn.start : turn.start + turn.num_generated]
        assert generated == sampled[i], f"turn {i}: the model's tokens changed"
        assert mask[turn.start : turn.start + turn.num_generated] == [1] * turn.num_generated
        if i == len(trajectory.turns) - 1:
            assert turn.num_observation == 0
            break
        start = turn.start + turn.num_generated
        appended = response[start : start + turn.num_observation]
        assert mask[start : start + turn.num_observation] == [0] * turn.num_observation
        assert turn.observation == observations[i]  # the engine named the call the env's tool message answers
        # The template's own render of the whole conversation so far, the observation last.
        whole = encoder.render(conversation[: 2 * i + 4], add_generation_prompt=True)
        tail = decode(appended)
        if name in SYSTEM_MOVED and observations[i]["role"] == "user":  # the dummy's system prompt, not this one
            tail = tail.replace(DUMMY_MESSAGES[0]["content"], SYSTEM)
        assert whole.endswith(tail), f"turn {i}: the observation is not what the template appends"
        if not whole.endswith(decode(generated) + tail):
            rewritten.add(i)
            assert turns[i]["content"] in whole[: -len(tail)][-200:], f"turn {i}: the template lost the reply"
    assert rewritten == REWRITTEN.get(name, set())


@dataclass
class ParallelEnv(BaseInteractionEnv):
    """Answers a turn's calls with one tool message each (no ids, no names), then ends on the next turn."""

    steps: int = 0

    def reset(self):
        return {}, {}

    def step(self, response_text: str):
        self.steps += 1
        if self.steps > 1:
            return {}, True, {"reward": 1.0}
        calls = parse_tool_calls(response_text, [CALC], max_calls=None)
        return {"answers": [c.arguments["answer"] for c in calls]}, False, {}

    def format_observation(self, observation):
        return [{"role": "tool", "content": f"{answer} is wrong."} for answer in observation["answers"]]


@pytest.mark.anyio
@pytest.mark.parametrize("name", [t for t in TEMPLATES if t != "openai-gpt-oss-120b"])  # harmony: a call ends a turn
async def test_parallel_calls_answered_by_several_tool_messages_are_what_the_template_appends(name):
    encoder = ChatEncoder(family_tokenizer(name)).for_tools([CALC.schema()])
    prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    ids = [encoder.family.call_id("calc_score", i) for i in range(2)]
    turn = {
        "role": "assistant", "content": "", "reasoning_content": "Two guesses.", "thinking": "Two guesses.",
        "tool_calls": [encoder.tool_call(ids[i], "calc_score", {"answer": str(40 + i)}) for i in range(2)],
    }  # fmt: skip
    answers = [{"role": "tool", "tool_call_id": ids[i], "name": "calc_score", "content": f"{40 + i} is wrong."}
               for i in range(2)]  # fmt: skip
    first = sampled_reply(encoder, prompt, turn, answers[0])
    for answer, call in zip(answers, encoder.parse_turn(first).tool_calls, strict=True):
        answer["tool_call_id"] = call.id or answer["tool_call_id"]
    final = {"role": "assistant", "content": "The answer is 42."}
    last = sampled_reply(encoder, [*prompt, turn, *answers], final, {"role": "user", "content": "Done."})
    skip = not encoder.family.parser.delimiters or all(
        d not in encoder.tokenizer.all_special_tokens for d in encoder.family.parser.delimiters
    )
    trajectory = Trajectory(prompt=list(prompt))
    sampling = SamplingParams(max_new_tokens=512, stop_token_ids=encoder.stop_token_ids, skip_special_tokens=skip)
    await run_trajectory(
        trajectory, backend=ScriptedBackend([first, last]), env=EnvRunner(ParallelEnv()), encoder=encoder,
        sampling=sampling, limits=TurnLimits(max_turns=4),
    )  # fmt: skip
    assert trajectory.status == Status.COMPLETED and len(trajectory.turns) == 2
    assert trajectory.turns[0].observation == answers  # each tool message named after its call, in order
    response = list(trajectory.response_ids)
    start = trajectory.turns[0].num_generated
    appended = response[start : start + trajectory.turns[0].num_observation]
    whole = encoder.render([*prompt, turn, *answers], add_generation_prompt=True)
    decode = encoder.tokenizer.decode
    assert whole.endswith(decode(first, skip_special_tokens=False) + decode(appended, skip_special_tokens=False))
