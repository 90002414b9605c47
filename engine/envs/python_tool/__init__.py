"""Built-in env `python_tool`: math and programming tasks solved with a sandboxed Python tool.

    turnstile run --env python_tool --num-prompts 4 --max-turns 3

    rows = make_prompts(8, seed=0)                       # {"prompt": [...], "label": task id, "metadata": {...}}
    env = build_env(EnvSample.from_row(rows[0]), args)   # a PythonToolEnv; reward in info["reward"]

A row's `metadata` names a built-in task (`task_id`, see tasks.py) or brings its own checker
(`checker`: `{"kind": "number", "value": 42}` or `{"kind": "function", "name": "f", "cases": [[[1], 2]]}`),
and may set sandbox limits (`sandbox`: any field of `SandboxLimits`). The parts: env.py (the episode),
sandbox.py and child.py (the sandbox), checkers.py (judging a final answer), tasks.py (the task set).
docs/envs/python_tool.md has the whole story.
"""

from __future__ import annotations

import random
from typing import Any

from pydantic import TypeAdapter, ValidationError

from engine.envs.python_tool.checkers import Checker, FunctionTests, NumberAnswer
from engine.envs.python_tool.env import DEFAULT_MAX_TURNS, PYTHON_TOOL, SYSTEM_PROMPT, PythonToolEnv
from engine.envs.python_tool.sandbox import SandboxLimits, SandboxResult, isolation, run_python
from engine.envs.python_tool.tasks import TASKS, TASKS_BY_ID, Task

OBSERVATION_ROLES = ("user", "tool")  # a tool's output comes back as a tool message: checked against the template

__all__ = [
    "PYTHON_TOOL",
    "TASKS",
    "FunctionTests",
    "NumberAnswer",
    "PythonToolEnv",
    "SandboxLimits",
    "SandboxResult",
    "Task",
    "build_env",
    "isolation",
    "make_prompts",
    "run_python",
    "task_of",
    "task_of_sample",
]

_CHECKER = TypeAdapter(Checker)


def make_prompts(n: int, *, seed: int = 0, vision: bool = False) -> list[dict[str, Any]]:
    """`n` prompt rows over the task set, shuffled by `seed` (every task once before any repeats)."""
    if vision:
        raise ValueError("the python_tool env has no vision mode: run it without --vision")
    rng = random.Random(seed)
    order: list[Task] = []
    while len(order) < n:
        order += rng.sample(TASKS, len(TASKS))
    return [_row(task) for task in order[:n]]


def _row(task: Task) -> dict[str, Any]:
    prompt = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task.question}]
    return {"prompt": prompt, "label": task.id, "metadata": {"task_id": task.id, "tools": [PYTHON_TOOL.schema()]}}


def build_env(sample: Any = None, args: Any = None, **kw: Any) -> PythonToolEnv:
    """A PythonToolEnv for a row (its `metadata`: `task_id` or `checker`, and `sandbox`); no sample: the
    first task. The turn limit is `max_turns=` here, else `args.max_turns`, else DEFAULT_MAX_TURNS."""
    task, limits, max_turns = task_of_sample(sample, args, kw, env="python_tool")
    return PythonToolEnv(task, limits=limits, max_turns=max_turns)


def task_of_sample(sample: Any, args: Any, kw: dict[str, Any], *, env: str) -> tuple[Task, SandboxLimits, int]:
    """A sample's task and sandbox limits (no sample: the first task), and the turn limit: `max_turns=` in `kw`,
    else `args.max_turns`, else DEFAULT_MAX_TURNS. A bad `metadata.sandbox` raises naming `env`."""
    metadata = dict(getattr(sample, "metadata", None) or {}) if sample is not None else {"task_id": TASKS[0].id}
    task = task_of(metadata, getattr(sample, "label", None))
    try:
        limits = SandboxLimits.model_validate(metadata.get("sandbox") or {})
    except ValidationError as exc:
        raise ValueError(f"{env} env: metadata.sandbox: {exc}") from exc
    return task, limits, kw.get("max_turns") or getattr(args, "max_turns", None) or DEFAULT_MAX_TURNS


def task_of(metadata: dict[str, Any], label: Any) -> Task:
    """The row's task: a built-in one by id (`metadata["task_id"]`, else the label), or its own checker."""
    task_id = metadata.get("task_id", label)
    if "checker" in metadata:
        try:
            checker = _CHECKER.validate_python(metadata["checker"])
        except ValidationError as exc:
            raise ValueError(f"python_tool env: metadata.checker: {exc}") from exc
        return Task(str(task_id or "custom"), "", checker, reference="")
    if task_id in TASKS_BY_ID:
        return TASKS_BY_ID[task_id]
    raise ValueError(
        f"python_tool env: the row names no task (task_id {task_id!r}): give metadata.task_id, one of "
        f"{', '.join(TASKS_BY_ID)}, or metadata.checker"
    )
