"""The fault suite's report.md (the table, the engine failures, the notes) and faults.png (throughput and step
time of each case against the fault-free run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.faults.cases import HEADER, line


def write_markdown(report: dict[str, Any], path: Path) -> None:
    faults = report["faults"]
    lines = [
        f"# Fault injection ({report.get('size', '?')} size, seed {report['config']['seed']}, "
        f"{report.get('server', 'simulated')} server)",
        "",
        "Each case runs the long-tail workload through a fresh engine with partial rollout; `none` injects nothing.",
        "The agent cases (`agent*`) run agent programs through the session gateway instead, against `agents_none`.",
        "Prompts: taken, returned, held at the end, lost (must be 0). Throughput: trained tokens per second, and",
        "against the baseline; step time: p50, and against the baseline.",
        "",
        "```",
        HEADER,
        *(line(name, entry) for name, entry in faults.items()),
        "```",
        "",
        "| fault | what | lost | failed by class | retries spent | budgets exhausted |",
        "|---|---|---|---|---|---|",
    ]
    for name, entry in faults.items():
        if "skipped" in entry:
            lines.append(f"| {name} | {entry['what']} | skipped: {entry['skipped']} | | | |")
            continue
        if "suite_error" in entry:
            lines.append(f"| {name} | {entry['what']} | not run: {entry['suite_error'].get('error', '')} | | | |")
            continue
        failed = ", ".join(f"{k}: {v}" for k, v in entry["trajectories"]["failed_by_error_class"].items()) or "-"
        spent = ", ".join(f"{k}: {v}" for k, v in entry["retries"]["spent_by_class"].items()) or "-"
        exhausted = ", ".join(f"{k}: {v}" for k, v in entry["retries"]["budgets_exhausted"].items()) or "-"
        lines.append(f"| {name} | {entry['what']} | {entry['prompts']['lost']} | {failed} | {spent} | {exhausted} |")
    failures = {name: e["engine_failure"] for name, e in faults.items() if e.get("engine_failure")}
    lost = {name: e["prompts"]["lost"] for name, e in faults.items() if "prompts" in e and e["prompts"]["lost"]}
    not_run = {name: e["suite_error"] for name, e in faults.items() if "suite_error" in e}
    lines += ["", "## Engine failures", ""]
    if not failures and not lost and not not_run:
        lines.append("None: no case crashed or hung the engine, and no case lost a prompt.")
    for name, failure in failures.items():
        lines.append(f"- **{name}**: {failure['kind']} at step {failure.get('step', '?')}"
                     f" ({failure.get('where', '')}): {failure.get('error', '')}")  # fmt: skip
        if failure.get("traceback_head"):
            lines += ["  ```", *("  " + row for row in failure["traceback_head"]), "  ```"]
    for name, n in lost.items():
        if name not in failures:
            lines.append(f"- **{name}**: {n} prompt(s) lost")
    for name, error in not_run.items():
        lines.append(f"- **{name}** was not run, the suite failed: {error.get('error', '')}")
        if error.get("traceback_head"):
            lines += ["  ```", *("  " + row for row in error["traceback_head"]), "  ```"]
    sglang = report.get("sglang", {})
    if sglang.get("run"):
        lines += ["", "## Against real SGLang (--sglang)", "", sglang["covers"], "", sglang["differs"]]
    else:
        lines += ["", "## --sglang", "", sglang.get("why", "not run")]
    path.write_text("\n".join(lines) + "\n")


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(name, e) for name, e in report["faults"].items() if "prompts" in e and name != "none"]
    names = [name for name, _ in rows]
    throughput = [e["throughput"].get("relative_to_none") or 0.0 for _, e in rows]
    inflation = [e["steps"].get("inflation_p50") or 0.0 for _, e in rows]
    lost = [e["prompts"]["lost"] for _, e in rows]
    broken = [bool(e.get("engine_failure")) for _, e in rows]
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.45 * len(rows) + 1.8), sharey=True)
    y = range(len(rows))
    for ax, values, title in (
        (axes[0], throughput, "trained tokens/s, relative to no faults"),
        (axes[1], inflation, "step time p50, relative to no faults"),
    ):
        colors = ["#c0392b" if b or n else "#2e86c1" for b, n in zip(broken, lost, strict=True)]
        ax.barh(list(y), values, color=colors)
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_title(title, fontsize=10)
        for i, value in enumerate(values):
            label = f"{value:.2f}"
            if broken[i]:
                label += f"  engine {rows[i][1]['engine_failure']['kind']}"
            if lost[i]:
                label += f"  lost {lost[i]}"
            ax.text(value, i, " " + label, va="center", fontsize=8)
    axes[0].set_yticks(list(y), names, fontsize=8)
    axes[0].invert_yaxis()
    server = report.get("server", "simulated")
    fig.suptitle(f"fault injection, {report.get('size', '')} size, {server} server "
                 "(red: the engine failed or a prompt was lost)")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
