"""The python_agent env's agent program: an OpenAI Agents SDK agent whose one tool, `python`, runs code in the
python_tool sandbox. It reads its task as JSON on stdin (`instructions`, `question`, `max_turns`, `sandbox`),
calls the model at OPENAI_BASE_URL (its session of the gateway), and prints one JSON line: `final_output` (None
when it ran out of turns) and `turns`.

    echo '{"instructions": "...", "question": "...", "max_turns": 6}' | python -m engine.envs.python_agent.agent
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import agents
from openai import AsyncOpenAI

from engine.envs.python_tool.sandbox import SandboxLimits, run_python


async def main() -> None:
    task = json.loads(sys.stdin.read())
    limits = SandboxLimits.model_validate(task.get("sandbox") or {})
    agents.set_tracing_disabled(True)  # nothing leaves the machine but the model calls

    @agents.function_tool
    async def python(code: str) -> str:
        """Run Python 3 code in a fresh sandboxed process (standard library only, no network, a few seconds) and
        return its exit status, stdout and stderr.

        Args:
            code: Python 3 source to run; print what you want to see.
        """
        return (await run_python(code, limits)).observation()

    client = AsyncOpenAI(max_retries=2)  # OPENAI_BASE_URL and OPENAI_API_KEY: the session's
    model = agents.OpenAIChatCompletionsModel(model=os.environ.get("TURNSTILE_MODEL", "policy"), openai_client=client)
    agent = agents.Agent(name="python", instructions=task["instructions"], tools=[python], model=model)
    try:
        result = await agents.Runner.run(agent, task["question"], max_turns=task["max_turns"])
    except agents.MaxTurnsExceeded as exc:
        print(json.dumps({"final_output": None, "stopped": str(exc), "turns": task["max_turns"]}))
        return
    finally:
        await client.close()
    print(json.dumps({"final_output": str(result.final_output), "turns": len(result.raw_responses)}))


if __name__ == "__main__":
    asyncio.run(main())
