"""Scheduler overhead: turns per second with a backend and an env that answer instantly, in process.

    python -m benchmarks.overhead --out DIR [--trajectories 5000] [--inflight 1000] [--turns 10]

Everything but the scheduler is made free: the backend returns four tokens at once, the env
is a coroutine that answers at once, and the encoder hands out fixed token ids (observation
encoding with a real tokenizer is measured by `benchmarks.encoding_speed`). What remains is the
engine's own work per turn: slots, priorities, retries bookkeeping, trajectory appends, groups.
The event loop runs on one thread. Memory per in-flight trajectory is measured with tracemalloc
over 1,000 trajectories held paused mid-run. Target: 10,000 turns per second with 1,000 in flight.
"""

from __future__ import annotations

import argparse
import time
import tracemalloc
from pathlib import Path

import anyio

from benchmarks import emit
from engine.backends.base import GenerateResult, SamplingParams
from engine.encoding import Encoded
from engine.engine import EngineConfig, RolloutEngine
from engine.envs.base import AsyncInteractionEnv, EnvRunner
from engine.turn import TurnLimits

STOP = 2
PROMPT_IDS = list(range(100, 140))
OBSERVATION_IDS = list(range(200, 220))


class InstantBackend:
    """Answers at once, after one trip through the event loop (as any real reply would take), so the
    trajectories in flight interleave turn by turn."""

    async def generate(self, input_ids, sampling_params, image_data=None, *, rid=None) -> GenerateResult:
        await anyio.lowlevel.checkpoint()
        return GenerateResult([11, 12, 13, STOP], [-0.5] * 4, "", "stop", "v0", prompt_tokens=len(input_ids))

    async def abort(self, rid=None) -> None: ...
    async def pause(self) -> None: ...
    async def resume(self) -> None: ...
    async def weight_version(self) -> str | None:
        return "v0"

    async def health(self) -> bool:
        return True

    async def aclose(self) -> None: ...


class FixedEncoder:
    """The parts of ChatEncoder the scheduler uses, with fixed token ids."""

    stop_token_ids = (STOP,)

    def encode_prompt(self, messages) -> Encoded:
        return Encoded(PROMPT_IDS)

    def encode_observation(self, message) -> Encoded:
        return Encoded(OBSERVATION_IDS)

    def closing_ids(self, generated) -> list[int]:
        return []

    def response_text(self, generated) -> str:
        return "answer"


class InstantEnv(AsyncInteractionEnv):
    def __init__(self, num_turns: int):
        self.num_turns, self.steps = num_turns, 0

    async def astep(self, response_text):
        self.steps += 1
        return {"obs_str": "next"}, self.steps >= self.num_turns, {"reward": 1.0}

    def format_observation(self, observation):
        return {"role": "user", "content": observation["obs_str"]}


def make_engine(num_prompts: int, inflight: int, turns: int, **config) -> RolloutEngine:
    rows = ({"prompt": [{"role": "user", "content": "q"}]} for _ in range(num_prompts))
    return RolloutEngine(
        backend=InstantBackend(),
        encoder=FixedEncoder(),
        env_factory=lambda sample: EnvRunner(InstantEnv(1 if sample.group_index == 0 else turns)),
        source=rows,
        config=EngineConfig(
            max_inflight=inflight, max_generating=inflight, max_env_steps=inflight,
            limits=TurnLimits(max_turns=turns, max_tokens=100_000), sampling=SamplingParams(max_new_tokens=16),
            **config,
        ),
    )  # fmt: skip


async def turns_per_second(num_prompts: int, inflight: int, turns: int) -> dict:
    engine = make_engine(num_prompts, inflight, turns)
    started = time.perf_counter()
    async with engine:
        num_turns = 0
        async for group in engine.stream():
            num_turns += sum(len(t.turns) for t in group.trajectories)
    seconds = time.perf_counter() - started
    return {
        "trajectories": num_prompts,
        "turns": num_turns,
        "seconds": round(seconds, 3),
        "turns_per_s": round(num_turns / seconds),
    }


async def bytes_per_inflight(inflight: int, turns: int) -> dict:
    """Admit `inflight` + 1 trajectories, let the first (a one-turn one) finish, hold the rest paused
    mid-run, and count what they hold."""
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    engine = make_engine(inflight + 1, inflight + 1, turns, partial_rollout=True, over_sampling=float(inflight + 1))
    async with engine:
        await engine.rollout(1)
        await engine.wait_until_parked()
        held = engine.statistics().num_trajectories_inflight
        used = tracemalloc.get_traced_memory()[0] - before
        sample = next(t for g in engine.open_groups for t in g.trajectories)
    tracemalloc.stop()
    return {
        "held_trajectories": held,
        "bytes_per_inflight_trajectory": round(used / held),
        "turns_each_when_held": len(sample.turns),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for report.json")
    parser.add_argument("--trajectories", type=int, default=5000)
    parser.add_argument("--inflight", type=int, default=1000)
    parser.add_argument("--turns", type=int, default=10)
    args = parser.parse_args()
    speed = anyio.run(turns_per_second, args.trajectories, args.inflight, args.turns)
    memory = anyio.run(bytes_per_inflight, args.inflight, args.turns)
    report = {
        "benchmark": "overhead",
        "inflight": args.inflight,
        "turns_per_trajectory": args.turns,
        **speed,
        **memory,
        "target_turns_per_s": 10_000,
        "meets_target": speed["turns_per_s"] >= 10_000,
    }
    emit(report, Path(args.out) / "report.json")


if __name__ == "__main__":
    main()
