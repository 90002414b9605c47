"""The long-tail benchmark: its simulated SGLang server, driven by the real SGLangBackend, and a smoke run."""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import anyio
import httpx2
import pytest
from aiohttp import web

from benchmarks.longtail.model import IM_END, IM_START, turn_start
from benchmarks.longtail.run import POLICIES, run_benchmark, sized, write_outputs
from benchmarks.longtail.simserver import SimConfig, SimServer, sim_post, sim_server
from benchmarks.longtail.workload import Workload, lognormal
from engine.backends.base import SamplingParams
from engine.backends.sglang import SGLangBackend

TURN_TOKENS = 60  # sigma 0: every turn is this long
DECODE_A, DECODE_B = 0.002, 0.0005
CAP = 4
PARAMS = SamplingParams(max_new_tokens=1024, stop_token_ids=(IM_END,))
REPORT_KEYS = (
    "trained_tokens_per_s", "step_seconds_p50", "step_seconds_p99", "backend_utilization",
    "backend_busy_fraction", "mean_batch_size", "discarded_token_fraction", "stale_le1_fraction",
)  # fmt: skip
FRACTIONS = (
    "backend_utilization", "backend_busy_fraction", "discarded_token_fraction",
    "unfinished_token_fraction", "stale_le1_fraction",
)  # fmt: skip


def prompt(i: int) -> list[int]:
    """A chat-shaped prompt: <|im_start|>user ... <|im_end|>\\n<|im_start|>assistant\\n."""
    return [IM_START, 872, 198, 1000 + i, 2000 + i, 3000 + i, IM_END, 198, IM_START, 77091, 198]


@pytest.fixture(scope="module")
def server_url():
    config = SimConfig(
        max_running=CAP, decode_a=DECODE_A, decode_b=DECODE_B, prefill_s_per_token=0.0,
        median_tokens=TURN_TOKENS, sigma=0.0,
    )  # fmt: skip
    with sim_server(config) as url:
        yield url


@pytest.fixture
async def backend(server_url):
    async with SGLangBackend(server_url, timeout=30) as client:
        await client.wait_until_healthy(10, poll_interval=0.05)
        await sim_post(server_url, "/sim/reset", {"weight_version": "v0"})
        await sim_post(server_url, "/stats/reset")
        yield client


async def _stats(url: str) -> dict:
    async with httpx2.AsyncClient(base_url=url, trust_env=False) as client:
        return (await client.get("/stats")).json()


# -- the simulated model ----------------------------------------------------------------------------


def test_turn_starts_after_the_last_assistant_header():
    ids = prompt(0)
    assert turn_start(ids) == len(ids)
    assert turn_start([*ids, 5000, 5001]) == len(ids)
    assert turn_start([1, 2, 3]) == 3


@pytest.mark.anyio
async def test_same_prefix_gives_the_same_turns_after_a_reset(backend, server_url):
    first = [await backend.generate(prompt(1), PARAMS) for _ in range(2)]
    await sim_post(server_url, "/sim/reset", {"weight_version": "v0"})
    again = [await backend.generate(prompt(1), PARAMS) for _ in range(2)]

    assert [r.token_ids for r in again] == [r.token_ids for r in first]
    assert [r.logprobs for r in again] == [r.logprobs for r in first]
    assert first[0].token_ids != first[1].token_ids  # two samples of one prompt differ, as at temperature 1
    for result in first:
        assert result.finish_reason == "stop"
        assert len(result.token_ids) == TURN_TOKENS and result.token_ids[-1] == IM_END
        assert all(1000 <= t < 150000 for t in result.token_ids[:-1])
        assert all(lp < 0 for lp in result.logprobs)


@pytest.mark.anyio
async def test_an_aborted_turn_resumed_ends_as_an_uninterrupted_one(backend, server_url):
    whole = await backend.generate(prompt(2), PARAMS)
    await sim_post(server_url, "/sim/reset", {"weight_version": "v0"})

    async with anyio.create_task_group() as tg:
        results = []

        async def first_part() -> None:
            results.append(await backend.generate(prompt(2), PARAMS, rid="cut-me"))

        tg.start_soon(first_part)
        with anyio.fail_after(10):
            while (await _stats(server_url))["generated_tokens"] < 5:
                await anyio.sleep(0.01)
        await backend.abort("cut-me")
    part = results[0]
    assert part.finish_reason == "abort"
    assert 0 < len(part.token_ids) < TURN_TOKENS

    rest_params = SamplingParams(max_new_tokens=1024 - len(part.token_ids), stop_token_ids=(IM_END,))
    rest = await backend.generate(prompt(2) + part.token_ids, rest_params)
    assert rest.finish_reason == "stop"
    assert part.token_ids + rest.token_ids == whole.token_ids
    assert part.logprobs + rest.logprobs == pytest.approx(whole.logprobs)


