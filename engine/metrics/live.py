"""The live view of a run: groups done of the target, trajectories in flight by state, tokens per
second, errors. A rich progress display on a terminal; a plain line every few seconds otherwise.

    async with anyio.create_task_group() as tg:
        tg.start_soon(LiveView(engine, recorder, total_groups=32).run)
        ...  # run the engine; then tg.cancel_scope.cancel()
"""

from __future__ import annotations

import sys
import time
from typing import IO, TYPE_CHECKING

import anyio
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.text import Text

from engine.scheduler.queue import Phase

if TYPE_CHECKING:
    from engine.metrics.recorder import MetricsRecorder
    from engine.statistics import Measured


class LiveView:
    def __init__(
        self,
        engine: Measured,
        recorder: MetricsRecorder,
        *,
        total_groups: int,
        stream: IO[str] | None = None,
        terminal: bool | None = None,
        interval_s: float | None = None,
    ):
        self.engine, self.recorder, self.total_groups = engine, recorder, total_groups
        self.stream = stream or sys.stderr
        self.terminal = self.stream.isatty() if terminal is None else terminal
        self.interval_s = interval_s or (0.5 if self.terminal else 5.0)
        self._last = (time.monotonic(), 0)

    def line(self) -> str:
        """One line of status, the same in both displays."""
        stats = self.engine.statistics()
        phases = stats.scheduler.phases
        now, generated = time.monotonic(), self.recorder.counts["generated_tokens"]
        (then, before), self._last = self._last, (now, generated)
        rate = (generated - before) / (now - then) if now > then else 0.0
        failed = sum(n for (status, _), n in self.recorder.trajectories.copy().items() if status == "failed")
        retries = sum(stats.scheduler.retries.values())
        breaker = " · breaker OPEN" if stats.scheduler.breaker.is_open else ""
        return (
            f"groups {stats.num_groups_returned}/{self.total_groups} · in flight: "
            f"{phases.get(Phase.GENERATING, 0)} generating, {phases.get(Phase.IN_ENV, 0)} in env, "
            f"{phases.get(Phase.WAITING_TO_GENERATE, 0) + phases.get(Phase.WAITING_FOR_ENV, 0)} waiting, "
            f"{phases.get(Phase.PAUSED, 0)} paused · {rate:.0f} tok/s · failed {failed} · retries {retries}{breaker}"
        )

    async def run(self) -> None:
        """Refresh until cancelled; the last state is shown when it is."""
        if not self.terminal:
            try:
                while True:
                    await anyio.sleep(self.interval_s)
                    print(self.line(), file=self.stream, flush=True)
            finally:
                print(self.line(), file=self.stream, flush=True)
        console = Console(file=self.stream, force_terminal=True)
        progress = Progress(
            TextColumn("groups"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
        )
        task = progress.add_task("rollout", total=self.total_groups)
        status = Text()
        with Live(Group(progress, status), console=console, refresh_per_second=4):
            try:
                while True:
                    self._refresh(progress, task, status)
                    await anyio.sleep(self.interval_s)
            finally:
                self._refresh(progress, task, status)

    def _refresh(self, progress: Progress, task: TaskID, status: Text) -> None:
        status.plain = self.line().split(" · ", 1)[1]  # the groups are the bar above
        progress.update(task, completed=self.engine.statistics().num_groups_returned)
