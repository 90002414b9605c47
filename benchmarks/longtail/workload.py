"""The long-tail workload: prompt rows and a blocking env with heavy-tailed latency and failures.

Every policy faces the same work. The simulated server gives the n samples of a prompt the model
variants 0..n-1 (benchmarks/longtail/model.py), and the env keys everything about a trajectory (its
number of turns, each step's latency and failure, its observations, its reward) on the prompt and the
model's first response, that is on the variant; so trajectory k of prompt p is the same trajectory
under every policy, whichever sample slot runs it.

`step` is a plain synchronous function that blocks (`time.sleep`), as user envs do (a subprocess, a
sandbox call). With probability `failure_rate` an attempt raises: `EnvRetryableError` for a
`retryable_share` of them (a retry of the same step may succeed), RuntimeError for the rest.

Where the reward comes from (`reward_source`): "rm" (the default), as in most slime runs, where slime's
reward path scores each finished sample (`--rm-type`, a remote reward model behind `--rm-url`): the
env's last step reports no reward, and `Workload.reward` gives the value the env would have given,
to a reward function that waits `reward_latency_s` first (0: a synchronous rule); "env": the env's
last step reports it in `info["reward"]`, as slime's multi-turn examples do.

    workload = Workload("env_30ms", env_median_s=0.03)
    rows = workload.rows(64)                                 # {"prompt": [...], "label": None, "metadata": {...}}
    env = workload.build_env(rows[0])                        # a LongTailEnv
    workload.reward(rows[0]["metadata"], first_response)     # 0.0 or 1.0, what the env would have said
"""

from __future__ import annotations

import hashlib
import math
import random
import statistics
import struct
import time
from dataclasses import dataclass
from typing import Any

from engine.envs.base import BaseInteractionEnv
from engine.errors import EnvRetryableError

_NORMAL = statistics.NormalDist()
WORDS = (
    "result", "value", "file", "line", "test", "passed", "failed", "error", "output", "check", "step", "the", "a",
    "of", "in", "to", "and", "is", "was", "with", "for", "on", "this", "that", "function", "returned", "expected",
    "found", "missing", "index", "list", "count", "total", "answer", "tool", "call", "query", "page", "search",
    "match", "row", "column", "table", "key", "number", "string", "empty", "true", "false", "none", "status", "code",
)  # fmt: skip
TOPICS = ("a sorting bug", "a flaky test", "a missing import", "an off-by-one loop", "a slow query", "a config typo")


