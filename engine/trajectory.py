"""One sample of a multi-turn rollout: its tokens, per-token mask and log-probs, and its turns.

Tokens, log-probs and the loss mask are stored as compact `array.array`s (int32, float32, uint8:
9 bytes per response token) and converted to Python lists only at the edges (`to_record`).
Invariant at every turn boundary (`check_invariant`):

    len(loss_mask) == len(logprobs) == len(tokens) - prompt_length

Status changes go through `transition`, the one writer, which refuses illegal edges.
"""

from __future__ import annotations

import itertools
import uuid
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from engine.errors import ErrorRecord, Stage
from engine.multimodal import TrainInputBuffer

if TYPE_CHECKING:
    from engine.parsers.base import ParsedTurn


class Status(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    PAUSED = "paused"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"

    @property
    def is_terminal(self) -> bool:
        return self in _TERMINAL


class StopReason(StrEnum):
    ENV_DONE = "env_done"
    MAX_TURNS = "max_turns"
    TOKEN_BUDGET = "token_budget"
    LENGTH = "length"
    ABORTED = "aborted"
    ENV_ERROR = "env_error"
    BACKEND_ERROR = "backend_error"
    REWARD_ERROR = "reward_error"
    ENCODE_ERROR = "encode_error"  # the prompt or an observation could not be encoded
    FILTER_ERROR = "filter_error"  # the group filter raised
    INTERNAL_ERROR = "internal_error"  # any other exception while handling the trajectory
    STALE = "stale"  # more than max_staleness versions old, and not run again


_TERMINAL = frozenset({Status.COMPLETED, Status.TRUNCATED, Status.ABORTED, Status.FAILED})
_LEGAL_EDGES = {
    Status.PENDING: frozenset({Status.RUNNING, Status.ABORTED, Status.FAILED}),
    Status.RUNNING: frozenset({Status.PAUSED} | _TERMINAL),
    Status.PAUSED: frozenset({Status.RUNNING, Status.ABORTED, Status.FAILED}),
    # after a trajectory ended: its (group's) reward or the group filter failed, or it went too stale
    Status.COMPLETED: frozenset({Status.FAILED, Status.ABORTED}),
    Status.TRUNCATED: frozenset({Status.FAILED, Status.ABORTED}),
}
# The status each stop reason ends a trajectory in.
END_STATUS = {
    StopReason.ENV_DONE: Status.COMPLETED,
    StopReason.MAX_TURNS: Status.COMPLETED,
    StopReason.TOKEN_BUDGET: Status.TRUNCATED,
    StopReason.LENGTH: Status.TRUNCATED,
    StopReason.ABORTED: Status.ABORTED,
    StopReason.ENV_ERROR: Status.FAILED,
    StopReason.BACKEND_ERROR: Status.FAILED,
    StopReason.REWARD_ERROR: Status.FAILED,
    StopReason.ENCODE_ERROR: Status.FAILED,
    StopReason.FILTER_ERROR: Status.FAILED,
    StopReason.INTERNAL_ERROR: Status.FAILED,
    StopReason.STALE: Status.ABORTED,
}
# The stop reason a failure ends a trajectory with, by the stage that failed.
STOP_OF_STAGE = {
    Stage.BACKEND: StopReason.BACKEND_ERROR,
    Stage.ENV: StopReason.ENV_ERROR,
    Stage.ENCODE: StopReason.ENCODE_ERROR,
    Stage.REWARD: StopReason.REWARD_ERROR,
    Stage.FILTER: StopReason.FILTER_ERROR,
    Stage.ENGINE: StopReason.INTERNAL_ERROR,
}

_ids = itertools.count()


@dataclass(frozen=True, slots=True)
class Span:
    """The tokens of one generate call: `length` tokens from `start` in the response, by one weight version."""

    start: int
    length: int
    weight_version: str | None


@dataclass(slots=True)
class Turn:
    """What one turn did. `start` is the offset of its generated tokens in the response."""

    index: int
    start: int
    num_generated: int = 0
    num_observation: int = 0
    generate_seconds: float = 0.0
    env_seconds: float = 0.0
    queue_seconds: float = 0.0  # waiting for a generation slot (a pause not counted)
    env_queue_seconds: float = 0.0  # waiting for an env slot
    retries: int = 0
    prompt_tokens: int = 0  # what the server prefilled for this turn's requests, cached or not
    cached_tokens: int = 0  # of those, how many it found in its prefix cache
    finish_reason: str | None = None
    cut_at_cap: bool = False  # the per-turn cap stopped the model mid-turn; the trajectory went on
    weight_version: str | None = None
    # the env's chat message after this turn, or messages (several tool results), kept for re-rendering
    observation: dict[str, Any] | list[dict[str, Any]] | None = None
    is_reported: bool = False  # observers were told this turn ended
    reading: ParsedTurn | None = None  # the turn as SGLang's parsers read it on the server (turn_parser), if they did

    @property
    def observation_messages(self) -> list[dict[str, Any]]:
        """The observation as a list of chat messages (none when there was none)."""
        if self.observation is None:
            return []
        return list(self.observation) if isinstance(self.observation, list) else [self.observation]

    def to_record(self) -> dict[str, Any]:
        return {
            name: getattr(self, name)
            for name in self.__slots__
            if name not in ("observation", "is_reported", "reading")
        }


@dataclass(slots=True, eq=False)
class Trajectory:
    prompt: list[dict[str, Any]] | str  # chat messages, or text already rendered with the chat template
    tokens: array = field(default_factory=lambda: array("i"))  # prompt + response, int32
    prompt_length: int = 0
    loss_mask: array = field(default_factory=lambda: array("B"))  # per response token: 1 model, 0 env
    logprobs: array = field(default_factory=lambda: array("f"))  # per response token; 0.0 for env tokens
    status: Status = Status.PENDING
    stop_reason: StopReason | None = None
    turns: list[Turn] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)  # one per generate call: which weights made which tokens
    prompt_images: list[Any] = field(default_factory=list)  # images of a prompt given as rendered text
    image_data: list[str] = field(default_factory=list)  # rollout side: every image so far, for the backend
    train_inputs: TrainInputBuffer = field(default_factory=TrainInputBuffer)  # training side, merged once
    errors: list[ErrorRecord] = field(default_factory=list)
    turn_cap: int | None = None  # a tighter cap on the next turns' tokens than the sampling's (an agent's max_tokens)
    turn_stop: tuple[str, ...] = ()  # stop strings of the next turns beside the sampling's (an agent's `stop`)
    group_id: int = 0
    index: int = 0
    reward: float | dict[str, float] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    id: int = field(default_factory=lambda: next(_ids))
    session_id: str = field(default_factory=lambda: uuid.uuid4().hex)  # routes every turn to one server
    sample: Any = None  # what the consumer made of it once ended (the bridge's slime Sample)
    forks: list[Trajectory] = field(default_factory=list)  # chains its agent's session forked off it (engine/agents)
    # Called with each run of the model's new tokens as they are generated, when the backend streams (see
    # engine/backends/base.py): a gateway sets it while a request waits for its turn and clears it after. Read at
    # every run, so setting or clearing it takes effect at once; one that raises is cleared (engine/turn.py). Never
    # in a record.
    token_listener: Callable[[list[int]], None] | None = field(default=None, repr=False)

    # -- building ---------------------------------------------------------------------------------
    def set_prompt(self, token_ids: Sequence[int]) -> None:
        if len(self.tokens):
            raise ValueError(f"trajectory {self.id}: the prompt is already set")
        self.tokens.extend(token_ids)
        self.prompt_length = len(self.tokens)

    def append_generation(
        self, token_ids: Sequence[int], logprobs: Sequence[float], weight_version: str | None = None
    ) -> None:
        """The model's tokens: loss mask 1, with their log-probs and the weight version that made them."""
        if len(token_ids) != len(logprobs):
            raise ValueError(f"trajectory {self.id}: {len(token_ids)} tokens but {len(logprobs)} log-probs")
        self.spans.append(Span(self.response_length, len(token_ids), weight_version))
        self.tokens.extend(token_ids)
        self.logprobs.extend(logprobs)
        self.loss_mask.frombytes(b"\x01" * len(token_ids))

    def append_observation(self, token_ids: Sequence[int]) -> None:
        """Environment tokens: loss mask 0, log-prob 0.0."""
        self.tokens.extend(token_ids)
        self.logprobs.frombytes(bytes(self.logprobs.itemsize * len(token_ids)))  # zero bytes: 0.0
        self.loss_mask.frombytes(bytes(len(token_ids)))

    # -- state ------------------------------------------------------------------------------------
    def transition(self, to: Status, stop_reason: StopReason | None = None) -> None:
        """The one writer of `status`. A terminal status needs a stop reason; other edges take none."""
        if to not in _LEGAL_EDGES.get(self.status, ()):
            raise ValueError(f"trajectory {self.id}: illegal status change {self.status} -> {to}")
        if to.is_terminal != (stop_reason is not None):
            raise ValueError(f"trajectory {self.id}: {to} needs a stop reason exactly when it is terminal")
        self.status = to
        if stop_reason is not None:
            self.stop_reason = stop_reason

    def finish(self, stop_reason: StopReason) -> None:
        self.transition(END_STATUS[stop_reason], stop_reason)

    def fail_after_end(self, error: ErrorRecord) -> None:
        """An ended COMPLETED or TRUNCATED trajectory fails after all: its (group's) reward, the group
        filter or a check after its end failed."""
        self.errors.append(error)
        self.transition(Status.FAILED, STOP_OF_STAGE[error.stage])

    def abort_after_end(self, stop_reason: StopReason) -> None:
        """An ended COMPLETED or TRUNCATED trajectory is not trained on after all (gone too stale)."""
        self.transition(Status.ABORTED, stop_reason)

    def restart(self) -> int:
        """Drop everything but the prompt messages, to run again from the start; returns the number of
        generated tokens thrown away. The prompt must be encoded again."""
        discarded = self.num_generated
        self.tokens, self.loss_mask, self.logprobs = array("i"), array("B"), array("f")
        self.prompt_length = 0
        self.turns, self.spans, self.image_data = [], [], []
        self.train_inputs = TrainInputBuffer()
        self.reward = None
        self.metadata["num_restarts"] = self.metadata.get("num_restarts", 0) + 1
        return discarded

    # -- views ------------------------------------------------------------------------------------
    @property
    def response_length(self) -> int:
        return len(self.tokens) - self.prompt_length

    @property
    def response_ids(self) -> array:
        return self.tokens[self.prompt_length :]

    @property
    def num_generated(self) -> int:
        return sum(span.length for span in self.spans)

    @property
    def weight_versions(self) -> list[str]:
        """The weight version of each generate call, as slime's Sample keeps them."""
        return [span.weight_version for span in self.spans if span.weight_version is not None]

    @property
    def is_ended(self) -> bool:
        return self.status.is_terminal

    @property
    def num_retries(self) -> int:
        """Retries it spent in all (its turns', its env's resets', its reward's), as `metadata["retries"]` has them."""
        return sum(self.metadata.get("retries", {}).values())

    @property
    def last_error(self) -> tuple[str, str] | None:
        """(error class, message) of its last error, if it had one."""
        return (str(self.errors[-1].error_class), self.errors[-1].message) if self.errors else None

    @property
    def current_turn(self) -> int | None:
        """The index of the turn in progress, or of the last one once the turns are over; None before the first."""
        return self.turns[-1].index if self.turns else None

    def generated_ids(self, turn: Turn) -> array:
        """The model's tokens of one turn."""
        start = self.prompt_length + turn.start
        return self.tokens[start : start + turn.num_generated]

    def check_invariant(self) -> None:
        n = self.response_length
        if not (len(self.loss_mask) == len(self.logprobs) == n):
            raise AssertionError(
                f"trajectory {self.id}: loss_mask {len(self.loss_mask)}, logprobs {len(self.logprobs)}, response {n}"
            )

    def nbytes(self) -> int:
        """Bytes held by the token, log-prob and mask arrays."""
        return sum(a.itemsize * len(a) for a in (self.tokens, self.logprobs, self.loss_mask))

    def to_record(self, decode: Callable[[Sequence[int]], str] | None = None) -> dict[str, Any]:
        """A JSON-ready dict: arrays become lists here, at the edge. With `decode` (token ids to text), the
        text a person reads too: `prompt_text`, and each turn's `response_text` (the model's tokens) and
        `observation_text` (the env's after them)."""
        record = {
            "id": self.id,
            "group_id": self.group_id,
            "index": self.index,
            "status": str(self.status),
            "stop_reason": None if self.stop_reason is None else str(self.stop_reason),
            "reward": self.reward,
            "prompt_length": self.prompt_length,
            "response_length": self.response_length,
            "tokens": self.tokens.tolist(),
            "loss_mask": self.loss_mask.tolist(),
            "logprobs": self.logprobs.tolist(),
            "weight_versions": self.weight_versions,
            "num_images": len(self.image_data),
            "turns": [t.to_record() for t in self.turns],
            "errors": [
                {
                    "class": str(e.error_class),
                    "stage": str(e.stage),
                    "turn": e.turn,
                    "message": e.message,
                    "traceback": e.traceback,
                }
                for e in self.errors
            ],
            "metadata": self.metadata,
        }
        if decode is not None:
            record["prompt_text"] = decode(self.tokens[: self.prompt_length])
            for turn, turn_record in zip(self.turns, record["turns"], strict=True):
                start = self.prompt_length + turn.start
                middle = start + turn.num_generated
                turn_record["response_text"] = decode(self.tokens[start:middle])
                turn_record["observation_text"] = decode(self.tokens[middle : middle + turn.num_observation])
        return record


@dataclass(slots=True, eq=False)
class Group:
    """The `n_samples_per_prompt` trajectories of one prompt; emitted once every member has ended."""

    group_id: int
    row: dict[str, Any]  # the prompt row it came from: prompt, label, metadata
    trajectories: list[Trajectory]

    @property
    def rewards(self) -> list[float | dict[str, float] | None]:
        return [t.reward for t in self.trajectories]

    @property
    def is_done(self) -> bool:
        return all(t.is_ended for t in self.trajectories)
