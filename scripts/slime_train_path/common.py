"""What the checks share: a timeout for rollout calls, a wrapper keeping what a rollout function
returned, the base class with one `ok` per check, and small formatting helpers."""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from typing import Any

from scripts.slime_train_path.double import PROBLEM_RE
from scripts.slime_train_path.report import Report

# what Megatron's actor sends RolloutManager.set_train_parallel_config (dp 2: every step is split in two)
TRAIN_PARALLEL_CONFIG = {"dp_size": 2, "cp_size": 1, "vpp_size": 1, "microbatch_group_size_per_vp_stage": 1}


class Hung(Exception):
    pass


def call_with_timeout(fn: Any, *args: Any, timeout: float, **kwargs: Any) -> Any:
    """fn(*args) in a daemon thread; Hung when it has not returned in `timeout` seconds."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True, name=getattr(fn, "__name__", "call"))
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise Hung(f"{getattr(fn, '__qualname__', fn)} did not return in {timeout:.0f} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


class Capture:
    """Wraps the rollout function slime loaded: keeps what it returned and how long it took."""

    def __init__(self, fn: Any):
        self.fn, self.out, self.seconds = fn, None, 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.out, start = None, time.monotonic()
        self.out = self.fn(*args, **kwargs)
        self.seconds = time.monotonic() - start
        return self.out


def problem_of(sample: Any) -> str | None:
    match = PROBLEM_RE.search(sample.prompt if isinstance(sample.prompt, str) else str(sample.prompt))
    return match.group(1) if match else None


def counts(values: Any) -> str:
    return "{" + ", ".join(f"{k}: {n}" for k, n in sorted(Counter(map(_key, values)).items(), key=str)) + "}"


def _key(value: Any) -> Any:
    if isinstance(value, dict):
        return str(value)
    return value


def finite_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def reward_value(sample: Any, args: Any) -> Any:
    try:
        return sample.get_reward_value(args)
    except Exception:
        return None


class Checks:
    """The base of the checks of one run (`run`: slime's functions as run.slime, the run's args, data
    source, manager, tokenizer, processor, the rendered prompts of slime's Dataset, the scripted server)."""

    def __init__(self, report: Report, run: Any, timeout: float):
        self.report, self.run, self.timeout = report, run, timeout
        self.s = run.slime

    def ok(self, name: str, ok: bool, detail: str) -> bool:
        return self.report.check(self.run.name, name, ok, detail)

    def guard(self, name: str, what: str, fn: Any, *args: Any) -> None:
        """A check that breaks on what it is given fails, and the step's other checks still run."""
        try:
            fn(*args)
        except Exception as exc:
            self.report.error(self.run.name, f"{name}: {what} (the check could not finish)", exc)
