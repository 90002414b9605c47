"""Built-in agent env `agent_command`: any agent CLI as a sample's agent, run by its command line against the
sample's own session of the gateway.

    turnstile run --agent-command 'claude -p {prompt} --allowedTools Bash' --prompts tasks.jsonl
    # under slime, in the YAML: rollout_interaction_env_path: agent_command, and agent_command: '...'

The command is split as a shell would (shlex), never run by a shell; in each word, `{prompt}` is the row's task
(its prompt as text: a string, or its last user message), `{openai_base_url}`, `{anthropic_base_url}`,
`{api_key}`, `{model}` and `{workdir}` what they say. The program also finds them in its environment:
OPENAI_BASE_URL, OPENAI_API_KEY, ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY (what the official SDKs and Claude Code
read), TURNSTILE_MODEL, TURNSTILE_PROMPT. It runs in a fresh working directory of its own (`{workdir}`, removed
afterwards) as its own process group; it and whatever it started are gone when it ends. A non-zero exit fails the
sample's trajectory (an `agent` error) with what the program said on stderr or stdout.

Its reward: with `agent_reward_command`, that command runs afterwards in the same directory (the agent's output
in the file `$TURNSTILE_AGENT_OUTPUT`), and the last line it prints is the reward (a number); without one the env
gives none, and slime's reward path (`--custom-rm-path`, `--rm-type`) scores the sample as any other.
"""

from __future__ import annotations

import os
import shlex
import shutil
import tempfile
from pathlib import Path
from typing import Any

from engine.agents.env import AgentEnv, AgentFailed, AgentRun

PLACES = ("prompt", "openai_base_url", "anthropic_base_url", "api_key", "model", "workdir")


class CommandAgent(AgentEnv):
    """One sample's agent: `command` (a command line with `{prompt}` and the like, the module's docstring)."""

    def __init__(self, command: str, prompt: Any, *, reward_command: str | None = None, timeout_s: float = 1800.0):
        self.command, self.reward_command = split(command, "agent_command"), reward_command
        if reward_command is not None:
            split(reward_command, "agent_reward_command")
        self.prompt, self.timeout_s = prompt_text(prompt), timeout_s

    async def run(self, agent: AgentRun) -> dict[str, Any]:
        workdir = Path(tempfile.mkdtemp(prefix="turnstile-agent-"))
        try:
            places = {
                "prompt": self.prompt, "openai_base_url": agent.base_url, "api_key": agent.api_key,
                "anthropic_base_url": agent.anthropic_base_url, "model": agent.model, "workdir": str(workdir),
            }  # fmt: skip
            env = {**os.environ, "TURNSTILE_PROMPT": self.prompt}
            result = await agent.run_process(fill(self.command, places), env=env, cwd=str(workdir))
            info: dict[str, Any] = {"exit_code": result.returncode}
            if self.reward_command is None:
                return info
            output = workdir / ".turnstile-agent-output"
            output.write_text(result.stdout)
            env["TURNSTILE_AGENT_OUTPUT"] = str(output)
            judge = fill(split(self.reward_command, "agent_reward_command"), places)
            judged = await agent.run_process(judge, env=env, cwd=str(workdir))
            return info | {"reward": reward_of(judged.stdout)}
        finally:
            shutil.rmtree(workdir, ignore_errors=True)


def split(command: str, name: str) -> list[str]:
    """The command's words, as a shell would split them; ValueError naming `name` when there are none."""
    try:
        words = shlex.split(command)
    except ValueError as exc:
        raise ValueError(f"{name}: {command!r} does not split into words: {exc}") from None
    if not words:
        raise ValueError(f"{name}: an empty command")
    return words


def fill(words: list[str], places: dict[str, str]) -> list[str]:
    """Each `{name}` of PLACES in each word replaced by its value (other braces, TOML's say, left as they are)."""
    out = []
    for word in words:
        for name in PLACES:
            word = word.replace("{" + name + "}", places[name])
        out.append(word)
    return out


def prompt_text(prompt: Any) -> str:
    """A row's prompt as the text an agent CLI takes: the string, or the last user message's text."""
    if isinstance(prompt, str):
        return prompt
    for message in reversed(prompt or []):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            return "".join(p.get("text", "") for p in content or [] if isinstance(p, dict))
    raise ValueError(f"the row's prompt has no user message to give the agent: {str(prompt)[:200]!r}")


def reward_of(printed: str) -> float:
    """The reward a reward command printed: its last line, a number."""
    lines = printed.strip().splitlines()
    try:
        return float(lines[-1])
    except (IndexError, ValueError):
        raise AgentFailed(f"the reward command printed no number on its last line: {printed[-500:]!r}") from None


def setting(args: Any, name: str) -> Any:
    """A setting of this env from `args`: `turnstile run`'s settings, or slime's args (a top-level key of the
    custom config, or one in its `turnstile:` section)."""
    value = getattr(args, name, None)
    if value is None:
        section = getattr(args, "turnstile", None)
        value = section.get(name) if isinstance(section, dict) else None
    return value


def build_env(sample: Any = None, args: Any = None, **kw: Any) -> CommandAgent:
    """The sample's agent, its command from `agent_command=` or the settings (`agent_command`)."""
    command = kw.get("agent_command") or setting(args, "agent_command")
    if not command:
        raise ValueError("the agent_command env needs a command: --agent-command '...' (agent_command in YAML)")
    return CommandAgent(
        command,
        getattr(sample, "prompt", None),
        reward_command=kw.get("agent_reward_command") or setting(args, "agent_reward_command"),
        timeout_s=float(kw.get("timeout_s") or setting(args, "agent_timeout_s") or 1800.0),
    )


def make_prompts(n: int, seed: int = 0, vision: bool = False) -> list[dict[str, Any]]:
    """Small shell tasks an agent CLI can do in its working directory, for `turnstile run` without --prompts."""
    tasks = [
        "Create a file named hello.txt that holds the line: hello",
        "Print the sum of the numbers from 1 to 100 with a shell command, then tell me what it was.",
        "List the files in the working directory, then create notes.md with a one-line summary of them.",
        "Write a Python script fib.py that prints the first ten Fibonacci numbers, and run it.",
    ]
    return [{"prompt": tasks[(seed + i) % len(tasks)], "metadata": {"task": i}} for i in range(n)]
