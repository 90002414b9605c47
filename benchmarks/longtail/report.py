"""The long-tail benchmark's report: a Markdown table per workload, a timeline and a throughput plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

COLORS = {
    "generate": "#3b7dd8", "env": "#f28e2b", "reward": "#59a14f", "wait": "#c8c8c8", "done, step not over": "#eeeeee",
}  # fmt: skip
POLICY_COLORS = {"slime_style": "#9e9e9e", "turn": "#7fb3e6", "turn_partial": "#1f5fbf"}
COLUMNS = (
    ("trained tok/s", "trained_tokens_per_s", "{:.0f}"),
    ("step p50 s", "step_seconds_p50", "{:.2f}"),
    ("step p99 s", "step_seconds_p99", "{:.2f}"),
    ("utilization", "backend_utilization", "{:.2f}"),
    ("busy", "backend_busy_fraction", "{:.2f}"),
    ("mean batch", "mean_batch_size", "{:.1f}"),
    ("discarded", "discarded_token_fraction", "{:.3f}"),
    ("unfinished", "unfinished_token_fraction", "{:.3f}"),
    ("stale <= 1", "stale_le1_fraction", "{:.3f}"),
    ("reward calls", "reward_calls", "{:d}"),
    ("reward s / step", "reward_seconds_per_step", "{:.2f}"),
    ("reward tail", "reward_tail_fraction", "{:.3f}"),
)


def targets(policies: dict[str, Any]) -> list[tuple[str, bool]]:
    """The figures the benchmark is judged against, each with whether it is met."""
    partial = policies["turn_partial"]
    return [
        ("turn_partial trained tokens/s >= 2x slime_style", _ratio(policies, "turn_partial", "slime_style") >= 2.0),
        ("turn_partial trained tokens/s >= 1.3x turn", _ratio(policies, "turn_partial", "turn") >= 1.3),
        ("turn_partial backend utilization >= 0.85", partial["backend_utilization"] >= 0.85),
        ("turn_partial: >= 95% of trained tokens at most 1 version stale", partial["stale_le1_fraction"] >= 0.95),
        ("turn_partial: < 5% of generated tokens discarded", partial["discarded_token_fraction"] < 0.05),
    ]


def _ratio(policies: dict[str, Any], a: str, b: str) -> float:
    base = policies[b]["trained_tokens_per_s"]
    return policies[a]["trained_tokens_per_s"] / base if base else float("inf")


def write_markdown(report: dict[str, Any], path: Path) -> None:
    lines = [f"# Long-tail benchmark ({report.get('size', 'custom')})", ""]
    for name, workload in report["workloads"].items():
        policies = workload["policies"]
        latency_ms = workload.get("reward_latency_s", 0.0) * 1000
        reward = f"reward function, {latency_ms:g} ms" if workload.get("reward_source") == "rm" else "env reward"
        lines += [f"## {name} (env step median {workload['env_median_s'] * 1000:g} ms, {reward})", ""]
        header = ["policy", *(title for title, _, _ in COLUMNS), "x slime", "failed / samples", "staleness (tokens)"]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for policy, m in policies.items():
            cells = [policy, *(fmt.format(m[key]) for _, key, fmt in COLUMNS)]
            cells.append(f"{_ratio(policies, policy, 'slime_style'):.2f}" if "slime_style" in policies else "-")
            cells.append(f"{m['statuses'].get('failed', 0)} / {m['num_trajectories']}")
            cells.append(", ".join(f"{age}: {n}" for age, n in m["staleness_histogram"].items()))
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        if name == report.get("headline_workload") and set(policies) >= {"slime_style", "turn", "turn_partial"}:
            lines += ["Targets (judged on this workload):", ""]
            lines += [f"- {'met' if ok else 'NOT met'}: {text}" for text, ok in targets(policies)] + [""]
    lines += ["## Notes", "", *(f"- {note}" for note in report.get("notes", ())), ""]
    config = report.get("config", {})
    lines += ["## Configuration", "", "```", *(f"{k}: {v}" for k, v in config.items()), "```", ""]
    path.write_text("\n".join(lines))


def plot_throughput(report: dict[str, Any], path: Path) -> None:
    workloads = list(report["workloads"])
    policies = list(next(iter(report["workloads"].values()))["policies"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(len(policies), 1)
    for i, policy in enumerate(policies):
        xs = [w + (i - (len(policies) - 1) / 2) * width for w in range(len(workloads))]
        for ax, key in zip(axes, ("trained_tokens_per_s", "backend_utilization"), strict=True):
            values = [report["workloads"][w]["policies"][policy][key] for w in workloads]
            bars = ax.bar(xs, values, width, label=policy, color=POLICY_COLORS.get(policy))
            ax.bar_label(bars, fmt="%.0f" if key == "trained_tokens_per_s" else "%.2f", fontsize=7)
    for ax, title in zip(axes, ("trained tokens / s", "backend utilization (running / cap)"), strict=True):
        ax.set_xticks(range(len(workloads)), workloads)
        ax.set_title(title)
    axes[1].set_ylim(0, 1.05)
    axes[1].axhline(0.7, color="black", linestyle=":", linewidth=0.8)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_timeline(timelines: dict[str, list[dict[str, Any]]], path: Path, *, title: str = "") -> None:
    """One panel per policy: a lane per trajectory, blue generating, orange in the env, green in the reward
    function, grey waiting (for a slot, for the event loop, for a retry, while paused), light grey done and
    waiting for the step's end."""
    fig, axes = plt.subplots(len(timelines), 1, figsize=(12, 3.2 * len(timelines)), squeeze=False)
    for ax, (policy, lanes) in zip(axes[:, 0], timelines.items(), strict=True):
        for y, lane in enumerate(lanes):
            step_end = lane["step"][1]
            ax.barh(y, lane["end"] - lane["start"], left=lane["start"], height=0.8, color=COLORS["wait"])
            ax.barh(y, step_end - lane["end"], left=lane["end"], height=0.8, color=COLORS["done, step not over"])
            for kind in ("generate", "env", "reward"):
                spans = [(s, max(e - s, 1e-4)) for s, e in lane.get(kind, ())]
                ax.broken_barh(spans, (y - 0.4, 0.8), color=COLORS[kind])
        if lanes:
            for x in lanes[0]["step"]:
                ax.axvline(x, color="black", linestyle="--", linewidth=0.8)
        ax.set_title(f"{policy}: {len(lanes)} trajectories returned at one step, bounds dashed ({title})", fontsize=9)
        ax.set_ylabel("trajectory")
        ax.set_yticks([])
        ax.margins(x=0.01)
    axes[-1, 0].set_xlabel("seconds since the policy started")
    handles = [Patch(color=c, label=k) for k, c in COLORS.items()]
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
