"""Holding chosen groups mid-episode until a test lets them go, so the test knows which trajectories
are paused with a live env, and tokens of one weight version only, when a rollout step ends.

    GATE.hold(0)      # every trajectory of group 0 blocks in its env's first step ...
    ...               # ... a rollout step ends without it; the weights change
    GATE.release()    # ... it goes on, in a later step, with the same env

`GatedEnv` (this module's `build_env`): a held group's env asks for one more turn after its first
step; every other env ends after its first step. Feedback names the step number, so the tokens show
whether an env kept its state (`[step 1]`, then the end) or started over (`[step 1]` twice).
"""

from __future__ import annotations

import threading
from typing import Any

from engine.envs.base import BaseInteractionEnv


class Gate:
    WAIT_S = 120.0  # a test that never releases fails with the env's error instead of hanging

    def __init__(self) -> None:
        self.groups: set[int] = set()
        self.released = threading.Event()

    def hold(self, *groups: int) -> None:
        self.groups = set(groups)
        self.released.clear()

    def release(self) -> None:
        self.released.set()

    def holds(self, sample: Any) -> bool:
        return getattr(sample, "group_index", None) in self.groups

    def wait(self) -> None:
        """Block (an env's worker thread) until released."""
        if not self.released.wait(self.WAIT_S):
            raise TimeoutError(f"gated env: not released within {self.WAIT_S} s")


GATE = Gate()


class GatedEnv(BaseInteractionEnv):
    def __init__(self, held: bool):
        self.held = held
        self.num_steps = 0

    def reset(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return {}, {}

    def step(self, response_text: str) -> tuple[dict[str, Any], bool, dict[str, Any]]:
        self.num_steps += 1
        if self.held and self.num_steps == 1:
            GATE.wait()
            return {"obs_str": f"[step {self.num_steps}] one more"}, False, {}
        return {"obs_str": f"[step {self.num_steps}] done"}, True, {"reward": 1.0}


def build_env(sample: Any = None, args: Any = None, **kw: Any) -> GatedEnv:
    return GatedEnv(held=GATE.holds(sample))
