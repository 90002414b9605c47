"""An env written the way slime's multi-turn examples write one: a plain class that subclasses
nothing, a module-level `format_observation`, and `build_env` reading `args.max_turns` and `sample.label`."""

from typing import Any


class GuessEnv:
    def __init__(self, *, answer: str, max_turns: int):
        self.answer = answer
        self.max_turns = max_turns
        self.turn = 0

    def reset(self):
        self.turn = 0
        return {}, {"answer_available": True}

    def step(self, response_text: str):
        self.turn += 1
        correct = response_text.strip() == self.answer
        observation = {"obs_str": f"turn {self.turn}: {'correct' if correct else 'wrong'}", "role": "tool"}
        return observation, correct or self.turn >= self.max_turns, {"score": float(correct)}

    def close(self):
        return


def build_env(sample: Any = None, args: Any = None, **_: Any) -> GuessEnv:
    if args.max_turns is None:
        raise ValueError("max_turns must be set via --custom-config-path")
    return GuessEnv(answer=str(sample.label), max_turns=args.max_turns)


def format_observation(observation: dict) -> dict:
    return {"role": observation.get("role", "tool"), "content": observation.get("obs_str", "")}
