"""Partial rollout across weight updates: which weights made which tokens, and how old is too old.

Weight versions are ordered as the engine is told of them (`VersionClock.advance`, on every resume
after a weight update); a trajectory's staleness is how many versions lie between its oldest
tokens and the current version. `max_staleness` bounds it for a paused trajectory about to resume,
for a trajectory as it ends, and for ended ones not yet returned when generation resumes: beyond it
the trajectory is restarted (its tokens discarded; at most `max_restarts` times) or ends STALE.
"""

from __future__ import annotations

from array import array

from engine.trajectory import Trajectory


class VersionClock:
    """Weight versions in the order they were served."""

    def __init__(self, initial: str | None = None):
        self._index: dict[str | None, int] = {}
        self.current: str | None = None
        self.advance(initial)

    def advance(self, version: str | None) -> None:
        """The backend now serves `version` (a new one, or one already seen)."""
        if version not in self._index:
            self._index[version] = len(self._index)
        self.current = version

    def observe(self, version: str | None) -> None:
        """A version reported by the backend: one never announced is newer than all before it."""
        if version not in self._index:
            self.advance(version)

    def index(self, version: str | None) -> int:
        """Position of `version` in serving order; a version never announced counts as the current one."""
        return self._index.get(version, self._index[self.current])

    def age(self, version: str | None) -> int:
        """How many versions behind the current one `version` is."""
        return self._index[self.current] - self.index(version)

    def staleness(self, trajectory: Trajectory) -> int:
        """Age of the trajectory's oldest tokens, its first span's (0 when it has generated nothing)."""
        return self.age(trajectory.spans[0].weight_version) if trajectory.spans else 0


def mask_offpolicy(trajectory: Trajectory, clock: VersionClock) -> int:
    """Zero the loss mask of tokens made by versions older than the trajectory's newest; returns how many."""
    if not trajectory.spans:
        return 0
    newest = max(clock.index(span.weight_version) for span in trajectory.spans)
    masked = 0
    for span in trajectory.spans:
        if clock.index(span.weight_version) < newest:
            trajectory.loss_mask[span.start : span.start + span.length] = array("B", bytes(span.length))
            masked += span.length
    return masked
