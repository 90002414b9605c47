"""Built-in env: arithmetic with retries, many turns even for a random-weight model.

The prompt asks "What is 37 + 58? Answer with a number."; each step reads the last integer of the
response. A correct answer ends the episode with `info["reward"] = 1.0`; a wrong one gets
"... is not right, try again" and another turn, until `max_attempts` answers (then reward 0.0).
In vision mode the question is also drawn into a small image, in the prompt and in every feedback
observation (`observation["multi_modal_data"]["image"]`).

    rows = make_prompts(8, seed=0, vision=True)      # {"prompt": [...], "label": "95", "metadata": {...}}
    env = build_env(EnvSample.from_row(rows[0]))     # or load "engine.envs.arith" with EnvFactory
"""

from __future__ import annotations

import random
import re
import zlib
from typing import Any

from PIL import Image, ImageDraw

from engine.envs.base import BaseInteractionEnv

DEFAULT_MAX_ATTEMPTS = 4
IMAGE_SIZE = (112, 56)
_INTEGER = re.compile(r"-?\d+")


def make_prompts(n: int, *, seed: int = 0, vision: bool = False) -> list[dict[str, Any]]:
    """`n` prompt rows, the same for the same seed."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b, op = rng.randint(10, 99), rng.randint(10, 99), rng.choice("+-")
        question = f"{a} {op} {b}"
        text = f"What is {question}? Answer with a number."
        content: Any = [{"type": "image", "image": draw_question(question)}, {"type": "text", "text": text}]
        rows.append(
            {
                "prompt": [{"role": "user", "content": content if vision else text}],
                "label": str(a + b if op == "+" else a - b),
                "metadata": {"question": question, "vision": vision},
            }
        )
    return rows


def draw_question(question: str) -> Image.Image:
    """The question as a small black-on-white image (PIL's default font)."""
    image = Image.new("RGB", IMAGE_SIZE, "white")
    ImageDraw.Draw(image).text((6, 20), f"{question} = ?", fill="black")
    return image


class ArithEnv(BaseInteractionEnv):
    replay_safe = True  # deterministic: reset() and the same responses rebuild the same state

    def __init__(self, question: str, answer: int, *, max_attempts: int = DEFAULT_MAX_ATTEMPTS, vision: bool = False):
        self.question = question
        self.answer = answer
        self.max_attempts = max_attempts
        self.vision = vision
        self.num_attempts = 0

    def reset(self) -> tuple[dict[str, Any], dict[str, Any]]:
        self.num_attempts = 0
        return {}, {}

    def step(self, response_text: str) -> tuple[dict[str, Any], bool, dict[str, Any]]:
        self.num_attempts += 1
        numbers = _INTEGER.findall(response_text)
        guess = int(numbers[-1]) if numbers else None
        info: dict[str, Any] = {"attempts": self.num_attempts, "guess": guess}
        if guess == self.answer:
            return {"obs_str": "Correct."}, True, info | {"reward": 1.0}
        if self.num_attempts >= self.max_attempts:
            return {"obs_str": f"Out of attempts; it was {self.answer}."}, True, info | {"reward": 0.0}
        feedback = "No number found, try again." if guess is None else f"{guess} is not right, try again."
        observation: dict[str, Any] = {"obs_str": f"{feedback} What is {self.question}?"}
        if self.vision:
            observation["multi_modal_data"] = {"image": [draw_question(self.question)]}
        return observation, False, info


def build_env(sample: Any = None, args: Any = None, **kw: Any) -> ArithEnv:
    """An ArithEnv for a row from `make_prompts` (its label and metadata); no sample: the first seed-0 row.
    For any other prompt (no `metadata["question"]`), a question derived from the prompt's text, asked
    in the env's feedback, so the embedded default runs multi-turn on whatever prompts it is given.

    The attempt limit is `max_attempts=` here, else `metadata["max_attempts"]`, else `args.max_turns`,
    else DEFAULT_MAX_ATTEMPTS; vision mode is `vision=` here, else `metadata["vision"]`.
    """
    if sample is None:
        row = make_prompts(1)[0]
        label, metadata = row["label"], row["metadata"]
    else:
        label, metadata = sample.label, sample.metadata or {}
    if "question" not in metadata:  # any other prompt: the env asks a question of its own in its feedback
        row = make_prompts(1, seed=zlib.crc32(str(getattr(sample, "prompt", "")).encode()))[0]
        label, metadata = row["label"], {**metadata, "question": row["metadata"]["question"]}
    if not isinstance(label, int) and not str(label).lstrip("-").isdigit():
        question = metadata["question"]
        raise ValueError(f"arith env needs an integer sample.label for question {question!r}, got {label!r}")
    max_attempts = kw.get("max_attempts") or metadata.get("max_attempts") or getattr(args, "max_turns", None)
    return ArithEnv(
        metadata["question"],
        int(label),
        max_attempts=max_attempts or DEFAULT_MAX_ATTEMPTS,
        vision=bool(kw.get("vision", metadata.get("vision", False))),
    )
