"""A small run of benchmarks.scale: the fleet simulator in its own process, three placement policies, the report."""

from __future__ import annotations

import json

import pytest

from benchmarks.scale.run import main
from benchmarks.scale.workload import SIZES

KEYS = (
    "trained_tokens_per_s", "utilization", "cached_share_after_turn1", "cached_share_after_turn1_steady",
    "cached_share_of_reusable", "cpu_ms_per_turn", "rss_kib_per_trajectory", "loop_lag_ms_p50", "loop_lag_ms_p99",
    "share_of_ceiling", "busy_fraction", "mean_batch_size", "kv_blocked_share", "mean_waiting_requests",
    "live_trajectories_mean", "share_of_busy_ceiling", "prefill_stall_share",
)  # fmt: skip


def test_the_scale_benchmark_compares_the_policies_and_writes_its_report(tmp_path):
    assert main(["--size", "smoke", "--out", str(tmp_path), "--no-saturation"]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    size = SIZES["smoke"]
    policies = report["policies"]
    assert set(policies) == {"affinity", "consistent_hash", "round_robin"}
    for name, m in policies.items():
        assert all(key in m for key in KEYS), name
        assert m["trained_tokens"] > 0 and 0 < m["utilization"] <= 1, name
        assert 0 <= m["loop_lag_ms_p50"] <= m["loop_lag_ms_p99"], name
        # no policy generates past the fleet's ceiling; utilization is time busy x requests running while busy
        assert 0 < m["share_of_ceiling"] <= m["share_of_busy_ceiling"] <= 1, name
        assert 0 < m["prefill_stall_share"] < 1, name
        running = m["busy_fraction"] * m["mean_batch_size"] / size.server.max_running
        assert m["utilization"] == pytest.approx(running, rel=1e-6), name
        assert 0 < m["live_trajectories_mean"] <= size.in_flight, name
        # every returned trajectory ended in one status, and each rollout call returned its groups in full
        assert sum(m["statuses"].values()) == m["num_trajectories"] >= size.target_groups * size.n_samples
        assert m["num_trajectories"] % size.n_samples == 0
    # sessions kept on their server reuse its cache; spread round robin over 4 servers they mostly miss
    assert policies["affinity"]["cached_share_after_turn1"] > policies["round_robin"]["cached_share_after_turn1"] + 0.2
    assert policies["consistent_hash"]["cached_share_after_turn1"] > 0.5
    placement = policies["affinity"]["placement"]
    assert placement["num_placed"] > 0 and placement["num_stayed"] > placement["num_moved"]
    assert policies["affinity"]["num_weight_updates"] >= 1
    table = (tmp_path / "report.md").read_text()
    assert all(f"| {name} |" in table for name in policies)


def test_the_scale_benchmark_refuses_settings_out_of_range(tmp_path, capsys):
    for flag, value, message in (("--env-median-s", "0", "--env-median-s must be above 0, got 0.0"),
                                 ("--in-flight", "0", "--in-flight must be at least 1, got 0")):  # fmt: skip
        with pytest.raises(SystemExit) as exit_info:
            main(["--size", "smoke", "--out", str(tmp_path), flag, value])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "report.json").exists()
