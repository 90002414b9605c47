"""The built-in arithmetic env in vision mode (the question drawn into an image in every feedback),
failing now and then, for the end-to-end tier:

- a sample whose `index % 5 == 1` raises on its first step once (a retry then succeeds);
- a sample whose `index % 13 == 7` raises on every step (its trajectory ends FAILED).

Failures raise before the env's state changes, so a retry sees the env as it was. Every feedback
names its attempt (`[attempt 3]`), so a test can read from the tokens alone that an env kept its
state across a pause: the attempts of one trajectory count 1, 2, 3, ... with no restart.

A group held by `tests.envs.gated.GATE` blocks in its first step until the test releases it.
"""

from __future__ import annotations

from typing import Any

from engine.envs import arith
from tests.envs.gated import GATE


class FlakyVisionArith(arith.ArithEnv):
    def __init__(
        self, question: str, answer: int, *, max_attempts: int, fail_once: bool, always_fail: bool, held: bool = False
    ):
        super().__init__(question, answer, max_attempts=max_attempts, vision=True)
        self.fail_once, self.always_fail, self.held = fail_once, always_fail, held

    def step(self, response_text: str) -> tuple[dict[str, Any], bool, dict[str, Any]]:
        if self.always_fail or self.fail_once:
            self.fail_once = False
            raise RuntimeError(f"scripted env failure at attempt {self.num_attempts + 1}")
        if self.held and self.num_attempts == 0:
            GATE.wait()
        observation, done, info = super().step(response_text)
        observation["obs_str"] = f"[attempt {self.num_attempts}] {observation['obs_str']}"
        return observation, done, info


def build_env(sample: Any = None, args: Any = None, **kw: Any) -> FlakyVisionArith:
    base = arith.build_env(sample, args, vision=True)
    index = getattr(sample, "index", 0) or 0
    return FlakyVisionArith(
        base.question, base.answer, max_attempts=base.max_attempts,
        fail_once=index % 5 == 1, always_fail=index % 13 == 7, held=GATE.holds(sample),
    )  # fmt: skip