@pytest.mark.anyio
async def test_max_new_tokens_cuts_a_turn_with_finish_length(backend):
    result = await backend.generate(prompt(3), SamplingParams(max_new_tokens=7))
    assert result.finish_reason == "length" and len(result.token_ids) == 7


# -- continuous batching and its accounting ----------------------------------------------------------


@pytest.mark.anyio
async def test_continuous_batching_caps_running_requests_and_accounts_for_them(backend, server_url):
    async with anyio.create_task_group() as tg:
        for i in range(2 * CAP):
            tg.start_soon(backend.generate, prompt(10 + i), PARAMS)
    stats = await _stats(server_url)

    assert stats["generated_tokens"] == 2 * CAP * TURN_TOKENS
    assert stats["num_requests"] == 2 * CAP
    # two waves of CAP requests, give or take steps where late arrivals had not joined yet
    assert 2 * TURN_TOKENS <= stats["num_steps"] <= 2 * TURN_TOKENS + 10
    assert stats["mean_batch_size"] <= CAP + 1e-9
    assert stats["mean_batch_size"] >= 0.9 * CAP
    assert 0 < stats["utilization"] <= 1 and 0 < stats["busy_fraction"] <= 1
    assert stats["running_seconds"] == pytest.approx(stats["mean_batch_size"] * stats["busy_seconds"])
    expected_busy = stats["num_steps"] * (DECODE_A + DECODE_B * stats["mean_batch_size"])
    assert 0.8 * expected_busy <= stats["busy_seconds"] <= 1.5 * expected_busy


@pytest.mark.anyio
async def test_a_request_extending_an_earlier_one_hits_the_prefix_cache(backend):
    first = await backend.generate(prompt(4), PARAMS)
    assert first.cached_tokens == 0
    follow_up = prompt(4) + first.token_ids + [198, IM_START, 872, 198, 42, IM_END, 198, IM_START, 77091, 198]
    second = await backend.generate(follow_up, PARAMS)
    assert second.cached_tokens == (len(prompt(4)) + TURN_TOKENS) // 16 * 16


@pytest.mark.anyio
async def test_weight_updates_pause_and_continue(backend, server_url):
    await backend.update_weights_from_disk("/sim/weights", weight_version="v7")
    assert await backend.weight_version() == "v7"
    assert (await backend.generate(prompt(5), PARAMS)).weight_version == "v7"
    await backend.update_weights_from_disk("/sim/weights")
    assert await backend.weight_version() == "v8"

    await backend.pause(mode="in_place")
    async with anyio.create_task_group() as tg:
        results = []

        async def one() -> None:
            results.append(await backend.generate(prompt(6), PARAMS))

        tg.start_soon(one)
        await anyio.sleep(0.2)
        assert not results and (await _stats(server_url))["num_waiting"] == 1
        await backend.resume()
    assert results[0].finish_reason == "stop"

    before = (await _stats(server_url))["generated_tokens"]
    async with anyio.create_task_group() as tg:
        tg.start_soon(one)
        with anyio.fail_after(10):
            while (await _stats(server_url))["generated_tokens"] < before + 3:
                await anyio.sleep(0.01)
        await backend.pause(mode="abort")
    assert results[1].finish_reason == "abort"
    await backend.resume()


# -- the workload ---------------------------------------------------------------------------------------


def test_env_latency_is_heavy_tailed():
    draws = sorted(lognormal((i + 0.5) / 10000, 0.03, 0.99, 1e9) for i in range(10000))
    p50, p99 = draws[5000], draws[9900]
    assert p50 == pytest.approx(0.03, rel=0.01)
    assert 8 < p99 / p50 < 12


def _episode(workload: Workload, row: dict, first: str) -> list:
    env, seen = workload.build_env(row), []
    env.reset()
    for turn in range(workload.max_turns):
        observation, done, info = env.step(first if turn == 0 else f"answer {turn}")
        seen.append((observation, done, info))
        if done:
            break
    return seen


def test_the_env_is_the_same_for_the_same_first_response():
    workload = Workload("t", env_median_s=0.0, failure_rate=0.0, reward_source="env")
    row = workload.rows(1, start=3)[0]
    episode = _episode(workload, row, "first answer")
    assert episode == _episode(workload, row, "first answer")
    assert episode[-1][1] and "reward" in episode[-1][2]
    assert all(obs["obs_str"] for obs, done, _ in episode if not done)
    rewards = {_episode(workload, row, f"sample {k}")[-1][2]["reward"] for k in range(40)}
    assert rewards == {0.0, 1.0}  # the samples of one prompt differ


