"""The scale benchmark's workload: its sizes (a fleet, trajectories in flight, a step's target) and its env, which
the in-process run (run.py) and the run through rollout shards (sharded.py) share."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import anyio

from benchmarks.longtail.simserver import SimConfig
from benchmarks.longtail.workload import WORDS, lognormal, uniform
from engine.envs.base import AsyncInteractionEnv


@dataclass(frozen=True)
class Size:
    """A configuration. Each policy runs for `duration_s`, asking for `target_groups` groups at a time, with a
    weight update (pause, update every server, resume) every `update_every_s`. Simulated times are those of a
    fleet several times slower than real servers and tools, so that the turn rate the trajectories in flight
    need stays within what the engine process gets on a small shared machine; what decides placement (prefill
    against decode, tool time against generation, KV capacity against the sessions a server holds) is kept."""

    servers: int
    in_flight: int  # trajectories
    target_groups: int  # groups each rollout call returns
    duration_s: float
    update_every_s: float
    n_samples: int = 4
    env_median_s: float = 6.0
    env_sigma: float = 1.0  # p99/p50 ~ 10
    turns_median: float = 4.0  # turns per trajectory: lognormal, heavy-tailed
    turns_sigma: float = 0.8
    max_turns: int = 32
    obs_median_words: float = 60.0  # words per observation (about 1.3 tokens each): lognormal
    obs_sigma: float = 1.0
    max_tokens: int = 32_768
    max_new_tokens: int = 1024
    server: SimConfig = SimConfig(
        max_running=8, kv_tokens=24_000, decode_a=0.03, decode_b=0.002, prefill_s_per_token=0.0002,
        median_tokens=80.0, sigma=0.99, max_turn_tokens=1000,
    )  # fmt: skip

    @property
    def over_sampling(self) -> float:
        return self.in_flight / (self.target_groups * self.n_samples)


SIZES = {
    # 64 servers, 512 trajectories in flight: the policy comparison the share of a core this process gets sustains
    "shared": Size(
        servers=64, in_flight=512, target_groups=8, duration_s=240, update_every_s=120, n_samples=2,
        env_median_s=8.0, turns_median=2.5, turns_sigma=0.7, max_turns=16,
        server=SimConfig(max_running=5, kv_tokens=12_000, decode_a=0.16, decode_b=0.008,
                         prefill_s_per_token=0.0006, median_tokens=80.0, sigma=0.99, max_turn_tokens=1000),
    ),
    # 64 servers, 4,096 in flight, each server holding 4x as many sessions in 4x the KV
    "full": Size(
        servers=64, in_flight=4096, target_groups=64, duration_s=240, update_every_s=120, env_median_s=24.0,
        server=SimConfig(max_running=32, kv_tokens=96_000, decode_a=0.03, decode_b=0.002,
                         prefill_s_per_token=0.0002, median_tokens=80.0, sigma=0.99, max_turn_tokens=1000),
    ),
    "smoke": Size(
        servers=4, in_flight=64, target_groups=4, duration_s=6, update_every_s=3, env_median_s=0.02,
        turns_median=3.0, max_turns=8, obs_median_words=20.0,
        server=SimConfig(max_running=8, kv_tokens=20_000, decode_a=0.001, decode_b=0.0001,
                         prefill_s_per_token=0.00001, median_tokens=20.0, max_turn_tokens=100),
    ),
}  # fmt: skip


class ScaleEnv(AsyncInteractionEnv):
    """A tool env that waits on I/O: each step a heavy-tailed time, then an observation of heavy-tailed length.
    Like benchmarks/longtail/workload.py's env, everything is keyed on the prompt and the model's first response, so a
    trajectory is the same under every policy."""

    def __init__(self, size: Size, prompt_id: int):
        self.size, self.prompt_id = size, prompt_id
        self.key: float | None = None
        self.turn = 0
        self.num_turns = 1

    def _draw(self, *what: Any) -> float:
        return uniform(self.prompt_id, self.key, *what)

    async def astep(self, response_text: str) -> tuple[dict[str, Any], bool, dict[str, Any]]:
        s = self.size
        if self.key is None:
            self.key = uniform(self.prompt_id, response_text)
            turns = lognormal(self._draw("turns"), s.turns_median, s.turns_sigma, s.max_turns / s.turns_median)
            self.num_turns = max(1, min(s.max_turns, round(turns)))
        await anyio.sleep(lognormal(self._draw("latency", self.turn), s.env_median_s, s.env_sigma, 30.0))
        self.turn += 1
        if self.turn >= self.num_turns:
            return {}, True, {"reward": float(self._draw("reward") < 0.5)}
        words = max(1, round(lognormal(self._draw("words", self.turn), s.obs_median_words, s.obs_sigma, 25.0)))
        rng = random.Random(self._draw("observation", self.turn))
        return {"obs_str": f"$ tool --step {self.turn}\n" + " ".join(rng.choices(WORDS, k=words))}, False, {}


def fleet_ceiling(size: Size) -> float:
    """Generated tokens per second with every slot of every server running and nothing to prefill: the most any
    policy can get from the fleet."""
    server = size.server
    return size.servers * server.max_running / (server.decode_a + server.decode_b * server.max_running)
