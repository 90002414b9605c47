"""A hung env under `turnstile run`: how long its trajectory takes to fail, and the process to exit after.

    python -m benchmarks.faults.hung_env [--out FILE] [--step-timeout S] [--hang-s S]

The env (this module: `build_env`, `make_prompts`) is replay-safe and every step sleeps `--hang-s`
seconds (30 by default). `turnstile run --env benchmarks.faults.hung_env --num-prompts 1 --env-step-timeout S`
runs as a user runs it, in a process of its own, with the default retry budget (two retries of an
env timeout a turn). Read off its stderr, line by line as they come:

    run_s              the run's own figure in its summary ("1 trajectories in X s"): from the engine's
                       start to the trajectory's end, generation included
    exit_after_summary_s  from the summary line to the process's exit
    budget_s           what the budget allows: (1 + retries) * step timeout + the most the backoff can add

Targets: run_s under 10 s with a 2 s step timeout, exit_after_summary_s under 5 s.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import emit
from engine.envs.base import BaseInteractionEnv
from engine.errors import ErrorClass
from engine.scheduler.retry import DEFAULT_PER_TURN, RetryPolicy

ROOT = Path(__file__).resolve().parents[2]
HANG_S = float(os.environ.get("TURNSTILE_HANG_S", "30"))  # the env's step, as the child process reads it


class HungEnv(BaseInteractionEnv):
    replay_safe = True

    def reset(self):
        return {}, {}

    def step(self, response_text):
        time.sleep(HANG_S)
        return {"obs_str": "too late"}, True, {}


def build_env(sample=None, args=None, **kw):
    return HungEnv()


def make_prompts(n, seed=0, vision=False):
    return [{"prompt": [{"role": "user", "content": "Guess a number."}]} for _ in range(n)]


def measure(step_timeout: float, hang_s: float) -> dict:
    argv = [sys.executable, "-m", "engine.cli", "run", "--env", "benchmarks.faults.hung_env", "--num-prompts", "1"]
    argv += ["--env-step-timeout", str(step_timeout), "--out", "-"]
    env = {**os.environ, "TURNSTILE_HANG_S": str(hang_s)}
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    summary_at = run_s = None
    lines = []
    for line in proc.stderr:
        lines.append(line.rstrip("\n"))
        if found := re.match(r"1 trajectories in ([0-9.]+)s", line):
            summary_at, run_s = time.monotonic(), float(found.group(1))
    proc.wait()
    exited_at = time.monotonic()
    if summary_at is None:
        raise RuntimeError("no summary line; the run printed:\n" + "\n".join(lines[-20:]))
    policy = RetryPolicy()
    retries = DEFAULT_PER_TURN[ErrorClass.ENV_TIMEOUT]
    backoff = sum(min(policy.backoff_max_s, policy.backoff_base_s * 2**attempt) for attempt in range(retries))
    return {
        "step_timeout_s": step_timeout,
        "hang_s": hang_s,
        "retries": retries,
        "budget_s": round((1 + retries) * step_timeout + backoff, 2),
        "run_s": run_s,
        "exit_after_summary_s": round(exited_at - summary_at, 2),
        "exit_status": proc.returncode,
        "last_lines": lines[-3:],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the JSON report here too")
    parser.add_argument("--step-timeout", type=float, default=2.0)
    parser.add_argument("--hang-s", type=float, default=30.0)
    args = parser.parse_args()
    result = measure(args.step_timeout, args.hang_s)
    targets = {
        "run_s_under_10": result["run_s"] < 10,
        "exit_after_summary_s_under_5": result["exit_after_summary_s"] < 5,
    }
    emit({"benchmark": "hung_env", **result, "targets": targets}, args.out)


if __name__ == "__main__":
    main()
