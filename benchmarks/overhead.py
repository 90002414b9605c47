"""Scheduler overhead: turns per second with a backend and an env that answer instantly, in process.

    python -m benchmarks.overhead --out DIR [--trajectories 5000] [--inflight 1000] [--turns 10]

Everything but the scheduler is made free: the backend returns four tokens at once, the env
is a coroutine that answers at once, and the encoder hands out fixed token ids (observation
encoding with a real tokenizer is measured by `benchmarks.encoding_speed`). What remains is the
engine's own work per turn: slots, priorities, retries bookkeeping, trajectory appends, groups.
The event loop runs on one thread. Memory per in-flight trajectory is measured with tracemalloc
over 1,000 trajectories held paused mid-run. Target: 10,000 turns per second with 1,000 in flight.
The same run is repeated with the metrics recorder on (target: within 10%), and with it plus JSON
turn logs at info level written to /dev/null (target: within 25%); each mode runs `--repeats` times,
interleaved, and the median counts. Last, /metrics is scraped 20 times with 1,000 trajectories in
flight (target: under 50 ms).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import tracemalloc
from pathlib import Path

import anyio
import httpx

from benchmarks import emit
from engine.backends.base import GenerateResult, SamplingParams
from engine.encoding import Encoded
from engine.engine import EngineConfig, RolloutEngine
from engine.envs.base import AsyncInteractionEnv, EnvRunner
from engine.metrics.logging import TurnLogger
from engine.metrics.recorder import MetricsRecorder
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

    def encode_prompt(self, prompt, images=None) -> Encoded:
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


def make_engine(num_prompts: int, inflight: int, turns: int, observers=(), **config) -> RolloutEngine:
    rows = ({"prompt": [{"role": "user", "content": "q"}]} for _ in range(num_prompts))
    return RolloutEngine(
        backend=InstantBackend(),
        encoder=FixedEncoder(),
        env_factory=lambda sample: EnvRunner(InstantEnv(1 if sample.group_index == 0 else turns)),
        source=rows,
        observers=observers,
        config=EngineConfig(
            max_inflight=inflight, max_generating=inflight, max_env_steps=inflight,
            limits=TurnLimits(max_turns=turns, max_tokens=100_000), sampling=SamplingParams(max_new_tokens=16),
            **config,
        ),
    )  # fmt: skip


async def turns_per_second(num_prompts: int, inflight: int, turns: int, observers=()) -> dict:
    engine = make_engine(num_prompts, inflight, turns, observers)
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
            with httpx.Client() as client:
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
        modes = {
            "off": lambda: (),
            "metrics": lambda: (MetricsRecorder(),),
            "metrics_and_json_logs": lambda: (MetricsRecorder(), TurnLogger(level="info", json=True, stream=sink)),
        }
        runs: dict[str, list[dict]] = {name: [] for name in modes}
        for _ in range(args.repeats):  # interleaved, so drifts of a shared machine hit every mode alike
            for name, observers in modes.items():
                runs[name].append(
                    anyio.run(turns_per_second, args.trajectories, args.inflight, args.turns, observers())
                )
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
