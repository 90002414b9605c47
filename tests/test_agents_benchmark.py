"""The agent benchmark's smoke run: both policies drive real agents (the `openai` SDK) through the gateway on
the simulated SGLang server, and the report holds what the targets are judged on."""

from __future__ import annotations

import pytest

from benchmarks.agents.run import POLICIES, SIZES, run_benchmark


@pytest.mark.anyio
async def test_the_small_agent_benchmark_runs_both_policies_and_reports_the_targets():
    config = SIZES["small"]
    report = await run_benchmark(config, log=lambda line: None)
    per_step = config.target_groups * config.n_samples
    for policy in POLICIES:
        result = report["policies"][policy]
        assert result["samples_returned"] == per_step * config.num_steps  # whole groups, every step
        assert result["trained_tokens"] > 0 and 0.0 < result["backend_utilization"] <= 1.0
        assert result["agent_requests"] >= result["samples_returned"]  # an agent asks at least once
        assert set(result["agent_exits"]) <= {"finished", "stopped"} and result["agent_exits"]["finished"] > 0
        assert sum(result["staleness_histogram"].values()) == result["trained_tokens"]
    slime, turn = report["policies"]["slime_style"], report["policies"]["turn_partial"]
    assert report["speedup"] == pytest.approx(turn["trained_tokens_per_s"] / slime["trained_tokens_per_s"])
    assert set(report["targets"]) == {"speedup_at_least_3", "utilization_at_least_0.85", "stale_share_at_most_0.1"}
    # Turnstile's groups in flight were sized by the server's load, each step within its target and ceiling
    goals = turn["in_flight_groups_by_step"]
    assert len(goals) == config.num_steps and all(
        config.target_groups <= goal <= config.target_groups * config.over_sampling for goal in goals
    )
    stale = sum(n for key, n in turn["statuses"].items() if key.endswith("/stale"))
    assert turn["stale_share"] == stale / turn["samples_returned"]