def uniform(*parts: Any) -> float:
    """A deterministic draw in [0, 1) from any printable parts."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return (struct.unpack("<Q", digest)[0] >> 11) / float(1 << 53)


def lognormal(u: float, median: float, sigma: float, cap_factor: float) -> float:
    """The u-quantile of a lognormal with this median and sigma, at most `cap_factor` x the median."""
    u = min(max(u, 1e-12), 1 - 1e-12)
    return min(median * math.exp(sigma * _NORMAL.inv_cdf(u)), median * cap_factor)


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    env_median_s: float
    seed: int = 0
    env_sigma: float = 0.99  # p99/p50 = exp(2.326 * sigma) ~ 10
    env_cap_factor: float = 30.0
    failure_rate: float = 0.02  # per step attempt
    retryable_share: float = 0.75
    turn_weights: tuple[float, ...] = (0.25, 0.2, 0.15, 0.12, 0.1, 0.08, 0.06, 0.04)  # P(1 turn), P(2 turns), ...
    observation_words: tuple[int, int] = (15, 60)  # about 20-80 tokens
    reward_source: str = "rm"  # "rm": a reward function scores each ended trajectory; "env": info["reward"]
    reward_latency_s: float = 0.02  # of one reward call with "rm" (a remote reward model); 0: a sync rule

    def __post_init__(self) -> None:
        if self.reward_source not in ("rm", "env"):
            raise ValueError(f"reward_source is 'rm' or 'env', not {self.reward_source!r}")

    @property
    def max_turns(self) -> int:
        return len(self.turn_weights)

    def rows(self, n: int, start: int = 0) -> list[dict[str, Any]]:
        """Prompt rows `start .. start + n - 1`; the same for the same seed."""
        rows = []
        for i in range(start, start + n):
            rng = random.Random(f"{self.seed}/prompt/{i}")
            question = (
                f"Task {i}: find and fix {rng.choice(TOPICS)} in module m{rng.randrange(1000)}.py. "
                "Use the tools, one call per turn, and say DONE when the tests pass."
            )
            rows.append(
                {
                    "prompt": [
                        {"role": "system", "content": "You are a coding agent with a shell tool."},
                        {"role": "user", "content": question},
                    ],
                    "label": None,
                    "metadata": {"prompt_id": i, "solve_rate": 0.15 + 0.7 * rng.random()},
                }
            )
        return rows

    def reward(self, metadata: dict[str, Any], first_response: str) -> float:
        """The trajectory's reward, keyed like everything else on its prompt and the model's first
        response: 1.0 with probability `solve_rate` (the env's value when it reports one)."""
        prompt_id, solve_rate = int(metadata["prompt_id"]), float(metadata["solve_rate"])
        key = uniform(self.seed, prompt_id, first_response)
        return float(uniform(self.seed, prompt_id, key, "reward") < solve_rate)

    def build_env(self, row_or_sample: Any) -> LongTailEnv:
        metadata = row_or_sample.get("metadata") if isinstance(row_or_sample, dict) else row_or_sample.metadata
        return LongTailEnv(self, int(metadata["prompt_id"]), float(metadata["solve_rate"]))


class LongTailEnv(BaseInteractionEnv):
    """A tool env whose steps block for a heavy-tailed time and sometimes fail; see the module docstring."""

    replay_safe = False

    def __init__(self, workload: Workload, prompt_id: int, solve_rate: float):
        self.workload = workload
        self.prompt_id = prompt_id
        self.solve_rate = solve_rate
        self.reset()

    def reset(self) -> tuple[dict[str, Any], dict[str, Any]]:
        self.key: float | None = None  # set by the first step, from the model's first response
        self.num_turns = 0
        self.turn = 0
        self.attempt = 0
        return {}, {}

    def _draw(self, *what: Any) -> float:
        return uniform(self.workload.seed, self.prompt_id, self.key, *what)

    def step(self, response_text: str) -> tuple[dict[str, Any], bool, dict[str, Any]]:
        w = self.workload
        if self.key is None:
            self.key = uniform(w.seed, self.prompt_id, response_text)
            u, total = self._draw("turns"), 0.0
            self.num_turns = next(
                (k + 1 for k, p in enumerate(w.turn_weights) if (total := total + p) >= u * sum(w.turn_weights)),
                w.max_turns,
            )
        attempt, self.attempt = self.attempt, self.attempt + 1
        time.sleep(lognormal(self._draw("latency", self.turn, attempt), w.env_median_s, w.env_sigma, w.env_cap_factor))
        if self._draw("fails", self.turn, attempt) < w.failure_rate:
            if self._draw("kind", self.turn, attempt) < w.retryable_share:
                raise EnvRetryableError(f"sandbox busy (prompt {self.prompt_id}, turn {self.turn})")
            raise RuntimeError(f"sandbox crashed (prompt {self.prompt_id}, turn {self.turn})")
        self.turn, self.attempt = self.turn + 1, 0
        if self.turn >= self.num_turns:
            reward = float(self._draw("reward") < self.solve_rate)  # = Workload.reward
            return {}, True, {"reward": reward} if w.reward_source == "env" else {}
        rng = random.Random(self._draw("observation", self.turn))
        words = rng.randint(*w.observation_words)
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        return {"obs_str": f"$ run_tool --step {self.turn}\n{text}"}, False, {}
