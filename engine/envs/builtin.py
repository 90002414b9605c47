"""The built-in envs by short name, so `turnstile run --env python_tool` (or `env_path: judge` in YAML)
needs no module path.

    resolve_env_path("python_tool")      # "engine.envs.python_tool"
    resolve_env_path("my_pkg.my_env")    # "my_pkg.my_env": anything else is a module path or a .py file

Each built-in env module exposes `build_env(sample, args)` and `make_prompts(n, seed=, vision=)`, the
rows `turnstile run` uses when no `--prompts` file is given.
"""

from __future__ import annotations

BUILTIN_ENVS: dict[str, str] = {
    "arith": "engine.envs.arith",
    "python_tool": "engine.envs.python_tool",
    "judge": "engine.envs.judge",
    "geometry": "engine.envs.geometry",
    "python_agent": "engine.envs.python_agent",  # an agent program (the OpenAI Agents SDK) on python_tool's tasks
    "agent_command": "engine.envs.agent_command",  # any agent CLI by its command line (turnstile run --agent-command)
}
# the built-in envs whose modules need an extra's packages (pyproject.toml), by module path
EXTRAS: dict[str, str] = {"engine.envs.python_agent": "agents", "engine.envs.agent_command": "agents"}


def resolve_env_path(name_or_path: str) -> str:
    """The module path for a built-in env's short name; any other value unchanged."""
    return BUILTIN_ENVS.get(name_or_path, name_or_path)
