"""A session: the trajectories one agent program's requests make, run by the engine's scheduler.

Each chain of a session is one Trajectory, driven by `Scheduler.drive` like any other, with a `SessionEnv` as
its env: the model's turn is generated under the scheduler's slots, priorities, retries and pauses; the env
step hands that turn to the request waiting for it and waits for the agent's next request, whose new messages
(tool results, a user message) are the observation, encoded by delta as any env's. The time between a reply
and the next request is the turn's env phase. A request that does not continue a chain (`history.continues`)
starts a new chain whose prompt is the request's messages: its turns are trained there, the shared ones once,
in the chain that sampled them.

    chain = session.start(asked, cause)              # a new chain; the caller drives chain.trajectory
    chain.claim(asked.keys)                          # before any await: no other request continues it now
    turn = await chain.next_turn()                   # the model's turn for this request (or the chain's end)
    chain.replied(reply_message, key)                # what the agent was sent, to match its next request
    await chain.send(new_messages, new_keys)         # the next request's messages past the history
    chain.release()
"""

from __future__ import annotations

import itertools
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import anyio

from engine.agents.history import Fit, ForkCause, Key, continues
from engine.envs.base import AsyncInteractionEnv
from engine.trajectory import Trajectory, Turn

_ids = itertools.count()


@dataclass(frozen=True, slots=True)
class Asked:
    """A request, read: its conversation as chat messages and their keys, its tools (and a digest of them),
    the turn's cap and stop strings, and whether the client says it is a retry."""

    messages: list[dict[str, Any]]
    keys: list[Key]
    tools: list[dict[str, Any]] | None = None
    tools_key: str | None = None
    cap: int | None = None
    stop: tuple[str, ...] = ()
    retry: bool = False


class Chain:
    """One root-to-leaf chain of a session: its trajectory, the messages the agent has seen (and their keys), and
    the hand-off between the request waiting for a turn and the env step waiting for the next request."""

    def __init__(self, session: Session, trajectory: Trajectory, asked: Asked):
        self.session, self.trajectory = session, trajectory
        self.tools, self.tools_key = asked.tools, asked.tools_key
        self.history: list[dict[str, Any]] = list(asked.messages)  # as the agent sent and was sent them
        self.keys: list[Key] = list(asked.keys)
        self.replies = 0  # turns handed to the agent
        self.pending: list[Key] | None = None  # the request being answered (claimed)
        self.answered = anyio.Event()  # set once no request is being answered
        self.answered.set()
        self.last_keys: list[Key] | None = None  # the request last answered
        self.last_reply: Any = None  # and what it was answered with (the gateway's), for a retry of it
        self.last_answer: Any = None  # the answer of the request last claimed (engine/agents/answer.py)
        self.waiting = False  # the env step waits for the agent's next request
        self.drive_ended: anyio.Event | None = None  # set when the gateway's drive of it ended (None: not its own)
        self.drive_scope: anyio.CancelScope | None = None  # the gateway's drive of it, to end it at once
        self._closed = False
        self._turn_ready = anyio.Event()
        self._next: anyio.abc.ObjectSendStream[list[dict[str, Any]] | None]
        self._next, self._requests = anyio.create_memory_object_stream[list[dict[str, Any]] | None](1)

    @property
    def ended(self) -> bool:
        return self.trajectory.is_ended

    def fits(self, asked: Asked) -> Fit:
        """Whether a request continues this chain now, repeats one of its requests, or why neither."""
        if asked.tools_key != self.tools_key:
            return Fit(cause=ForkCause.TOOLS_CHANGED)
        if self.pending is not None:  # the same request again while it is answered: the client's retry
            return Fit(repeat=True) if asked.keys == self.pending else Fit(cause=ForkCause.CONCURRENT)
        if asked.keys == self.last_keys:  # answered: a retry gets its reply, anything else is asked again
            delivered = self.last_answer is None or self.last_answer.delivered
            return Fit(repeat=True) if asked.retry or not delivered else Fit(cause=ForkCause.AGAIN)
        if self.ended:
            return Fit(cause=ForkCause.ENDED)
        if not self.waiting:
            return Fit(cause=ForkCause.CONCURRENT)
        return continues(self.keys, asked.keys)

    def claim(self, keys: list[Key]) -> None:
        """The chain answers this request now (called before any await, so no other request continues it)."""
        self.pending, self.answered = keys, anyio.Event()

    def release(self) -> None:
        self.pending = None
        self.answered.set()

    async def next_turn(self) -> Turn | None:
        """The model's next turn, once generated and handed over; None when the chain ended without one."""
        await self._turn_ready.wait()
        self._turn_ready = anyio.Event()
        turns = self.trajectory.turns
        if len(turns) > self.replies and turns[self.replies].num_generated:
            self.replies += 1
            return turns[self.replies - 1]
        return None

    def replied(self, message: dict[str, Any], key: Key) -> None:
        """The assistant message the agent was sent for the last turn."""
        self.history.append(message)
        self.keys.append(key)

    async def send(self, new: list[dict[str, Any]], keys: list[Key]) -> None:
        """The next request's messages past the history: the observation of the waiting env step."""
        self.history += new
        self.keys += keys
        self.waiting = False
        await self._next.send(new)

    async def end(self) -> None:
        """No more requests: the waiting env step (or the next one) ends the trajectory, env done."""
        if not self._closed:
            self._closed = True
            await self._next.aclose()

    def turn_ended(self) -> None:
        """The scheduler finished a turn (an env step began) or the whole trajectory: wake the request."""
        self._turn_ready.set()

    async def wait_for_request(self) -> list[dict[str, Any]] | None:
        self.waiting = True
        try:
            return await self._requests.receive()
        except anyio.EndOfStream:
            return None
        finally:
            self.waiting = False


