"""Bridge overhead per step: turning finished trajectories into slime Samples and handing them over,
against the wall time of the step that produced them.

    python -m benchmarks.bridge_overhead --out FILE [--groups 32] [--samples-per-prompt 8] [--turns 8]
                                         [--tokens-per-turn 1000]

The step is one `RolloutService.rollout` (the path `generate_rollout` takes) of 32 groups x 8 samples
against the simulated SGLang server of the long-tail benchmark (benchmarks/simserver.py: continuous
batching of all 256 requests, a decode step costing 3 ms + 0.04 ms per running request, so about
19k tokens/s at that batch, an H100-class rate for a 7B model). Each trajectory runs 8 turns of
1,000 generated tokens with an env that answers at once with a short observation: about 8.2k
response tokens per sample, 256 samples.

Measured inside that step:
- conversion: every `to_sample` call (Trajectory -> Sample: token, mask and log-prob lists, metadata);
- transfer: the step's samples through pickle protocol 5 and back (what Ray does to Python objects
  between the rollout service's actor and slime's rollout manager), and with Ray installed, a real
  actor -> driver `ray.get` of them.
Target: conversion + transfer under 5% of the step's wall time.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time
from types import SimpleNamespace
from typing import Any

import bridge.service
from benchmarks import emit
from benchmarks.longtail import sim_server
from benchmarks.simserver import SimConfig
from bridge.convert import Sample
from bridge.service import RolloutService
from bridge.settings import BridgeSettings, TurnstileSection
from engine.backends.base import SamplingParams
from engine.backends.sglang import SGLangBackend
from engine.envs.base import BaseInteractionEnv

TARGET_RATIO = 0.05


class FixedTurnsEnv(BaseInteractionEnv):
    """Answers at once; done after `args.max_turns` steps."""

    def __init__(self, max_turns: int):
        self.max_turns, self.turn = max_turns, 0

    def reset(self):
        self.turn = 0
        return {}, {}

    def step(self, response_text: str):
        self.turn += 1
        observation = {"obs_str": f"Tool output for call {self.turn}: 3 tests passed, 1 failed in test_parse."}
        return observation, self.turn >= self.max_turns, {"reward": 0.0}


def build_env(sample: Any = None, args: Any = None, **_: Any) -> FixedTurnsEnv:
    return FixedTurnsEnv(args.max_turns)


class Timed:
    """Wraps a function and adds up the seconds spent in it."""

    def __init__(self, fn):
        self.fn, self.seconds, self.calls = fn, 0.0, 0

    def __call__(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - started
            self.calls += 1


def data_source(groups: int, n: int) -> list[list[Sample]]:
    return [
        [
            Sample(group_index=g, index=g * n + i, prompt=f"Task {g}: fix the failing test in module m{g}.py.")
            for i in range(n)
        ]
        for g in range(groups)
    ]


def pickle_round_trip(samples: list[list[Sample]]) -> tuple[float, int]:
    started = time.perf_counter()
    blob = pickle.dumps(samples, protocol=5)
    pickle.loads(blob)
    return time.perf_counter() - started, len(blob)


def ray_transfer(samples: list[list[Sample]]) -> float | None:
    """Seconds for the driver to `ray.get` the samples from an actor that holds them (the service's
    actor returning a step); None without Ray."""
    try:
        import ray
    except ImportError:
        return None
    ray.init(num_cpus=1, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    try:

        @ray.remote
        class Holder:
            def __init__(self, blob: bytes):
                self.samples = pickle.loads(blob)

            def step(self):
                return self.samples

        holder = Holder.remote(pickle.dumps(samples, protocol=5))
        ray.get(holder.__ray_ready__.remote())
        started = time.perf_counter()
        ray.get(holder.step.remote())
        return time.perf_counter() - started
    finally:
        ray.shutdown()


def run(groups: int, n: int, turns: int, tokens_per_turn: int) -> dict[str, Any]:
    concurrent = groups * n
    server = SimConfig(
        max_running=concurrent, max_prefill_tokens=65536, median_tokens=float(tokens_per_turn), sigma=0.0,
        max_turn_tokens=tokens_per_turn, cache_tokens=concurrent * (turns + 1) * (tokens_per_turn + 200),
    )  # fmt: skip
    settings = BridgeSettings(
        n_samples_per_prompt=n, target_groups=groups, max_turns=turns, env_path="benchmarks.bridge_overhead",
        max_tokens=turns * (tokens_per_turn + 200), sampling=SamplingParams(max_new_tokens=tokens_per_turn),
        turnstile=TurnstileSection(max_generating=concurrent, max_env_steps=concurrent),
    )  # fmt: skip
    timed = Timed(bridge.service.to_sample)
    bridge.service.to_sample = timed
    with sim_server(server) as url:
        backend = SGLangBackend(url, timeout=3600)
        service = RolloutService(settings, SimpleNamespace(max_turns=turns), backend=backend)
        try:
            started = time.perf_counter()
            out = service.rollout(0, groups, data_source(groups, n))
            step_s = time.perf_counter() - started
        finally:
            service.shutdown()
    samples = [s for g in out.samples for s in g]
    lengths = [s.response_length for s in samples]
    pickle_s, pickle_bytes = pickle_round_trip(out.samples)
    ray_s = ray_transfer(out.samples)
    transfer_s = max(pickle_s, ray_s or 0.0)
    overhead_s = timed.seconds + transfer_s
    return {
        "samples": len(samples),
        "response_tokens_mean": statistics.fmean(lengths),
        "response_tokens_min": min(lengths),
        "total_tokens": sum(len(s.tokens) for s in samples),
        "step_seconds": step_s,
        "conversion_seconds": timed.seconds,
        "conversion_calls": timed.calls,
        "transfer_pickle_seconds": pickle_s,
        "transfer_pickle_bytes": pickle_bytes,
        "transfer_ray_seconds": ray_s,
        "overhead_seconds": overhead_s,
        "overhead_ratio": overhead_s / step_s,
        "target_ratio": TARGET_RATIO,
        "met": overhead_s / step_s < TARGET_RATIO,
        "server": {"max_running": server.max_running, "decode_a": server.decode_a, "decode_b": server.decode_b},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--samples-per-prompt", type=int, default=8)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--tokens-per-turn", type=int, default=1000)
    options = parser.parse_args(argv)
    emit(run(options.groups, options.samples_per_prompt, options.turns, options.tokens_per_turn), options.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
