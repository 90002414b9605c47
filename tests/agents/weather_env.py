"""An agent env module, loaded by path as slime loads `rollout_interaction_env_path`: each sample runs
tests/agents/program.py (the official `openai` SDK) against its session, ending as `how` says."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from engine.agents.env import AgentEnv, AgentRun

ROOT = Path(__file__).resolve().parents[2]


class ProgramAgent(AgentEnv):
    """The program, ending as `how` says; each run's pids in a file under `folder` (`pids()` reads them all)."""

    def __init__(self, how: str = "finish", folder: Path | None = None, timeout_s: float = 120.0):
        self.how, self.folder, self.timeout_s = how, folder, timeout_s
        self.pid_files: list[Path] = []

    async def run(self, agent: AgentRun) -> dict[str, Any]:
        folder = self.folder or Path(agent.sample.metadata.get("pid_folder", "/tmp"))  # type: ignore[union-attr]
        self.pid_files.append(folder / f"pids-{agent.session_id}")
        program = [sys.executable, "-m", "tests.agents.program", self.how, str(self.pid_files[-1])]
        result = await agent.run_process(program, cwd=str(ROOT))
        final = json.loads(result.stdout)["final"] if result.stdout else None
        return {"reward": 1.0 if final and "sunny" in final.lower() else 0.0, "final": final}

    def pids(self) -> list[int]:
        return [pid for path in self.pid_files for pid in json.loads(path.read_text())]


def build_env(sample: Any = None, args: Any = None, **kw: Any) -> ProgramAgent:
    return ProgramAgent()
