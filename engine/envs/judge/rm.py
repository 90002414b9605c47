"""The judge as a reward function: slime's `--custom-rm-path` entry point, and a Turnstile `reward_fn`.

slime (slime/rollout/rm_hub/__init__.py, `async_rm` and `batched_async_rm`) loads the function by path
and awaits `rm(args, sample, **kwargs)` for one Sample, or `rm(args, samples, **kwargs)` with a list
under `--group-rm`:

    --custom-rm-path engine.envs.judge.rm.judge_rm       # the judge settings: `judge:` in the
                                                         # --custom-config-path YAML, or TURNSTILE_JUDGE_*

A Turnstile engine takes `JudgeReward` as its `reward_fn` (scores each trajectory as it ends):

    engine = RolloutEngine(..., reward_fn=JudgeReward(judge, encoder))

The conversation judged is the prompt and the response (a slime Sample), or the prompt, every model turn
and every env observation (a trajectory). Without a score the reward is the settings' fallback, or the
JudgeError is raised: under Turnstile (the engine, or slime through Turnstile's bridge) that fails the
trajectory's reward alone; under slime's own rollout a raise ends the rollout step, so use
`on_error: fallback` there.
"""

from __future__ import annotations

from typing import Any

import anyio

from engine.encoding import ChatEncoder
from engine.envs.judge.client import Judge
from engine.envs.judge.settings import JudgeSettings
from engine.envs.judge.shared import shared_judge
from engine.trajectory import Trajectory


async def judge_rm(args: Any, sample: Any, **kwargs: Any) -> float | list[float]:
    """slime's custom reward function: the judge's reward for `sample`, or one per Sample of a list."""
    judge = shared_judge(JudgeSettings.from_sources(args))
    if isinstance(sample, list):
        return await score_all(judge, [conversation_of_sample(s) for s in sample])
    return await judge.score(conversation_of_sample(sample))


async def score_all(judge: Judge, conversations: list[list[dict[str, Any]]]) -> list[float]:
    """Every conversation scored at once (so they share batches), in order."""
    rewards: list[float] = [0.0] * len(conversations)

    async def one(i: int) -> None:
        rewards[i] = await judge.score(conversations[i])

    async with anyio.create_task_group() as group:
        for i in range(len(conversations)):
            group.start_soon(one, i)
    return rewards


class JudgeReward:
    """A Turnstile reward function: `await reward(trajectory)` is the judge's reward for it."""

    def __init__(self, judge: Judge, encoder: ChatEncoder):
        self.judge, self.encoder = judge, encoder

    async def __call__(self, trajectory: Trajectory) -> float:
        return await self.judge.score(conversation_of_trajectory(trajectory, self.encoder))


def conversation_of_sample(sample: Any) -> list[dict[str, Any]]:
    """A slime Sample's prompt (chat messages, or rendered text as one user message) and its response."""
    return [*prompt_messages(sample.prompt), {"role": "assistant", "content": sample.response or ""}]


def conversation_of_trajectory(trajectory: Trajectory, encoder: ChatEncoder) -> list[dict[str, Any]]:
    """The prompt, then each model turn (as the env read it) and the env's observation after it."""
    conversation = prompt_messages(trajectory.prompt)
    for turn in trajectory.turns:
        text = encoder.response_text(trajectory.generated_ids(turn).tolist())
        conversation.append({"role": "assistant", "content": text})
        conversation += turn.observation_messages
    return conversation


def prompt_messages(prompt: Any) -> list[dict[str, Any]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(message) for message in prompt]
