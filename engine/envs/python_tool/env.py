"""The python tool env: the model may run Python in a sandbox, then gives a final answer a checker judges.

Each reply is one of:

- a tool call, `<tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call>` (or the running
  model family's format, engine/envs/tool_calls.py): the code runs in a fresh sandboxed process
  (sandbox.py) and its exit status and output come back as a `tool` message;
- a final answer, `<answer>...</answer>`: the task's checker judges it, `info["reward"]` is 1.0 or 0.0,
  and the episode ends;
- anything else (a malformed call, neither a call nor an answer): one observation saying what is wrong
  and how to do it right, and another turn.

A reply with a tool call runs it; an answer is read from a reply without one. On the episode's last
turn (`max_turns`) a reply that does not answer ends it with reward 0.0, so every episode has a reward.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.envs.base import AsyncInteractionEnv
from engine.envs.python_tool.sandbox import SandboxLimits, run_python
from engine.envs.python_tool.tasks import Task
from engine.envs.tool_calls import MalformedToolCall, Tool, parse_tool_calls

DEFAULT_MAX_TURNS = 6
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)  # a final answer, as the system prompt asks for it


class PythonArguments(BaseModel):
    model_config = ConfigDict(extra="forbid")

    code: str = Field(description="Python 3 source to run; print what you want to see.")

    @field_validator("code")
    @classmethod
    def _not_empty(cls, code: str) -> str:
        if not code.strip():
            raise ValueError("is empty: give the code to run")
        return code


PYTHON_TOOL = Tool(
    "python",
    "Run Python 3 code in a fresh sandboxed process (standard library only, no network, a few seconds) and "
    "return its exit status, stdout and stderr.",
    PythonArguments,
    example={"code": "print(2 ** 10)"},
)

SYSTEM_PROMPT = (
    "Solve the task. You may run Python code with the python tool as often as you need; each call runs in a "
    "fresh process and returns what the code printed. When you are done, reply with the final answer inside "
    "<answer></answer>: a number for a question, the complete function definition for a programming task."
)


class PythonToolEnv(AsyncInteractionEnv):
    # Each tool call runs in a fresh sandbox and the env keeps only a turn count: reset() and the same
    # replies rebuild the same state (the replies' code runs again).
    replay_safe = True

    def __init__(self, task: Task, *, limits: SandboxLimits | None = None, max_turns: int = DEFAULT_MAX_TURNS):
        self.task = task
        self.limits = limits or SandboxLimits()
        self.max_turns = max_turns
        self.num_turns = 0
        self.num_tool_calls = 0

    async def areset(self) -> tuple[dict[str, Any], dict[str, Any]]:
        self.num_turns = self.num_tool_calls = 0
        return {}, {}

    async def astep(self, response_text: str) -> tuple[dict[str, Any], bool, dict[str, Any]]:
        self.num_turns += 1
        info: dict[str, Any] = {"task_id": self.task.id, "turn": self.num_turns}
        try:
            calls = parse_tool_calls(response_text, [PYTHON_TOOL])
        except MalformedToolCall as error:
            return self._again(error.observation, "tool", info | {"malformed_call": str(error.kind)})
        if calls:
            return await self._run(calls[0].arguments["code"], info)
        answers = ANSWER.findall(response_text)
        if not answers:
            hint = "Reply with a python tool call, or with the final answer as <answer>...</answer>."
            return self._again(f"No tool call and no answer. {hint}", "user", info | {"no_action": True})
        verdict = await self.task.checker.check(answers[-1], self.limits)
        reward = 1.0 if verdict.passed else 0.0
        text = f"Correct: {verdict.detail}." if verdict.passed else f"Not correct: {verdict.detail}."
        return {"obs_str": text}, True, info | {"reward": reward, "verdict": verdict.detail}

    def format_observation(self, observation: dict[str, Any]) -> dict[str, Any]:
        """A `tool` message for what the tool said (the chat template wraps it in <tool_response>), else a
        `user` message."""
        return {"role": observation.get("role", "user"), "content": observation.get("obs_str", "")}

    async def _run(self, code: str, info: dict[str, Any]) -> tuple[dict[str, Any], bool, dict[str, Any]]:
        if self.num_turns >= self.max_turns:
            return self._out_of_turns(info)
        self.num_tool_calls += 1
        result = await run_python(code, self.limits)
        info |= {"exit_code": result.exit_code, "limits_hit": [str(limit) for limit in result.limits_hit]}
        return {"obs_str": result.observation(), "role": "tool"}, False, info

    def _again(self, text: str, role: str, info: dict[str, Any]) -> tuple[dict[str, Any], bool, dict[str, Any]]:
        if self.num_turns >= self.max_turns:
            return self._out_of_turns(info)
        return {"obs_str": text, "role": role}, False, info

    def _out_of_turns(self, info: dict[str, Any]) -> tuple[dict[str, Any], bool, dict[str, Any]]:
        return {"obs_str": "Out of turns without an answer."}, True, info | {"reward": 0.0}
