"""Agent programs as rollouts: a session gateway serving model APIs (gateway.py, openai_chat.py) whose requests
are turns of the engine's trajectories (session.py), matched message by message (history.py)."""

from __future__ import annotations

import importlib

AGENTS_EXTRA = "pip install 'turnstile[agents]'"


def needs_agents_extra(what: str, module: str) -> None:
    """Import `module` (one of engine.agents'), or one ValueError saying that `what` needs the `agents` extra
    (starlette, uvicorn, the official SDKs, psutil), which a plain `pip install turnstile` leaves out."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] in ("engine", "bridge"):
            raise
        raise ValueError(
            f"{what} needs Turnstile's agents extra (no module named {exc.name!r}): {AGENTS_EXTRA}"
        ) from exc