def test_with_a_reward_function_the_env_reports_none_and_the_function_gives_the_envs_value():
    by_env = Workload("t", env_median_s=0.0, failure_rate=0.0, reward_source="env")
    by_rm = Workload("t", env_median_s=0.0, failure_rate=0.0)  # the default: a reward function
    row = by_env.rows(1, start=3)[0]
    for k in range(40):
        first = f"sample {k}"
        episode = _episode(by_rm, row, first)
        assert episode[-1][1] and "reward" not in episode[-1][2]
        assert by_rm.reward(row["metadata"], first) == _episode(by_env, row, first)[-1][2]["reward"]
    with pytest.raises(ValueError, match="reward_source"):
        Workload("t", env_median_s=0.0, reward_source="judge")


def test_env_failures_are_deterministic_and_some_are_retryable():
    workload = Workload("t", env_median_s=0.0, failure_rate=0.5)
    outcomes = []
    for _ in range(2):
        env = workload.build_env(workload.rows(1)[0])
        env.reset()
        errors = []
        for _ in range(20):
            try:
                env.step("the same answer")
            except Exception as exc:
                errors.append(type(exc).__name__)
        outcomes.append(errors)
    assert outcomes[0] == outcomes[1]
    assert {"EnvRetryableError", "RuntimeError"} <= set(outcomes[0])


# -- the benchmark, end to end ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.anyio
async def test_longtail_smoke(tmp_path):
    size = sized("small", target_groups=2, num_steps=2, server={"max_running": 8})
    report = await run_benchmark(size, log=lambda line: None)
    write_outputs(report, tmp_path)

    saved = json.loads((tmp_path / "report.json").read_text())
    assert set(saved["policies"]) == set(POLICIES)
    assert set(saved["workloads"]) == {"env_1ms", "env_30ms"}
    assert {w["reward_source"] for w in saved["workloads"].values()} == {"rm"}
    for workload in saved["workloads"].values():
        for name, metrics in workload["policies"].items():
            for key in REPORT_KEYS:
                assert isinstance(metrics[key], int | float), (name, key)
            for key in FRACTIONS:
                assert 0.0 <= metrics[key] <= 1.0, (name, key, metrics[key])
            assert metrics["trained_tokens"] > 0 and metrics["trained_tokens_per_s"] > 0
            assert metrics["generated_tokens"] >= metrics["trained_tokens"]
            assert 0 < metrics["step_seconds_p50"] <= metrics["step_seconds_p99"]
            assert 0 < metrics["mean_batch_size"] <= size.server.max_running
            assert statistics.fsum(metrics["staleness_histogram"].values()) == metrics["trained_tokens"]
            # the reward function scored every trajectory that trained (slime_style: every one not aborted)
            assert metrics["reward_calls"] >= metrics["num_trajectories"] - metrics["statuses"].get("failed", 0)
            assert metrics["reward_seconds_per_call"] >= size.reward_latency_s * 0.9, (name, metrics)
            assert 0.0 <= metrics["reward_tail_fraction"] <= 1.0, (name, metrics)
            assert 0.0 <= metrics["reward_group_wait_seconds_mean"] <= metrics["step_seconds_p99"]
    # without partial rollout a policy's work is the same whatever the env's latency
    for policy in ("slime_style", "turn"):
        trained = {w: saved["workloads"][w]["policies"][policy]["trained_tokens"] for w in saved["workloads"]}
        assert len(set(trained.values())) == 1, (policy, trained)
    for name in ("report.md", "timeline.png", "throughput.png"):
        assert (tmp_path / name).stat().st_size > 0


@pytest.mark.anyio
async def test_the_loops_own_work_between_steps_counts_as_running_time(monkeypatch):
    # Each step is DECODE_A of the model's time; the loop's work between two steps (made 1/2 of a step here) is
    # paid for by the next step's shorter sleep, so the running batch is counted through it, not only while asleep.
    sim = SimServer(SimConfig(max_running=CAP, decode_a=DECODE_A, decode_b=0.0, prefill_s_per_token=0.0,
                              median_tokens=TURN_TOKENS, sigma=0.0))  # fmt: skip
    integrate = sim._integrate

    def integrate_then_work() -> None:  # at a step's end: then the loop's own work, before the next step
        integrate()
        time.sleep(DECODE_A / 2)

    monkeypatch.setattr(sim, "_integrate", integrate_then_work)
    runner = web.AppRunner(sim.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    loop_task = asyncio.create_task(sim.batch_loop())
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        async with SGLangBackend(url, timeout=30) as backend, anyio.create_task_group() as tg:
            for i in range(CAP):
                tg.start_soon(backend.generate, prompt(50 + i), PARAMS)
    finally:
        loop_task.cancel()
        await runner.cleanup()
    stats = sim.stats.snapshot(CAP)
    assert stats["generated_tokens"] == CAP * TURN_TOKENS
    # a running request's token costs one step: DECODE_A of running time (counting only while asleep gave half)
    model_running_seconds = stats["generated_tokens"] * DECODE_A
    assert 0.9 * model_running_seconds <= stats["running_seconds"] <= 1.5 * model_running_seconds
    assert stats["busy_seconds"] >= 0.9 * stats["num_steps"] * DECODE_A
