"""slime's own loop on Turnstile, end to end on a CPU: scripts/slime_loop.sh /path/to/slime [options].

For each driver (train.py, train_async.py), seed and control, one run (scripts/slime_loop/run.py, a process
of its own): slime's driver with Turnstile as the rollout (`bridge.slime.generate_rollout`), the CPU trainer
(scripts/slime_loop/trainer.py) through `create_training_models`' actor class, weights pushed by slime's disk
path every step, a held-out eval through slime's eval path every step. With `--backend sglang`, two SGLang CPU
servers are started for each run (stopped after it) and given to slime as --rollout-external-engine-addrs. The
runs' JSON lines become `report.json` and `report.png` (scripts/slime_loop/report.py), over every run in --out
(earlier invocations' too: runs can be added one at a time).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from scripts.slime_loop import report, task
from scripts.slime_loop.run import REPO
from tests.sglang_cpu.server import LOG_REQUESTS, SGLangServer, routed_requests

DRIVERS = ("train", "train_async")
CONTROLS = ("none", "inverted_mask")
BACKENDS = ("embedded", "sglang")
# slime's own filters: a group whose samples all earned the same reward has no advantage to learn from; kept, it
# adds only noise, which Adam scales up to full-size steps once most groups are solved (a policy at 1.0 fell back).
# The strict one samples on until every group differs, without end once the policy solves every question; the
# fallback drops such groups only from the step's over-sampling margin (--over-sampling-batch-size, 2x here)
ZERO_STD_FILTER = "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"
FILTERS = {"none": None, "zero-std": ZERO_STD_FILTER, "zero-std-fallback": f"{ZERO_STD_FILTER}_with_fallback"}
SGLANG_SERVERS = 2


def _filter(value: str) -> str:
    if value in FILTERS or "." in value:
        return value
    raise argparse.ArgumentTypeError(f"{value!r} is none of {', '.join(FILTERS)}, nor a function's dotted path")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/slime_loop.sh", description=__doc__.splitlines()[0])
    p.add_argument("slime", type=Path, help="a checkout of THUDM/slime")
    p.add_argument("--out", type=Path, default=Path("slime-loop-report"))
    p.add_argument("--drivers", default=",".join(DRIVERS))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--controls", default=",".join(CONTROLS), help="none (the run) and/or inverted_mask")
    p.add_argument("--control-seeds", default="0", help="seeds the negative control runs with")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--max-turns", type=int, default=2, help="answers a trajectory may give (feedback between)")
    p.add_argument("--later-credit", type=float, default=1.0, help="reward of a right answer after a wrong one")
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--train-steps-per-rollout", type=int, default=4)
    p.add_argument("--samples-per-prompt", type=int, default=16)
    p.add_argument("--lr", type=float, default=5e-4, help="AdamW's (1e-3 overshot on one seed of three)")
    p.add_argument(
        "--dynamic-filter", default="zero-std-fallback", type=_filter,
        help="slime's --dynamic-sampling-filter-path: 'zero-std-fallback' (slime's check_reward_nonzero_std_with_"
        "fallback: groups whose samples all earned the same are dropped from the step's over-sampling margin, as "
        "DAPO does, and kept past it); 'zero-std' (check_reward_nonzero_std: dropped however many it takes, so a "
        "policy that solves every question stalls the rollout); 'none' (every group kept: one train_async seed in "
        "three rose to 1.0 and fell back); or a function's dotted path",
    )  # fmt: skip
    p.add_argument(
        "--freeze-params", default="",
        help="slime's --freeze-params-name-list for the trainer (comma-separated regexes; empty: train everything)",
    )  # fmt: skip
    p.add_argument(
        "--backend", choices=BACKENDS, default="embedded",
        help="embedded: the model slime trains generates in the rollout actor; sglang: two SGLang CPU servers "
        "(--rollout-external-engine-addrs) behind the sglang-router slime starts, with its default policy",
    )  # fmt: skip
    p.add_argument(
        "--shards", type=int, default=1, help="the rollout on this many shards (`turnstile: {shards: N}`), Ray actors"
    )
    p.add_argument("--slime-commit", default=None)
    p.add_argument("--report-only", action="store_true", help="only rebuild the report from the runs in --out")
    return p.parse_args(argv)


def slime_commit(slime: Path, given: str | None) -> str:
    if given:
        return given
    try:
        return subprocess.run(
            ["git", "-C", str(slime), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def prepare(out: Path, seed: int, max_turns: int = 2, later_credit: float = 1.0, shards: int = 1) -> dict[str, str]:
    """The seed's warm-started model, prompts and custom config (shared by its runs)."""
    base = out / "inputs" / f"seed{seed}"
    base.mkdir(parents=True, exist_ok=True)
    custom = base / f"turnstile-{max_turns}turns-credit{later_credit:g}-shards{shards}.yaml"
    turnstile = {"max_new_tokens": 4, **({"shards": shards} if shards > 1 else {})}
    env = {"rollout_interaction_env_path": "scripts.slime_loop.task", "turnstile": turnstile}
    custom.write_text(yaml.safe_dump({"max_turns": max_turns, "loop_later_credit": later_credit, **env}))
    return {
        "hf_checkpoint": str(task.warm_start(base / "warm_start", seed=seed)),
        "train_data": str(task.write_prompts(base / "train.jsonl", 4000, seed=1000 + seed)),
        "eval_data": str(task.write_prompts(base / "eval.jsonl", 64, seed=2000 + seed)),
        "custom_config": str(custom),
    }


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    work = Path(spec["work"])
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        if spec["backend"] == "sglang":
            servers = sglang_servers(Path(spec["hf_checkpoint"]), work, stack)
            spec = {**spec, "sglang_urls": [s.url for s in servers], "sglang_logs": [str(s.log_path) for s in servers]}
        (work / "spec.json").write_text(json.dumps(spec, indent=2))
        with open(work / "log.txt", "w") as log:
            rc = subprocess.run(
                [sys.executable, "-m", "scripts.slime_loop.run", str(work / "spec.json")],
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=False,
            ).returncode  # fmt: skip
    result: dict[str, Any] = {"rc": rc, "wall_seconds": time.monotonic() - started}
    if spec["backend"] == "sglang":
        result["affinity"] = report.affinity(routed_requests(spec["sglang_logs"]))
    (work / "result.json").write_text(json.dumps(result))
    return result


