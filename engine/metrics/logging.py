"""Structured turn logs: one event at the end of every turn and of every trajectory.

    engine = RolloutEngine(..., observers=[TurnLogger(level="info", sample=0.1)])

With `decode`, a turn event carries the turn's text (`turnstile run --log-level debug`). Events are JSON
lines when the stream is not a terminal (or `json=True`), a readable console line otherwise. `sample`
keeps that share of turn events (every k-th one), so 10,000 turns a second need not reach the disk;
trajectory events are always kept at their level (`failed` ones at warning).
The logger is built for this observer alone (structlog's global configuration is left untouched).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import IO, TYPE_CHECKING, Any

import orjson
import structlog

from engine.metrics.events import Observer
from engine.trajectory import Status

if TYPE_CHECKING:
    from engine.trajectory import Trajectory, Turn

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}


def _dumps(event: dict[str, Any], **_: Any) -> str:
    """orjson: a tenth of the stdlib encoder's cost per event; anything it cannot encode becomes a string."""
    return orjson.dumps(event, default=str).decode()


def _add_time(logger: Any, method: str, event: dict[str, Any]) -> dict[str, Any]:
    """`ts`: seconds since the epoch (a float is a tenth of the cost of an ISO string)."""
    event["ts"] = time.time()
    return event


class TurnLogger(Observer):
    def __init__(
        self,
        *,
        level: str = "info",
        json: bool | None = None,
        stream: IO[str] | None = None,
        sample: float = 1.0,
        decode: Callable[[Sequence[int]], str] | None = None,
    ):
        """`decode` (token ids to text): turn events carry the turn's `response_text` and `observation_text`."""
        if level not in LEVELS:
            raise ValueError(f"log level must be one of {sorted(LEVELS)}, got {level!r}")
        if not 0 < sample <= 1:
            raise ValueError(f"sample must be in (0, 1], got {sample}")
        stream = stream or sys.stderr
        if json is None:
            json = not stream.isatty()
        renderer = structlog.processors.JSONRenderer(_dumps) if json else structlog.dev.ConsoleRenderer(colors=False)
        self.log = structlog.wrap_logger(
            structlog.WriteLogger(stream),
            processors=[structlog.processors.add_log_level, _add_time, renderer],
            wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        ).bind()  # bound once: the lazy proxy would rebind on every event
        self._every = max(1, round(1 / sample))
        self._decode = decode
        self._seen = 0

    def turn_ended(self, trajectory: Trajectory, turn: Turn, outcome: str) -> None:
        self._seen += 1
        if self._seen % self._every:
            return
        self.log.info(
            "turn",
            trajectory=trajectory.id,
            group=trajectory.group_id,
            index=trajectory.index,
            turn=turn.index,
            generated_tokens=turn.num_generated,
            observation_tokens=turn.num_observation,
            generate_s=turn.generate_seconds,
            env_s=turn.env_seconds,
            queue_s=turn.queue_seconds,
            env_queue_s=turn.env_queue_seconds,
            retries=turn.retries,
            finish_reason=turn.finish_reason,
            outcome=outcome,
            weight_version=turn.weight_version,
            **(self._texts(trajectory, turn) if self._decode is not None else {}),
        )

    def _texts(self, trajectory: Trajectory, turn: Turn) -> dict[str, str]:
        generated = trajectory.generated_ids(turn)
        start = trajectory.prompt_length + turn.start + turn.num_generated
        observed = trajectory.tokens[start : start + turn.num_observation]
        return {"response_text": self._decode(generated), "observation_text": self._decode(observed)}

    def trajectory_ended(self, trajectory: Trajectory) -> None:
        fields: dict[str, Any] = dict(
            trajectory=trajectory.id,
            group=trajectory.group_id,
            index=trajectory.index,
            status=str(trajectory.status),
            stop_reason=str(trajectory.stop_reason),
            turns=len(trajectory.turns),
            generated_tokens=trajectory.num_generated,
            response_tokens=trajectory.response_length,
            retries=trajectory.num_retries,
            reward=trajectory.reward,
            weight_versions=sorted(set(trajectory.weight_versions)),
        )
        if trajectory.errors:
            fields["errors"] = [f"{e.error_class}: {e.message}" for e in trajectory.errors]
            tracebacks = [e.traceback for e in trajectory.errors if e.traceback]
            if tracebacks:  # where in the env's (or a hook's) code it failed; the console shows it below the line
                fields["exception"] = tracebacks[-1]
        if trajectory.status is Status.FAILED:
            self.log.warning("trajectory", **fields)
        else:
            self.log.info("trajectory", **fields)
