"""Scheduler overhead: turns per second with a backend and an env that answer instantly, in process.

    python -m benchmarks.micro overhead --out DIR [--trajectories 5000] [--inflight 1000] [--turns 10] [--repeats 3]

Everything but the scheduler is made free: the backend returns four tokens at once, the env
is a coroutine that answers at once, and the encoder hands out fixed token ids (observation
encoding with a real tokenizer is measured by `benchmarks.micro.encoding_speed`). What remains is the
engine's own work per turn: slots, priorities, retries bookkeeping, trajectory appends, groups.
The event loop runs on one thread. Memory per in-flight trajectory is measured with tracemalloc
over 1,000 trajectories held paused mid-run. Target: 10,000 turns per second with 1,000 in flight,
the env reporting each trajectory's reward in its info (`turns_per_s`, as it always was measured).
The same run is repeated with rewards from a reward function instead (`turns_per_s_rewards`): the
env reports none and a cheap synchronous rule, as slime's rule-based `--rm-type` rewards are, scores
each ended trajectory through the engine's `reward_fn` (the scheduler's scoring path: reward timeout,
retry budget, one call per trajectory; target: 10,000 turns per second too); with the metrics
recorder on (target: within 10% of `turns_per_s`), and with it plus JSON turn logs at info level
written to /dev/null (target: within 25%); each mode runs `--repeats` times, interleaved, and the
median counts. Last, /metrics is scraped 20 times with 1,000 trajectories in flight (target: under
50 ms). A small run: `--trajectories 500 --inflight 100 --turns 5 --repeats 1`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import tracemalloc
from functools import partial
from pathlib import Path

import anyio
import httpx2

from benchmarks import emit
from engine.backends.base import GenerateResult, SamplingParams
from engine.encoding import Encoded
from engine.engine import EngineConfig, RolloutEngine
from engine.envs.base import AsyncInteractionEnv, EnvRunner
from engine.metrics.logging import TurnLogger
from engine.metrics.recorder import MetricsRecorder
from engine.parsers.probed import NoCallsParser
from engine.turn import TurnLimits

STOP = 2
PROMPT_IDS = list(range(100, 140))
OBSERVATION_IDS = list(range(200, 220))


class InstantBackend:
    """Answers at once, after one trip through the event loop (as any real reply would take), so the
    trajectories in flight interleave turn by turn."""

    async def generate(
        self, input_ids, sampling_params, image_data=None, *, rid=None, session_id=None
    ) -> GenerateResult:
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
    vision_token_ids: frozenset[int] = frozenset()  # no VLM processor
    family = parser = None  # no model family, no parser of calls
    reader = NoCallsParser("a stand-in encoder with no chat template")  # its turns are content, no reasoning
    opens_reasoning = False

    def encode_prompt(self, prompt, images=None) -> Encoded:
        return Encoded(PROMPT_IDS)

    def encode_observation(self, message) -> Encoded:
        return Encoded(OBSERVATION_IDS)

    async def aencode_prompt(self, prompt, images=None) -> Encoded:
        return self.encode_prompt(prompt, images)

    async def aencode_observation(self, message) -> Encoded:
        return self.encode_observation(message)

    def naming_the_calls(self, message, generated, calls_before=0):
        return message

    def closing_ids(self, generated, message=None) -> list[int]:
        return []

    def response_text(self, generated, *, skip_special_tokens: bool = True) -> str:
        return "answer"

    def for_tools(self, tools) -> FixedEncoder:
        return self


class InstantEnv(AsyncInteractionEnv):
    """Done after `num_turns` steps; its last step reports the reward when `gives_reward`."""

    def __init__(self, num_turns: int, *, gives_reward: bool = True):
        self.num_turns, self.steps, self.gives_reward = num_turns, 0, gives_reward

    async def astep(self, response_text):
        self.steps += 1
        done = self.steps >= self.num_turns
        return {"obs_str": "next"}, done, {"reward": 1.0} if done and self.gives_reward else {}

    def format_observation(self, observation):
        return {"role": "user", "content": observation["obs_str"]}


class RuleReward:
    """A rule-based reward (as slime's `--rm-type math` is): the last turn's answer, as the env read it,
    against the expected one; synchronous, so the engine's scoring path costs what it costs."""

    def __init__(self, encoder: FixedEncoder, expected: str = "answer"):
        self.encoder, self.expected, self.calls = encoder, expected, 0

    def __call__(self, trajectory) -> float:
        self.calls += 1
        last = trajectory.generated_ids(trajectory.turns[-1]).tolist() if trajectory.turns else []
        return float(self.encoder.response_text(last).strip().lower() == self.expected)


def make_engine(
    num_prompts: int, inflight: int, turns: int, observers=(), *, reward_fn=None, **config
) -> RolloutEngine:
    """With `reward_fn` the env reports no reward and `reward_fn` scores every trajectory."""
    rows = ({"prompt": [{"role": "user", "content": "q"}]} for _ in range(num_prompts))
    gives_reward = reward_fn is None
    return RolloutEngine(
        backend=InstantBackend(),
        encoder=FixedEncoder(),
        env_factory=lambda sample: EnvRunner(
            InstantEnv(1 if sample.group_index == 0 else turns, gives_reward=gives_reward)
        ),
        source=rows,
        observers=observers,
        reward_fn=reward_fn,
        config=EngineConfig(
            max_inflight=inflight, max_generating=inflight, max_env_steps=inflight,
            limits=TurnLimits(max_turns=turns, max_tokens=100_000), sampling=SamplingParams(max_new_tokens=16),
            **config,
        ),
    )  # fmt: skip


async def turns_per_second(num_prompts: int, inflight: int, turns: int, observers=(), *, rewards: bool = False) -> dict:
    """Turns per second over `num_prompts` trajectories; with `rewards`, scored by a `RuleReward`."""
    reward = RuleReward(FixedEncoder()) if rewards else None
    engine = make_engine(num_prompts, inflight, turns, observers, reward_fn=reward)
    started = time.perf_counter()
    async with engine:
        num_turns = num_rewarded = 0
        async for group in engine.stream():
            num_turns += sum(len(t.turns) for t in group.trajectories)
            num_rewarded += sum(t.reward is not None for t in group.trajectories)
    seconds = time.perf_counter() - started
    return {
        "trajectories": num_prompts,
        "turns": num_turns,
        "seconds": round(seconds, 3),
        "turns_per_s": round(num_turns / seconds),
        "rewarded": num_rewarded,
        "reward_calls": reward.calls if reward is not None else 0,
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


async def scrape_seconds(inflight: int, turns: int, scrapes: int = 20) -> dict:
    """Hold `inflight` trajectories paused mid-run and time scrapes of the engine's /metrics."""
    engine = make_engine(
        inflight + 1, inflight + 1, turns, partial_rollout=True, over_sampling=float(inflight + 1), metrics_port=0
    )
    async with engine:
        await engine.rollout(1)
        await engine.wait_until_parked()
        held = engine.statistics().num_trajectories_inflight

        def scrape() -> list[float]:
            times = []
            with httpx2.Client() as client:
                for _ in range(scrapes):
                    started = time.perf_counter()
                    client.get(engine.exporter.url).raise_for_status()
                    times.append(time.perf_counter() - started)
            return times

        times = sorted(await anyio.to_thread.run_sync(scrape))
    return {
        "scrape_inflight_trajectories": held,
        "scrape_ms_p50": round(1e3 * statistics.median(times), 2),
        "scrape_ms_max": round(1e3 * times[-1], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for report.json")
    parser.add_argument("--trajectories", type=int, default=5000)
    parser.add_argument("--inflight", type=int, default=1000)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each mode (the median is reported)")
    args = parser.parse_args()
    with open(os.devnull, "w") as sink:  # JSON turn logs at info level, every event rendered and written
        modes = {  # name: (observers, rewards from a reward function)
            "off": (lambda: (), False),
            "rewards": (lambda: (), True),
            "metrics": (lambda: (MetricsRecorder(),), False),
            "metrics_and_json_logs": (
                lambda: (MetricsRecorder(), TurnLogger(level="info", json=True, stream=sink)),
                False,
            ),
        }
        runs: dict[str, list[dict]] = {name: [] for name in modes}
        for _ in range(args.repeats):  # interleaved, so drifts of a shared machine hit every mode alike
            for name, (observers, rewards) in modes.items():
                run = partial(turns_per_second, rewards=rewards)
                runs[name].append(anyio.run(run, args.trajectories, args.inflight, args.turns, observers()))
    speed = {name: statistics.median(r["turns_per_s"] for r in results) for name, results in runs.items()}
    memory = anyio.run(bytes_per_inflight, args.inflight, args.turns)
    scrape = anyio.run(scrape_seconds, args.inflight, args.turns)
    report = {
        "benchmark": "overhead",
        "inflight": args.inflight,
        "turns_per_trajectory": args.turns,
        "trajectories": args.trajectories,
        "repeats": args.repeats,
        "turns_per_s": speed["off"],
        **memory,
        "target_turns_per_s": 10_000,
        "meets_target": speed["off"] >= 10_000,
        "turns_per_s_rewards": speed["rewards"],
        "slowdown_rewards": round(1 - speed["rewards"] / speed["off"], 3),
        "meets_target_rewards": speed["rewards"] >= 10_000,
        "reward_calls_per_run": runs["rewards"][0]["reward_calls"],
        "rewarded_per_run": runs["rewards"][0]["rewarded"],
        "turns_per_s_metrics": speed["metrics"],
        "slowdown_metrics": round(1 - speed["metrics"] / speed["off"], 3),
        "turns_per_s_metrics_and_json_logs": speed["metrics_and_json_logs"],
        "slowdown_metrics_and_json_logs": round(1 - speed["metrics_and_json_logs"] / speed["off"], 3),
        "runs": {name: [r["turns_per_s"] for r in results] for name, results in runs.items()},
        **scrape,
        "target_scrape_ms": 50,
    }
    emit(report, Path(args.out) / "report.json")


if __name__ == "__main__":
    main()
