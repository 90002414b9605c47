"""The loop's report: `report.json` (every run's curves, figures and verdict) and `report.png` (eval reward and
slime's mismatch metric per step, each run a line).

Per run, from its JSON lines (hooks.py, trainer.py): the held-out eval reward per step and its rise (the mean
of the last three evals less the eval before the first training step), the train reward, slime's
`train_rollout_logprob_abs_diff` (|old-policy log-prob - rollout log-prob| on trained tokens), the staleness of
the trained tokens (the trainer's weight version less the version that generated each token), samples
returned and removed, the wall time, and for SGLang runs the share of each trajectory's turns that reached one
worker (from the servers' request logs). The verdict: every run of the real loss rises by at least
`MIN_RISE`, every negative-control run does not (or slime's mismatch metric flags it), SGLang runs keep at least
`MIN_AFFINITY` of a trajectory's turns on one worker, and no run lost a
prompt (each step returned rollout_batch_size x n_samples_per_prompt samples).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from scripts.slime_loop.task import WARM_START_FILE

MIN_RISE = 0.3
MISMATCH_FLAG = 0.5  # mean |log-prob difference| a run must stay under to pass slime's check here
MIN_AFFINITY = 0.95  # share of a trajectory's turns on the worker of most of its turns (SGLang runs)


def affinity(routed: dict[str, Any]) -> dict[str, Any]:
    """From routing key -> {worker: requests}: the share of turns that reached their trajectory's most-used
    worker, and the trajectories seen."""
    turns = sum(sum(counts.values()) for counts in routed.values())
    kept = sum(max(counts.values()) for counts in routed.values())
    return {"share": round(kept / turns, 4) if turns else None, "trajectories": len(routed), "turns": turns}


def read_rows(work: Path) -> list[dict[str, Any]]:
    path = work / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run_figures(run: dict[str, Any]) -> dict[str, Any]:
    rows = read_rows(Path(run["work"]))
    # in the order slime ran them: before the first step (rollout_id 0), then after each step
    evals = [sum(r["reward"].values()) / len(r["reward"]) for r in rows if r["source"] == "eval"]
    rollouts = {r["rollout_id"]: r for r in rows if r["source"] == "rollout"}
    trains = {r["rollout_id"]: r for r in rows if r["source"] == "trainer" and "rollout_id" in r}
    expected = run["prompts_per_step"] * run["samples_per_prompt"]
    staleness = {}
    for rid, train in sorted(trains.items()):
        versions = rollouts.get(rid, {}).get("token_versions", {})
        tokens = sum(versions.values())
        trained_on = train["trained_on_weight_version"]
        lags = {int(v): n for v, n in versions.items() if v.isdigit()}
        staleness[rid] = {
            "mean": sum((trained_on - v) * n for v, n in lags.items()) / tokens if tokens else None,
            "max": max((trained_on - v for v in lags), default=None),
        }
    curve = evals
    rise = (sum(curve[-3:]) / len(curve[-3:]) - curve[0]) if len(curve) >= 4 else None
    mismatch = [t.get("train/train_rollout_logprob_abs_diff") for _, t in sorted(trains.items())]
    return {
        "name": run["name"], "driver": run["driver"], "backend": run["backend"], "control": run["control"],
        "seed": run["seed"], "rc": run["rc"], "wall_seconds": round(run["wall_seconds"], 1),
        "steps": run["steps"],
        "steps_trained": len(trains),
        "eval_reward": [round(x, 4) for x in curve],
        "eval_rise": None if rise is None else round(rise, 4),
        "train_reward": [rollouts[r]["reward"] for r in sorted(rollouts)],
        "mismatch": mismatch,
        "mean_mismatch": (sum(m for m in mismatch if m is not None) / len(mismatch)) if mismatch else None,
        "staleness": staleness,
        "samples_per_step": [rollouts[r]["samples"] for r in sorted(rollouts)],
        "prompts_lost": sum(max(0, expected - rollouts[r]["samples"]) for r in rollouts) // run["samples_per_prompt"],
        "removed": sum(r["removed"] for r in rollouts.values()),
        "affinity": run.get("affinity"),
        "warm_start": _warm_start(run.get("hf_checkpoint")),
    }  # fmt: skip


def _warm_start(checkpoint: str | None) -> dict[str, Any] | None:
    """What the run's warm start learned (task.warm_start), where it says."""
    path = Path(checkpoint) / WARM_START_FILE if checkpoint else None
    return json.loads(path.read_text()) if path and path.exists() else None


def verdict(figures: list[dict[str, Any]]) -> dict[str, Any]:
    problems = []
    for f in figures:
        if f["rc"] != 0 or f["steps_trained"] < f["steps"]:
            problems.append(f"{f['name']}: exit {f['rc']}, {f['steps_trained']} of {f['steps']} steps trained")
        if f["prompts_lost"]:
            problems.append(f"{f['name']}: {f['prompts_lost']} prompts lost")
        rise = f["eval_rise"] if f["eval_rise"] is not None else float("nan")
        if f["control"] == "none" and not rise >= MIN_RISE:
            problems.append(f"{f['name']}: eval reward rose {rise:.3f} (< {MIN_RISE})")
        if f["backend"] == "sglang":
            share = (f["affinity"] or {}).get("share")
            if share is None or share < MIN_AFFINITY:
                problems.append(f"{f['name']}: {share} of a trajectory's turns on one worker (< {MIN_AFFINITY})")
        flagged = f["mean_mismatch"] is not None and f["mean_mismatch"] >= MISMATCH_FLAG
        if f["control"] != "none" and rise >= MIN_RISE and not flagged:
            problems.append(
                f"{f['name']}: the negative control learned ({rise:.3f}) and slime's mismatch metric did not flag it"
            )
    return {"passed": not problems, "problems": problems}


def _stubs(work: Path) -> dict[str, str]:
    path = work / "stubs.json"
    return json.loads(path.read_text()) if path.exists() else {}


def plot(out: Path, figures: list[dict[str, Any]]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for f in figures:
        style = "-" if f["control"] == "none" else "--"
        left.plot(range(len(f["eval_reward"])), f["eval_reward"], style, label=f["name"])
        right.plot(range(len(f["mismatch"])), f["mismatch"], style, label=f["name"])
    # train.py evaluates before the first step; train_async.py first after it
    left.set(
        title="held-out eval reward (slime's eval path)", xlabel="eval (train.py: 0 before training)", ylabel="reward"
    )
    right.set(title="slime's train_rollout_logprob_abs_diff", xlabel="train step", ylabel="mean |Δ log-prob|")
    right.set_yscale("symlog", linthresh=1e-3)
    left.legend(fontsize=6)
    fig.tight_layout()
    path = out / "report.png"
    fig.savefig(path, dpi=110)
    return path


def write(out: Path, runs: list[dict[str, Any]], *, slime_commit: str) -> dict[str, Any]:
    figures = [run_figures(run) for run in runs]
    summary = {
        "slime_commit": slime_commit,
        "runs": figures,
        "verdict": verdict(figures),
        "stubs": {k: v for run in runs for k, v in _stubs(Path(run["work"])).items()},
    }
    (out / "report.json").write_text(json.dumps(summary, indent=2))
    summary["png"] = str(plot(out, figures))
    return summary
