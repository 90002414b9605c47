"""One line per check, PASS or FAIL with its figure; errors with the line that raised and the repo line
(bridge/ or engine/) under it."""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SLIME_ROOT: Path | None = None  # set by the runner: frames in the checkout print relative to it


@dataclass
class Result:
    status: str  # PASS | FAIL | SKIP
    run: str
    name: str
    detail: str


class Report:
    def __init__(self) -> None:
        self.results: list[Result] = []

    def check(self, run: str, name: str, ok: bool, detail: str) -> bool:
        self._add(Result("PASS" if ok else "FAIL", run, name, detail))
        return ok

    def error(self, run: str, name: str, exc: BaseException) -> None:
        self._add(Result("FAIL", run, name, describe(exc)))

    def skip(self, run: str, name: str, why: str) -> None:
        self._add(Result("SKIP", run, name, why))

    def _add(self, result: Result) -> None:
        self.results.append(result)
        print(f"{result.status}  [{result.run}] {result.name}: {result.detail}", flush=True)

    @property
    def failed(self) -> list[Result]:
        return [r for r in self.results if r.status == "FAIL"]

    def summary(self) -> str:
        counts = {s: sum(r.status == s for r in self.results) for s in ("PASS", "FAIL", "SKIP")}
        return " ".join(f"{s} {n}" for s, n in counts.items())


def describe(exc: BaseException, limit: int = 600) -> str:
    """`Type: message`, where it was raised, and the innermost frames of Turnstile's code (engine/ or
    bridge/, and bridge/) under it."""
    message = f"{type(exc).__name__}: {exc}"
    if len(message) > limit:
        message = message[:limit] + " ..."
    frames = traceback.extract_tb(exc.__traceback__)
    cause = exc.__cause__ or exc.__context__
    while not frames and cause is not None:
        frames, cause = traceback.extract_tb(cause.__traceback__), cause.__cause__ or cause.__context__
    if not frames:
        return message
    raised = frames[-1]
    ours = [f for f in frames if _is_turnstile(f.filename)]
    bridge = [f for f in ours if _is_turnstile(f.filename, ("bridge",))]
    picks: list[traceback.FrameSummary] = []
    for frame in ours[-1:] + bridge[-1:]:  # the innermost Turnstile frame, and the bridge's under it
        if all(frame is not p for p in picks):
            picks.append(frame)
    where = "" if any(raised is p for p in picks) else f" [raised at {_here(raised)}]"
    for frame in picks:
        where += f" [Turnstile: {_here(frame)}: {(frame.line or '').strip()}]"
    return message + where


def _here(frame: traceback.FrameSummary) -> str:
    return f"{_short(frame.filename)}:{frame.lineno} in {frame.name}"


def _is_turnstile(filename: str, parts: tuple[str, ...] = ("bridge", "engine")) -> bool:
    path = Path(filename).resolve()
    return any(path.is_relative_to(REPO / part) for part in parts)


def _short(filename: str) -> str:
    path = Path(filename).resolve()
    for root, prefix in ((REPO, ""), (SLIME_ROOT, "slime-checkout:")):
        if root is not None and path.is_relative_to(root):
            return prefix + str(path.relative_to(root))
    return str(path)