def sglang_servers(model: Path, work: Path, stack: contextlib.ExitStack) -> list[Any]:
    """SGLANG_SERVERS SGLang CPU servers on the warm-started model, logging each request (the routing key
    shows which worker each turn reached), stopped when `stack` closes. slime finds them through
    --rollout-external-engine-addrs and registers them with the router it starts."""
    servers = [
        SGLangServer(model, log_path=work / f"sglang-{i}.log", extra=LOG_REQUESTS) for i in range(SGLANG_SERVERS)
    ]
    for server in servers:
        stack.callback(server.stop)
    with ThreadPoolExecutor(len(servers)) as pool:  # each start loads the model; side by side
        for started in [pool.submit(server.start) for server in servers]:
            started.result()
    return servers


def runs_in(out: Path) -> list[dict[str, Any]]:
    """Every run under `out` that ended (this invocation's and earlier ones'), spec and result."""
    runs = []
    for result in sorted(out.glob("*/result.json")):
        runs.append({**json.loads((result.parent / "spec.json").read_text()), **json.loads(result.read_text())})
    return runs


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    opts.out.mkdir(parents=True, exist_ok=True)
    commit = slime_commit(opts.slime, opts.slime_commit)
    for driver in opts.drivers.split(",") if not opts.report_only else []:
        for control in opts.controls.split(","):
            seeds = opts.seeds if control == "none" else opts.control_seeds
            for seed in map(int, seeds.split(",")):
                sharded = f"-shards{opts.shards}" if opts.shards > 1 else ""
                name = f"{driver}-{opts.backend}-{control}-seed{seed}{sharded}"
                spec = {
                    "name": name, "slime": str(opts.slime.resolve()), "work": str((opts.out / name).resolve()),
                    "driver": driver, "backend": opts.backend, "control": control, "seed": seed,
                    "steps": opts.steps, "prompts_per_step": opts.prompts_per_step,
                    "samples_per_prompt": opts.samples_per_prompt, "eval_samples_per_prompt": 2, "lr": opts.lr,
                    "train_steps_per_rollout": opts.train_steps_per_rollout,
                    "freeze_params": [p for p in opts.freeze_params.split(",") if p],
                    "dynamic_filter": FILTERS.get(opts.dynamic_filter, opts.dynamic_filter),
                    "partial_rollout": True, "shards": opts.shards,
                    **prepare(opts.out, seed, opts.max_turns, opts.later_credit, opts.shards),
                }  # fmt: skip
                print(f"{name}: running", flush=True)
                result = run_one(spec)
                print(f"{name}: rc {result['rc']}, {result['wall_seconds']:.0f} s", flush=True)
    summary = report.write(opts.out, runs_in(opts.out), slime_commit=commit)
    print(json.dumps(summary["verdict"], indent=2))
    return 0 if summary["verdict"]["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
