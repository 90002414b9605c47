"""The geometry env: a drawn problem, answers graded by a math-answer rule, hints as new images.

The prompt shows the figure (vision) or describes it (text) and asks for one value. Each step reads the
response's final answer (`\\boxed{...}`, else `Answer: ...`) and grades it (grader.py). A right answer ends
the episode; a wrong one gets a tool message saying so, with the problem's hint and, in vision mode, a
new image: after the first wrong answer the figure with the unknown in red and the hint written under
it, after later ones a zoom on the unknown. After `max_attempts` answers the episode ends with reward 0.

Reward: `retry_discount ** (attempt - 1)` for a right answer (1.0 at the first attempt; 0.5, 0.25, ...
after hints, by default), 0.0 when none was right. `retry_discount=1.0` makes it plain 1/0.
"""

from __future__ import annotations

from typing import Any

from PIL import Image

from engine.envs.base import BaseInteractionEnv, default_format_observation
from engine.envs.geometry.drawing import DEFAULT_SIZE, render
from engine.envs.geometry.grader import DEFAULT_REL_TOL, Rule, Verdict, grade
from engine.envs.geometry.problems import KINDS, Problem, generate

DEFAULT_MAX_ATTEMPTS = 3
DEFAULT_RETRY_DISCOUNT = 0.5
INSTRUCTIONS = (
    "Give the final answer as \\boxed{...} (or on a last line 'Answer: ...'), exact like 5\\sqrt{2} or 25\\pi, "
    "or as a decimal to two places."
)


def make_prompts(n: int, *, seed: int = 0, vision: bool = False) -> list[dict[str, Any]]:
    """`n` prompt rows, the same for the same seed; the kinds of problem take turns."""
    return [prompt_row(seed * 1_000_003 + i, KINDS[i % len(KINDS)], vision=vision) for i in range(n)]


def prompt_row(problem_seed: int, kind: str | None = None, *, vision: bool = False) -> dict[str, Any]:
    """The row for one problem: the image and the question (vision), or the figure in words and the question."""
    problem = generate(problem_seed, kind)
    if vision:
        content: Any = [{"type": "image", "image": render(problem.figure)}, {"type": "text", "text": ask(problem)}]
    else:
        content = f"{problem.description} {ask(problem)}"
    metadata = {"problem_seed": problem_seed, "kind": problem.kind, "answers": problem.answers, "vision": vision}
    return {"prompt": [{"role": "user", "content": content}], "label": problem.answer, "metadata": metadata}


def ask(problem: Problem) -> str:
    return f"{problem.question} {INSTRUCTIONS}"