class SessionEnv(AsyncInteractionEnv):
    """The env of a chain: a step hands the model's turn over and returns the agent's next messages. It only
    waits (the agent works elsewhere), so it holds no env slot; its step timeout is the agent's time between
    requests."""

    needs_env_slot = False
    restartable = False  # the agent saw every turn: too stale, the chain ends STALE rather than run again

    def __init__(self, chain: Chain):
        self.chain = chain

    async def astep(self, response_text: str) -> tuple[dict[str, Any], bool, dict[str, Any]]:
        self.chain.turn_ended()
        new = await self.chain.wait_for_request()
        if new is None:
            return {}, True, {}
        return {"messages": new}, False, {}

    def format_observation(self, observation: dict[str, Any]) -> list[dict[str, Any]]:
        return list(observation["messages"])


@dataclass
class Session:
    """An agent's session: its chains in the order they started, and the forks that started them. `key` is what
    its agent presents (as an API key) for the gateway to serve it."""

    id: str
    metadata: dict[str, Any] = field(default_factory=dict)
    key: str = field(default_factory=lambda: f"sk-turnstile-{secrets.token_urlsafe(24)}")
    chains: list[Chain] = field(default_factory=list)
    forks: dict[ForkCause, int] = field(default_factory=dict)
    calls: int = 0  # tool calls handed out so far (ids for calls the model wrote without one)
    closed: bool = False
    main: Trajectory | None = None  # the first chain's trajectory when its caller drives it (an agent env's)
    main_started: anyio.Event = field(default_factory=anyio.Event)  # the first request made the main chain
    last_request_at: float = field(default_factory=time.monotonic)  # when it was opened or last asked

    def route(self, asked: Asked) -> tuple[Chain | None, Fit]:
        """The chain a request continues or repeats (latest first) and its fit; else (None, the latest fit)."""
        latest: Fit | None = None
        for chain in reversed(self.chains):
            fit = chain.fits(asked)
            if fit.new is not None or fit.repeat:
                return chain, fit
            latest = latest or fit
        return None, latest or Fit()

    def start(self, asked: Asked, cause: ForkCause | None) -> Chain:
        """A new chain whose prompt is the request's messages (a fork of the session when `cause` says why); the
        first one is the `main` trajectory where the session has one (its env gives it the prompt)."""
        metadata = {"session_id": self.id, "chain": len(self.chains), **self.metadata}
        if asked.tools:
            metadata["tools"] = asked.tools
        if cause is not None:
            self.forks[cause] = self.forks.get(cause, 0) + 1
            metadata["fork_cause"] = str(cause)
        if self.main is not None and not self.chains:
            trajectory = self.main
            trajectory.metadata.update(metadata)
        else:
            trajectory = Trajectory(prompt=list(asked.messages), metadata=metadata, group_id=next(_ids))
            if self.main is not None:
                self.main.forks.append(trajectory)
        chain = Chain(self, trajectory, asked)
        self.chains.append(chain)
        return chain
