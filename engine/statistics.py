"""The engine's numbers as a frozen snapshot (`RolloutEngine.statistics()`), defined below the engine so that what
reads them (the Prometheus collector, the step summary, the live view) needs no import of the engine.

    stats = engine.statistics()          # any `Measured`: RolloutEngine is one
    stats.num_groups_open, stats.scheduler.phases, stats.weight_version_index
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from engine.scheduler.queue import SchedulerStatistics


@dataclass(frozen=True, slots=True)
class EngineStatistics:
    num_prompts_admitted: int
    num_groups_open: int  # admitted, some member still running or paused
    num_groups_done: int  # finished, waiting to be returned
    num_groups_returned: int
    num_groups_dropped: dict[str, int]
    num_trajectories_inflight: int
    is_source_exhausted: bool
    weight_version_index: int  # how many weight versions generation has moved through (0: the first)
    scheduler: SchedulerStatistics


class Measured(Protocol):
    """What the metrics read an engine's numbers from."""

    def statistics(self) -> EngineStatistics: ...
