"""Built-in agent env `python_agent`: an agent program written with the OpenAI Agents SDK (agent.py), whose one
tool runs Python in the python_tool sandbox, solves a python_tool task against its session of the gateway; the
task's checker judges its final answer (`<answer>...</answer>`, else the whole final output).

    turnstile run --env python_agent --num-prompts 4

The rows are python_tool's (`make_prompts`): the system message is the agent's instructions, the last user
message its task. The agent runs as a subprocess (`python -m engine.envs.python_agent.agent`, the task on its
stdin); the engine serves its session and ends the process, and whatever it started, when the episode ends.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from engine.agents.env import AgentEnv, AgentFailed, AgentRun
from engine.envs.python_tool import SandboxLimits, make_prompts, task_of_sample
from engine.envs.python_tool.env import ANSWER
from engine.envs.python_tool.tasks import Task

__all__ = ["PythonAgentEnv", "build_env", "make_prompts"]


class PythonAgentEnv(AgentEnv):
    """One python_tool task, solved by the agent program; `info["reward"]` is 1.0 when the checker passes it."""

    def __init__(self, task: Task, prompt: Any, *, limits: SandboxLimits, max_turns: int, timeout_s: float):
        self.task, self.prompt, self.limits, self.max_turns = task, prompt, limits, max_turns
        self.timeout_s = timeout_s

    async def run(self, agent: AgentRun) -> dict[str, Any]:
        messages = self.prompt if isinstance(self.prompt, list) else [{"role": "user", "content": str(self.prompt)}]
        instructions = "\n".join(m["content"] for m in messages if m.get("role") == "system")
        question = next(m["content"] for m in reversed(messages) if m.get("role") == "user")
        task = {
            "instructions": instructions,
            "question": question,
            "max_turns": self.max_turns,
            "sandbox": self.limits.model_dump(),
        }
        program = [sys.executable, "-m", "engine.envs.python_agent.agent"]
        result = await agent.run_process(program, stdin=json.dumps(task).encode())
        try:
            final = json.loads(result.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError) as exc:
            raise AgentFailed(f"the agent printed no result: {result.stdout[-500:]!r}") from exc
        info: dict[str, Any] = {"task_id": self.task.id, "agent_turns": final.get("turns")}
        output = final.get("final_output")
        if output is None:  # out of turns without a final answer
            return info | {"reward": 0.0, "verdict": final.get("stopped", "no final output")}
        answers = ANSWER.findall(output)
        verdict = await self.task.checker.check(answers[-1] if answers else output, self.limits)
        return info | {"reward": 1.0 if verdict.passed else 0.0, "verdict": verdict.detail}


def build_env(sample: Any = None, args: Any = None, **kw: Any) -> PythonAgentEnv:
    """A PythonAgentEnv for a python_tool row (its `metadata`: `task_id` or `checker`, and `sandbox`). The agent's
    turn limit is `max_turns=`, else `args.max_turns`, else python_tool's default; its deadline `timeout_s=`, else
    300 s."""
    task, limits, max_turns = task_of_sample(sample, args, kw, env="python_agent")
    prompt = getattr(sample, "prompt", None) or task.question
    return PythonAgentEnv(task, prompt, limits=limits, max_turns=max_turns, timeout_s=kw.get("timeout_s", 300.0))
