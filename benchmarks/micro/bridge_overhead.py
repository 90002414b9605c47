"""Bridge overhead per step: turning finished trajectories into slime Samples and handing them over,
against the wall time of the step that produced them.

    python -m benchmarks.micro bridge_overhead --out FILE [--groups 32] [--samples-per-prompt 8] [--turns 8]
                                         [--tokens-per-turn 1000]

The step is one `RolloutService.rollout` (the path `generate_rollout` takes) of 32 groups x 8 samples
against the simulated SGLang server of the long-tail benchmark (benchmarks/longtail/simserver.py: continuous
batching of all 256 requests, a decode step costing 3 ms + 0.04 ms per running request, so about
19k tokens/s at that batch, an H100-class rate for a 7B model). Each trajectory runs 8 turns of
1,000 generated tokens with an env that answers at once with a short observation: about 8.2k
response tokens per sample, 256 samples.

Rewards come the way they do in most slime runs: the env reports none, and slime's reward path
scores each sample as its trajectory ends (`bridge.rewards.SlimeScoring`, while the others generate).
The reward function is given as slime gives one, by path: `custom_rm_path` on the args namespace the
service gets as `env_args` (here `benchmarks.micro.bridge_overhead.boxed_answer_rm`, an async
`(args, sample) -> float` doing a math rule's work: the last \\boxed{...} of the response against
the label, both normalized). The simulated model's text holds no boxed answer, so every reward is 0.0
and the rule's work is the scan of each response, about what it is when the answer is near the end.

Measured inside that step:
- conversion: every Trajectory -> Sample conversion, each counted once, in CPU seconds of the thread it
  runs in: `bridge.rewards.to_sample` (token, mask and log-prob lists, the response decoded, metadata;
  once per trajectory, on its reward call, in a worker thread), and each `bridge.rewards.settle` after
  it (the outcome and metadata brought up to date, on the reward call and again when the step hands
  the Sample over);
- reward: every call of the reward function (`reward_calls`, `reward_seconds`), conversion excluded;
- transfer: the step's samples through pickle protocol 5 and back (what Ray does to Python objects
  between the rollout service's actor and slime's rollout manager), and with Ray installed, a real
  actor -> driver `ray.get` of them.
Target: conversion + transfer under 5% of the step's wall time (`overhead_ratio`);
`overhead_ratio_with_rewards` adds the reward seconds (which overlap with generation, but run on the
rollout's event loop).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import pickle
import statistics
import time
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import bridge.rewards
from benchmarks import emit
from benchmarks.longtail.simserver import SimConfig, sim_server
from bridge.convert import Sample
from bridge.service import RolloutService
from bridge.settings import BridgeSettings
from engine.backends.sglang import SGLangBackend
from engine.envs.base import BaseInteractionEnv

TARGET_RATIO = 0.05
RM_PATH = "benchmarks.micro.bridge_overhead.boxed_answer_rm"  # as slime's --custom-rm-path names it
REWRITES = (("\\left", ""), ("\\right", ""), ("\\!", ""), ("$", ""), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"))


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
        return observation, self.turn >= self.max_turns, {}  # no reward: slime's reward path gives it


def build_env(sample: Any = None, args: Any = None, **_: Any) -> FixedTurnsEnv:
    return FixedTurnsEnv(args.max_turns)


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} in `text` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[begin:i]
            depth -= 1
    return None


def normalize_answer(answer: str) -> str:
    """The answer as a math rule compares it: no spaces, `$`, `\\left`/`\\right`, `\\!`, trailing `.`;
    `\\dfrac` and `\\tfrac` as `\\frac`; lower case; `0.50` as `0.5`."""
    text = answer.strip()
    for old, new in REWRITES:
        text = text.replace(old, new)
    text = "".join(text.split()).rstrip(".").lower()
    try:
        number = float(text.replace(",", ""))
    except ValueError:
        return text
    return f"{number:g}"


async def boxed_answer_rm(args: Any, sample: Any) -> float:
    """slime's custom reward function signature: 1.0 when the response's last boxed answer equals the
    label (both normalized), else 0.0."""
    answer = last_boxed(sample.response or "")
    if answer is None or sample.label is None:
        return 0.0
    return float(normalize_answer(answer) == normalize_answer(str(sample.label)))


class Timed:
    """Wraps a function and adds up the CPU seconds of the thread it runs in (the conversion runs in worker
    threads, several at once: their wall time would count each one's wait for the others)."""

    def __init__(self, fn):
        self.fn, self.seconds, self.calls = fn, 0.0, 0
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        started = time.thread_time()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.thread_time() - started
            self.calls += 1


class TimedAsync(Timed):
    """An async function's seconds from call to return (on the rollout's event loop)."""

    async def __call__(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return await self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - started
            self.calls += 1


@contextmanager
def patched(module: Any, name: str, wrapper: Timed):
    """`module.name` replaced by `wrapper` for the block: what the code that runs looks up at call time."""
    original = getattr(module, name)
    setattr(module, name, wrapper)
    try:
        yield wrapper
    finally:
        setattr(module, name, original)


def data_source(groups: int, n: int) -> list[list[Sample]]:
    return [
        [
            Sample(
                group_index=g,
                index=g * n + i,
                prompt=f"Task {g}: fix the failing test in module m{g}.py.",
                label=f"\\frac{{{g + 1}}}{{7}}",
            )
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
        n_samples_per_prompt=n, target_groups=groups, max_turns=turns, env_path="benchmarks.micro.bridge_overhead",
        max_tokens=turns * (tokens_per_turn + 200), max_new_tokens=tokens_per_turn, max_generating=concurrent,
        max_env_steps=concurrent, max_inflight=concurrent,
    )  # fmt: skip
    # slime's args, as the service gets them: envs read max_turns, SlimeScoring loads custom_rm_path
    env_args = SimpleNamespace(max_turns=turns, custom_rm_path=RM_PATH)
    rm_module, _, rm_name = RM_PATH.rpartition(".")
    conversion = Timed(bridge.rewards.to_sample)  # the one conversion of each trajectory (and service's, if used)
    settle = Timed(bridge.rewards.settle)  # its outcome settled on each later look (to_sample settles its own)
    reward = TimedAsync(getattr(importlib.import_module(rm_module), rm_name))
    with (
        patched(bridge.rewards, "to_sample", conversion),
        patched(bridge.rewards, "settle", settle),
        patched(importlib.import_module(rm_module), rm_name, reward),  # what load_function(RM_PATH) finds
        sim_server(server) as url,
    ):
        backend = SGLangBackend(url, timeout=3600)
        service = RolloutService(settings, env_args, backend=backend)
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
    conversion_s = conversion.seconds + settle.seconds
    overhead_s = conversion_s + transfer_s
    return {
        "samples": len(samples),
        "response_tokens_mean": statistics.fmean(lengths),
        "response_tokens_min": min(lengths),
        "total_tokens": sum(len(s.tokens) for s in samples),
        "step_seconds": step_s,
        "conversion_seconds": conversion_s,
        "conversion_calls": conversion.calls,
        "conversion_to_sample_seconds": conversion.seconds,
        "conversion_settle_seconds": settle.seconds,
        "conversion_settle_calls": settle.calls,
        "conversion_counted_once": conversion.calls == len(samples),
        "reward_path": RM_PATH,
        "reward_calls": reward.calls,
        "reward_seconds": reward.seconds,
        "rewards_nonzero": sum(bool(s.reward) for s in samples),
        "rewards_missing": sum(s.reward is None for s in samples),
        "transfer_pickle_seconds": pickle_s,
        "transfer_pickle_bytes": pickle_bytes,
        "transfer_ray_seconds": ray_s,
        "overhead_seconds": overhead_s,
        "overhead_ratio": overhead_s / step_s,
        "overhead_seconds_with_rewards": overhead_s + reward.seconds,
        "overhead_ratio_with_rewards": (overhead_s + reward.seconds) / step_s,
        "target_ratio": TARGET_RATIO,
        "met": overhead_s / step_s < TARGET_RATIO,
        "met_with_rewards": (overhead_s + reward.seconds) / step_s < TARGET_RATIO,
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