class GeometryEnv(BaseInteractionEnv):
    replay_safe = True  # deterministic: reset() and the same responses rebuild the same state

    def __init__(
        self,
        truths: list[str],
        *,
        problem: Problem | None = None,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        vision: bool = False,
        retry_discount: float = DEFAULT_RETRY_DISCOUNT,
        rule: Rule = "auto",
        rel_tol: float = DEFAULT_REL_TOL,
        image_size: tuple[int, int] = DEFAULT_SIZE,
    ):
        if not truths:
            raise ValueError("geometry env needs at least one ground-truth answer")
        if max_attempts < 1:
            raise ValueError(f"geometry env: max_attempts must be at least 1, got {max_attempts}")
        if not 0.0 <= retry_discount <= 1.0:
            raise ValueError(f"geometry env: retry_discount must be in [0, 1], got {retry_discount}")
        self.truths, self.problem, self.max_attempts, self.vision = truths, problem, max_attempts, vision
        self.retry_discount, self.rule, self.rel_tol, self.image_size = retry_discount, rule, rel_tol, image_size
        self.num_attempts = 0

    def reset(self) -> tuple[dict[str, Any], dict[str, Any]]:
        self.num_attempts = 0
        return {}, {}

    def step(self, response_text: str) -> tuple[dict[str, Any], bool, dict[str, Any]]:
        self.num_attempts += 1
        verdict = grade(response_text, self.truths, rule=self.rule, rel_tol=self.rel_tol)
        info: dict[str, Any] = {
            "attempts": self.num_attempts, "answer": verdict.answer, "correct": verdict.is_correct,
            "grader": verdict.rule,
        }  # fmt: skip
        if verdict.is_correct:
            reward = self.retry_discount ** (self.num_attempts - 1)
            return {"obs_str": "Correct.", "role": "tool"}, True, info | {"reward": reward}
        if self.num_attempts >= self.max_attempts:
            said = f"Out of attempts; the answer was {self.truths[0]}."
            return {"obs_str": said, "role": "tool"}, True, info | {"reward": 0.0}
        return self.feedback(verdict), False, info

    def feedback(self, verdict: Verdict) -> dict[str, Any]:
        """The tool message after a wrong answer: what was wrong, the hint, and in vision mode a new image."""
        missing = "No final answer found: end with \\boxed{...}."
        parts = [missing if verdict.answer is None else f"{verdict.answer} is not right."]
        if self.problem is not None:
            parts.append(f"Hint: {self.problem.hint}")
        has_image = self.vision and self.problem is not None
        if has_image:
            parts.append("The new image " + ("marks x in red." if self.num_attempts == 1 else "zooms in on x."))
        left = self.max_attempts - self.num_attempts
        parts.append(f"Try again ({left} attempt{'s' if left != 1 else ''} left).")
        observation: dict[str, Any] = {"obs_str": " ".join(parts), "role": "tool"}
        if has_image:
            observation["multi_modal_data"] = {"image": [self.hint_image()]}
        return observation

    def hint_image(self) -> Image.Image:
        """After the first wrong answer: the unknown in red and the hint under the figure; after later ones: a zoom."""
        assert self.problem is not None
        figure = self.problem.figure
        if self.num_attempts <= 1:
            return render(figure, self.image_size, highlight=True, hint=self.problem.hint)
        return render(figure, self.image_size, highlight=True, zoom=True)

    def format_observation(self, observation: dict[str, Any]) -> dict[str, Any]:
        """A tool message (as slime's geo3k env sends): its images, then its text."""
        return {**default_format_observation(observation), "role": observation.get("role", "tool")}


def build_env(sample: Any = None, args: Any = None, **kw: Any) -> GeometryEnv:
    """A GeometryEnv for a row from `make_prompts` (its `metadata["problem_seed"]` and kind rebuild the figure),
    or, for any other row with a `label`, a grader of that label with text feedback only (a dataset of its own,
    such as geo3k's). No sample: the first seed-0 row.

    Settings, each from `kw`, else `metadata`, else the default: `max_attempts` (else `args.max_turns`, else 3),
    `vision`, `retry_discount` (0.5), `grader` ("auto": slime's rule where it imports; "own"; "slime"), `rel_tol`.
    """
    if sample is None:
        row = make_prompts(1)[0]
        label, metadata = row["label"], row["metadata"]
    else:
        label, metadata = sample.label, dict(sample.metadata or {})
    problem, truths = _problem_and_truths(label, metadata)

    def setting(name: str, default: Any) -> Any:
        value = kw.get(name, metadata.get(name))
        return default if value is None else value

    max_attempts = setting("max_attempts", getattr(args, "max_turns", None) or DEFAULT_MAX_ATTEMPTS)
    return GeometryEnv(
        truths,
        problem=problem,
        max_attempts=int(max_attempts),
        vision=bool(setting("vision", False)),
        retry_discount=float(setting("retry_discount", DEFAULT_RETRY_DISCOUNT)),
        rule=setting("grader", "auto"),
        rel_tol=float(setting("rel_tol", DEFAULT_REL_TOL)),
    )


def _problem_and_truths(label: Any, metadata: dict[str, Any]) -> tuple[Problem | None, list[str]]:
    if "problem_seed" not in metadata:
        if label is None or str(label).strip() == "":
            raise ValueError(
                "geometry env needs metadata['problem_seed'] (a row from make_prompts) or a sample.label to grade"
            )
        return None, [str(label)]
    problem = generate(int(metadata["problem_seed"]), metadata.get("kind"))
    if label is not None and str(label) != problem.answer:
        raise ValueError(
            f"geometry env: problem_seed {metadata['problem_seed']} ({problem.kind}) has answer {problem.answer!r}, "
            f"but the sample's label is {label!r}"
        )
    return problem, list(metadata.get("answers") or problem.answers)
