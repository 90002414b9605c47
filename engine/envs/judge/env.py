"""The judge env: open-ended questions, answered, critiqued by an LLM judge, revised, and scored by it.

Each prompt asks for a short explanation ("Explain what a hash table is in two sentences."). On the
model's first answer the judge writes a critique, given back as the next observation with a request to
revise; the revised answer (after `revisions` rounds, default 1) is scored, and the episode ends with
`info["reward"]` = the judge's score / max_score, in 0..1. With `revisions=0` the first answer is scored.

    rows = make_prompts(4, seed=0)                 # {"prompt": [...], "label": None, "metadata": {...}}
    env = build_env(EnvSample.from_row(rows[0]))   # or `turnstile run --env judge`

When the judge gives no score, the settings' error policy decides (engine/envs/judge/settings.py): the
reward is `fallback_score` with `info["judge_error"]` saying why, or the step raises the JudgeError and
the trajectory fails. A critique round needs only the judge's text: an unparseable score does not
matter there, a judge that does not answer does.
"""

from __future__ import annotations

import random
from typing import Any

from engine.envs.base import AsyncInteractionEnv
from engine.envs.judge.client import Verdict
from engine.envs.judge.errors import UNPARSEABLE
from engine.envs.judge.rm import prompt_messages
from engine.envs.judge.settings import JudgeSettings
from engine.envs.judge.shared import shared_judge

DEFAULT_REVISIONS = 1

QUESTIONS = (
    "Explain what a hash table is in two sentences.",
    "Explain why the sky is blue in two sentences.",
    "Explain the difference between a process and a thread in three sentences.",
    "Explain what DNS does when you type a web address, in two sentences.",
    "Explain what gradient descent is to a high-school student, in three sentences.",
    "Explain why ice floats on water in two sentences.",
    "Explain what a Git commit is in two sentences.",
    "Explain what inflation is and one thing that causes it, in three sentences.",
    "Explain how a vaccine trains the immune system, in three sentences.",
    "Explain what recursion is, with a one-line example, in two sentences.",
    "Explain why the Moon shows phases, in two sentences.",
    "Explain what an index in a database is for, in two sentences.",
    "Explain the difference between weather and climate in two sentences.",
    "Explain what overfitting is in machine learning, in two sentences.",
    "Explain how a bicycle stays upright while moving, in three sentences.",
    "Explain what photosynthesis produces and needs, in two sentences.",
    "Explain what TCP adds on top of IP, in two sentences.",
    "Explain why compound interest grows faster than simple interest, in two sentences.",
    "Explain what a black hole is in two sentences.",
    "Explain what a unit test is and why teams write them, in three sentences.",
)


def make_prompts(n: int, *, seed: int = 0, vision: bool = False) -> list[dict[str, Any]]:
    """`n` prompt rows, the same for the same seed; each question once before any repeats."""
    if vision:
        raise ValueError("the judge env is text only: run it without --vision")
    order = list(range(len(QUESTIONS)))
    random.Random(seed).shuffle(order)
    rows = []
    for i in range(n):
        question = QUESTIONS[order[i % len(order)]]
        rows.append(
            {"prompt": [{"role": "user", "content": question}], "label": None, "metadata": {"question": question}}
        )
    return rows


class JudgeEnv(AsyncInteractionEnv):
    replay_safe = True  # reset() and the same answers rebuild the same conversation

    def __init__(self, prompt: list[dict[str, Any]], settings: JudgeSettings, *, revisions: int = DEFAULT_REVISIONS):
        self.prompt, self.settings, self.revisions = prompt, settings, revisions
        self.conversation: list[dict[str, Any]] = list(prompt)
        self.num_answers = 0

    def reset(self) -> tuple[dict[str, Any], dict[str, Any]]:
        self.conversation, self.num_answers = list(self.prompt), 0
        return {}, {}

    async def astep(self, response_text: str) -> tuple[dict[str, Any], bool, dict[str, Any]]:
        self.num_answers += 1
        self.conversation.append({"role": "assistant", "content": response_text})
        verdict = await shared_judge(self.settings).judge(self.conversation)
        if self.num_answers <= self.revisions:
            return self._critique(verdict)
        return self._scored(verdict)

    def _critique(self, verdict: Verdict) -> tuple[dict[str, Any], bool, dict[str, Any]]:
        if verdict.error is not None and verdict.error.kind != UNPARSEABLE and self.settings.error_policy == "fail":
            raise verdict.error  # no reply at all; an unparseable one is still a critique
        critique = verdict.critique or "No critique is available."
        text = f"A reviewer's critique of your answer:\n{critique}\n\nRevise your answer."
        self.conversation.append({"role": "user", "content": text})
        return {"obs_str": text}, False, {"judge_score": verdict.score}

    def _scored(self, verdict: Verdict) -> tuple[dict[str, Any], bool, dict[str, Any]]:
        info: dict[str, Any] = {"judge_reply": verdict.reply, "judge_score": verdict.score}
        if verdict.error is None:
            return {"obs_str": "Scored."}, True, info | {"reward": verdict.score}
        if self.settings.error_policy == "fail":
            raise verdict.error
        return (
            {"obs_str": "Scored."},
            True,
            info | {"reward": self.settings.fallback_score, "judge_error": verdict.error.as_data()},
        )


def build_env(sample: Any = None, args: Any = None, **kw: Any) -> JudgeEnv:
    """A JudgeEnv for a row from `make_prompts` (or any prompt: the judge needs no label).

    Judge settings: TURNSTILE_JUDGE_* variables, then `args.judge`, then `judge=` here (a mapping). The
    revision rounds are `revisions=` here, else `metadata["revisions"]`, else DEFAULT_REVISIONS, and at
    most `args.max_turns - 1`, so the last turn is always scored."""
    if sample is None:
        sample_prompt, metadata = make_prompts(1)[0]["prompt"], {}
    else:
        sample_prompt, metadata = sample.prompt, getattr(sample, "metadata", None) or {}
    settings = JudgeSettings.from_sources(args, **(kw.get("judge") or {}))
    revisions = kw.get("revisions", metadata.get("revisions", DEFAULT_REVISIONS))
    max_turns = getattr(args, "max_turns", None)
    if max_turns is not None:
        revisions = min(int(revisions), max(int(max_turns) - 1, 0))
    return JudgeEnv(prompt_messages(sample_prompt), settings, revisions=int(revisions))
