"""The rollout service in shards (bridge/shards.py): one place decides where groups go and when a step ends, the
shards run them; each step returns exactly the groups slime asked for, whole, and no prompt is lost, a shard
killed mid-step included."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bridge.service import RolloutService
from bridge.settings import BridgeSettings
from bridge.shards import ShardedService, place, shares, spread
from bridge.slime import SERVICE_ATTRIBUTE, generate_rollout
from tests.test_bridge import DataSource


@given(st.integers(0, 40), st.lists(st.integers(0, 20), min_size=1, max_size=8))
def test_spread_takes_the_target_or_all_there_is_and_never_more_than_a_shard_has(target, done):
    takes = spread(target, done)
    assert sum(takes) == min(target, sum(done))
    assert all(0 <= t <= d for t, d in zip(takes, done, strict=True))


@given(st.integers(0, 40), st.lists(st.integers(0, 20), min_size=1, max_size=8))
def test_new_groups_go_to_the_shards_holding_fewest(num_groups, held):
    placed = place(num_groups, held)
    assert sorted(j for indices in placed for j in indices) == list(range(num_groups))
    after = [h + len(p) for h, p in zip(held, placed, strict=True)]
    receivers = [a for a, p in zip(after, placed, strict=True) if p]
    assert not receivers or max(receivers) <= min(after) + 1  # none was given one while another held two fewer


@given(st.integers(1, 40), st.lists(st.integers(0, 20), min_size=1, max_size=8))
def test_every_shard_holding_a_group_has_a_share_and_the_shares_cover_the_target(target, held):
    each = shares(target, held)
    assert sum(each) >= target
    assert all(s >= 1 for s, h in zip(each, held, strict=True) if h)


def sharded_settings(**update) -> BridgeSettings:
    return BridgeSettings.embedded(2).model_copy(
        update={"partial_rollout": True, "over_sampling": 2.0, "target_groups": 3, **update}
    )


@pytest.mark.slow
def test_two_shards_return_exactly_the_target_whole_and_lose_no_prompt():
    settings = sharded_settings()
    shards = [RolloutService(settings.for_shard(i)) for i in range(2)]
    service = ShardedService(shards, settings)
    try:
        args = SimpleNamespace(**{SERVICE_ATTRIBUTE: service})
        source = DataSource(n_samples=2)
        returned = []
        for step in range(3):
            out = generate_rollout(args, step, source)
            assert len(out.samples) == 3 and all(len(group) == 2 for group in out.samples)
            assert out.metrics["perf/rollout_time"] > 0 and "multi_turn/turns/mean" in out.metrics
            for group in out.samples:  # whole groups: both members of one prompt
                assert len({sample.group_index for sample in group}) == 1
            returned += [group[0].group_index for group in out.samples]
        held = service.held_prompts()
        assert len(set(returned)) == len(returned)  # none returned twice
        assert sorted(returned + held) == source.handed_out  # every prompt taken: returned once, or held
        each = service.status()["shards"]
        assert all(status["groups_returned"] > 0 for status in each)  # both shards did the work
        assert sum(status["groups_returned"] for status in each) == 9
    finally:
        service.shutdown()


@pytest.mark.slow
def test_a_step_ends_when_the_shards_have_the_target_between_them():
    """One shard holds all the groups (the other none): the step still ends with the target, from that one."""
    settings = sharded_settings(target_groups=2)
    shards = [RolloutService(settings.for_shard(i)) for i in range(2)]
    service = ShardedService(shards, settings)
    try:
        source = DataSource(n_samples=2)
        shards[0].queue([(0, group) for group in source.get_samples(4)])
        out = service.rollout(0, 2, [])
        assert len(out.samples) == 2
        assert shards[0].status()["groups_returned"] == 2 and shards[1].status()["groups_returned"] == 0
        assert out.num_held == 2
    finally:
        service.shutdown()


def test_each_shard_has_its_own_ports_and_a_shard_label():
    settings = sharded_settings(metrics_port=9400, agent_port=0)
    first, second = settings.for_shard(0), settings.for_shard(1)
    assert (first.metrics_port, second.metrics_port) == (9400, 9401)
    assert (first.agent_port, second.agent_port) == (0, 0)  # any free port, on each
    assert second.metrics_labels == {"shard": "1"}
    with pytest.raises(ValueError, match="metrics_labels"):
        BridgeSettings(metrics_labels={"not a label": "x"})


def test_turnstile_serve_refuses_a_shard_count_under_one_before_starting_anything(capsys):
    from engine.cli import main

    assert main(["serve", "--shards", "0"]) == 2
    assert "shards: Input should be greater than 0 (given 0)" in capsys.readouterr().err


@pytest.mark.slow
def test_the_shard_benchmark_runs_each_count_on_processes_of_its_own(tmp_path):
    pytest.importorskip("ray", reason="Ray is part of the dev extra; install it with `pip install -e .[dev]`")
    from benchmarks.scale.shards import main

    report = main(["--shards", "1", "2", "--steps", "1", "--target-groups", "4", "--servers", "2", "--out",
                   str(tmp_path / "shards.json")])  # fmt: skip
    one, two = report["runs"]
    assert (one["shards"], len(one["pids"]), two["shards"], len(two["pids"])) == (1, 1, 2, 2)
    for run in report["runs"]:
        assert run["turns"] > 0 and run["shard_cpu_ms_per_turn"] > 0 and run["coordinator_cpu_ms_per_turn"] > 0
    assert set(report["projection"]["turns_per_s"]) == {"1", "2", "4", "8", "16"}
    assert (tmp_path / "shards.json").exists()


@pytest.mark.slow
def test_the_scale_workload_runs_through_shards_over_the_simulated_fleet():
    pytest.importorskip("ray", reason="Ray is part of the dev extra; install it with `pip install -e .[dev]`")
    from dataclasses import replace

    from benchmarks.longtail.simserver import sim_server
    from benchmarks.scale.sharded import run_sharded
    from benchmarks.scale.workload import SIZES

    size = replace(SIZES["smoke"], duration_s=4.0)
    with sim_server(replace(size.server, servers=size.servers)) as url:
        result = run_sharded(size, url, 2)
    samples = result["steps"] * size.target_groups * size.n_samples  # every step its target, whole
    assert result["steps"] > 0 and sum(result["statuses"].values()) == samples
    assert result["statuses"].get("failed", 0) == 0 and result["utilization"] > 0
    assert result["coordinator_cpu_ms_per_turn"] > 0 and result["shard_cpu_ms_per_turn"] > 0
