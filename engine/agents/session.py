"""A session: the trajectories one agent program's requests make, run by the engine's scheduler.

Each chain of a session is one Trajectory, driven by `Scheduler.drive` like any other, with a `SessionEnv` as
its env: the model's turn is generated under the scheduler's slots, priorities, retries and pauses; the env
step hands that turn to the request waiting for it and waits for the agent's next request, whose new messages
(tool results, a user message) are the observation, encoded by delta as any env's. The time between a reply
and the next request is the turn's env phase. A request that does not continue a chain (`history.continues`)
starts a new chain whose prompt is the request's messages: its turns are trained there, the shared ones once,
in the chain that sampled them.

    chain = session.start(messages, tools)          # a new chain; the caller drives chain.trajectory
    turn = await chain.next_turn()                   # the model's turn for this request (or the chain's end)
    chain.replied(reply_message)                     # what the agent was sent, to match its next request
    await chain.send(new_messages)                   # the next request's messages past the history
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import anyio

from engine.agents.history import Fit, ForkCause, continues, same
from engine.envs.base import AsyncInteractionEnv
from engine.trajectory import Trajectory, Turn

_ids = itertools.count()


class Chain:
    """One root-to-leaf chain of a session: its trajectory, the messages the agent has seen, and the hand-off
    between the request waiting for a turn and the env step waiting for the next request."""

    def __init__(self, session: Session, trajectory: Trajectory, messages: list[dict[str, Any]], tools: Any):
        self.session, self.trajectory, self.tools = session, trajectory, tools
        self.history: list[dict[str, Any]] = list(messages)  # as the agent sent and was sent them
        self.replies = 0  # turns handed to the agent
        self.last_request: list[dict[str, Any]] | None = None  # the messages of the request last answered
        self.last_reply: Any = None  # and what it was answered with (the gateway's), for a retry of it
        self.pending: list[dict[str, Any]] | None = None  # the messages of the request being answered
        self.answered = anyio.Event()  # set once no request is being answered
        self.answered.set()
        self.waiting = False  # the env step waits for the agent's next request
        self.lock = anyio.Lock()  # one request at a time on a chain
        self.drive_ended: anyio.Event | None = None  # set when the gateway's drive of it ended (None: not its own)
        self._closed = False
        self._turn_ready = anyio.Event()
        self._next: anyio.abc.ObjectSendStream[list[dict[str, Any]] | None]
        self._next, self._requests = anyio.create_memory_object_stream[list[dict[str, Any]] | None](1)

    @property
    def ended(self) -> bool:
        return self.trajectory.is_ended

    def fits(self, messages: list[dict[str, Any]], tools: Any) -> Fit:
        """Whether a request continues this chain now."""
        if tools != self.tools:
            return Fit(cause=ForkCause.TOOLS_CHANGED)
        if any(asked is not None and same(asked, messages) for asked in (self.pending, self.last_request)):
            return Fit(repeat=True)
        if self.ended:
            return Fit(cause=ForkCause.ENDED)
        if not self.waiting:
            return Fit(cause=ForkCause.CONCURRENT)
        return continues(self.history, messages)

    async def next_turn(self) -> Turn | None:
        """The model's next turn, once generated and handed over; None when the chain ended without one."""
        await self._turn_ready.wait()
        self._turn_ready = anyio.Event()
        turns = self.trajectory.turns
        if len(turns) > self.replies and turns[self.replies].num_generated:
            self.replies += 1
            return turns[self.replies - 1]
        return None

    def replied(self, message: dict[str, Any]) -> None:
        """The assistant message the agent was sent for the last turn."""
        self.history.append(message)

    async def send(self, new: list[dict[str, Any]]) -> None:
        """The next request's messages past the history: the observation of the waiting env step."""
        self.history += new
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
    """An agent's session: its chains in the order they started, and the forks that started them."""

    id: str
    metadata: dict[str, Any] = field(default_factory=dict)
    chains: list[Chain] = field(default_factory=list)
    forks: dict[ForkCause, int] = field(default_factory=dict)
    calls: int = 0  # tool calls handed out so far (ids for calls the model wrote without one)
    closed: bool = False
    main: Trajectory | None = None  # the first chain's trajectory when its caller drives it (an agent env's)
    main_started: anyio.Event = field(default_factory=anyio.Event)  # the first request made the main chain

    def route(self, messages: list[dict[str, Any]], tools: Any) -> tuple[Chain | None, Fit]:
        """The chain a request continues (latest first) and its fit; else (None, the latest chain's fit)."""
        latest: Fit | None = None
        for chain in reversed(self.chains):
            fit = chain.fits(messages, tools)
            if fit.new is not None or fit.repeat:
                return chain, fit
            latest = latest or fit
        return None, latest or Fit()

    def start(self, messages: list[dict[str, Any]], tools: Any, cause: ForkCause | None) -> Chain:
        """A new chain whose prompt is `messages` (a fork of the session when `cause` says why); the first one
        is the `main` trajectory where the session has one (its env gives it the prompt)."""
        metadata = {"session_id": self.id, "chain": len(self.chains), **self.metadata}
        if tools:
            metadata["tools"] = tools
        if cause is not None:
            self.forks[cause] = self.forks.get(cause, 0) + 1
            metadata["fork_cause"] = str(cause)
        if self.main is not None and not self.chains:
            trajectory = self.main
            trajectory.metadata.update(metadata)
        else:
            trajectory = Trajectory(prompt=list(messages), metadata=metadata, group_id=next(_ids))
            if self.main is not None:
                self.main.forks.append(trajectory)
        chain = Chain(self, trajectory, messages, tools)
        self.chains.append(chain)
        return chain
