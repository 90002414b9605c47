"""The hooks the engine calls as work finishes. Observers record or log; they never steer.

Counts the engine keeps anyway (retries by class, slots, phases, the breaker, pauses) are read from
`RolloutEngine.statistics()` snapshots instead; these hooks carry what only the moment knows: one
turn's or one trajectory's numbers, and a step's returned groups.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.encoding import DriftReport
    from engine.scheduler.partial import VersionClock
    from engine.trajectory import Group, Trajectory, Turn


class Observer:
    """Every hook does nothing unless overridden. Hooks run on the event loop: keep them cheap."""

    def turn_ended(self, trajectory: Trajectory, turn: Turn, outcome: str) -> None:
        """A turn is over: `outcome` is "continued", or the stop reason it ended the trajectory with."""

    def trajectory_ended(self, trajectory: Trajectory) -> None:
        """A trajectory reached its terminal status."""

    def group_dropped(self, group: Group, reason: str) -> None:
        """A finished group was filtered out (e.g. "zero_std")."""

    def step_ended(self, groups: list[Group], seconds: float, clock: VersionClock) -> None:
        """`rollout()` returned `groups` after `seconds`; `clock` tells the age of their tokens."""

    def drift_checked(self, trajectory: Trajectory, report: DriftReport) -> None:
        """A finished trajectory was compared with a full re-render of its conversation."""
