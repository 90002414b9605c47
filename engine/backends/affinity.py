"""Where a `BackendPool` sends each request: three placement policies over N servers.

A multi-turn trajectory re-sends its whole prefix every turn. On the server that served its last turn that prefix
is in the prefix cache (SGLang's radix cache) and only the new tokens are prefilled; anywhere else all of it is
prefilled again. Placement therefore trades cache reuse against load balance:

  round_robin      each request to the next server: even load, almost no cache reuse across turns
  consistent_hash  a session to the server its id hashes to on a ring (160 points per server), as
                   sglang-router's `consistent_hashing` policy does: full reuse, but load is left to chance,
                   and long sessions pile up on some servers while others idle
  affinity         (the default) a session stays on its server while that server is not overloaded. A new
                   session goes to the server that is home to the fewest live sessions (then by load): a
                   session's turns come back after each env step, so the sessions a server holds, not the
                   requests it runs at this instant, are its load to come. A session whose server is
                   overloaded or cooling down after a failure goes to the least loaded server. A move costs a
                   re-prefill of the session's prefix, so a server counts as overloaded only past a margin: its
                   load above `(1 + move_margin) x the mean load of the ready servers + move_slack_tokens`.
                   A session is live from its first request until `end(session_id)` (the engine calls the
                   pool's `end_session` when a trajectory ends) or until it is the least recent of more than
                   `max_sessions`.

Load is what the pool has in flight on each server: prompt tokens (the KV cache those requests hold, which is
what runs out on a server holding long sessions), then requests, as a tie-break. A server that other clients also
use can add what it reports (SGLang 0.5.x's `GET /v1/loads`: requests, tokens in use) through `ServerLoad.reported_*`;
the larger of the two counts.

    placement = AffinityPlacement(num_servers=4)
    index = placement.place("trajectory-7", loads)    # loads: one ServerLoad per server
"""

from __future__ import annotations

import hashlib
import itertools
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

PolicyName = Literal["round_robin", "consistent_hash", "affinity"]
POLICIES: tuple[PolicyName, ...] = ("round_robin", "consistent_hash", "affinity")
RING_POINTS = 160  # points per server on the consistent-hash ring


@dataclass(frozen=True, slots=True)
class ServerLoad:
    """One server's load as the pool sees it: its own requests in flight, and what the server reports."""

    num_requests: int = 0
    num_tokens: int = 0  # prompt tokens of the pool's requests in flight there
    is_ready: bool = True  # not cooling down after a failure
    reported_requests: int = 0  # from the server's load endpoint (other clients' requests included)
    reported_tokens: int = 0
    last_failed_at: float = float("-inf")

    @property
    def tokens(self) -> int:
        return max(self.num_tokens, self.reported_tokens)

    @property
    def requests(self) -> int:
        return max(self.num_requests, self.reported_requests)


def least_loaded(loads: Sequence[ServerLoad], residents: Sequence[int] | None = None) -> int:
    """The ready server home to the fewest `residents` (live sessions, where given), then with the fewest tokens in
    flight, then fewest requests, then the longest since a failure (among all servers when none is ready)."""
    ready = [i for i, load in enumerate(loads) if load.is_ready] or range(len(loads))
    held = residents if residents is not None else [0] * len(loads)
    return min(ready, key=lambda i: (held[i], loads[i].tokens, loads[i].requests, loads[i].last_failed_at))


class Placement(Protocol):
    """Where each request goes. A placement that keeps sessions may also have `end(session_id)`: the session
    sends no more requests (its trajectory ended); `BackendPool.end_session` calls it where it exists."""

    name: PolicyName

    def place(self, session_id: str | None, loads: Sequence[ServerLoad]) -> int:
        """The server (an index into `loads`) for a request of `session_id` (None: no session)."""
        ...

    def statistics(self) -> dict[str, int]: ...


class RoundRobinPlacement:
    """Each request to the next ready server in turn."""

    name: PolicyName = "round_robin"

    def __init__(self, num_servers: int):
        self._next = itertools.cycle(range(num_servers))
        self.num_servers = num_servers

    def place(self, session_id: str | None, loads: Sequence[ServerLoad]) -> int:
        for _ in range(self.num_servers):
            index = next(self._next)
            if loads[index].is_ready:
                return index
        return least_loaded(loads)

    def statistics(self) -> dict[str, int]:
        return {}


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


class ConsistentHashPlacement:
    """A session to the first ready server clockwise of its id's point on a hash ring; a request without a session
    goes round robin. A session moves only when its server is not ready, as sglang-router's policy moves a key only
    when its worker leaves or turns unhealthy."""

    name: PolicyName = "consistent_hash"

    def __init__(self, num_servers: int, points_per_server: int = RING_POINTS):
        ring = sorted((_point(f"server-{i}-{p}"), i) for i in range(num_servers) for p in range(points_per_server))
        self._points = [point for point, _ in ring]
        self._servers = [server for _, server in ring]
        self._no_session = RoundRobinPlacement(num_servers)

    def place(self, session_id: str | None, loads: Sequence[ServerLoad]) -> int:
        if session_id is None:
            return self._no_session.place(None, loads)
        start = bisect_right(self._points, _point(session_id))
        for step in range(len(self._points)):
            index = self._servers[(start + step) % len(self._points)]
            if loads[index].is_ready:
                return index
        return least_loaded(loads)

    def statistics(self) -> dict[str, int]:
        return {}


class AffinityPlacement:
    """Sessions stay on their server unless it is overloaded past a margin; new ones go to the server home to the
    fewest live sessions. See the module docstring. The last `max_sessions` sessions are remembered."""

    name: PolicyName = "affinity"

    def __init__(
        self, num_servers: int, *, move_margin: float = 0.25, move_slack_tokens: int = 2048, max_sessions: int = 65_536
    ):
        if move_margin < 0 or move_slack_tokens < 0:
            raise ValueError(f"move_margin and move_slack_tokens must be >= 0, got {move_margin}, {move_slack_tokens}")
        self.num_servers = num_servers
        self.move_margin = move_margin
        self.move_slack_tokens = move_slack_tokens
        self.max_sessions = max_sessions
        self.sessions: OrderedDict[str, int] = OrderedDict()  # live session -> its server, least recent first
        self.residents = [0] * num_servers  # live sessions whose server each is
        self.num_placed = self.num_stayed = self.num_moved = 0

    def is_overloaded(self, index: int, loads: Sequence[ServerLoad]) -> bool:
        """Whether server `index` holds more than the margin above the mean of the ready servers."""
        ready = [load.tokens for load in loads if load.is_ready]
        mean = sum(ready) / len(ready) if ready else 0.0
        return loads[index].tokens > (1 + self.move_margin) * mean + self.move_slack_tokens

    def place(self, session_id: str | None, loads: Sequence[ServerLoad]) -> int:
        home = self.sessions.get(session_id) if session_id is not None else None
        if home is None:
            self.num_placed += 1
            index = least_loaded(loads, self.residents if session_id is not None else None)
        elif loads[home].is_ready and not self.is_overloaded(home, loads):
            self.num_stayed += 1
            index = home
        else:
            index = least_loaded(loads)
            self.num_moved += index != home
        if session_id is not None:
            self._remember(session_id, home, index)
        return index

    def end(self, session_id: str) -> None:
        home = self.sessions.pop(session_id, None)
        if home is not None:
            self.residents[home] -= 1

    def _remember(self, session_id: str, home: int | None, index: int) -> None:
        if home != index:
            if home is not None:
                self.residents[home] -= 1
            self.residents[index] += 1
        self.sessions[session_id] = index
        self.sessions.move_to_end(session_id)
        if len(self.sessions) > self.max_sessions:
            _, oldest = self.sessions.popitem(last=False)
            self.residents[oldest] -= 1

    def statistics(self) -> dict[str, int]:
        return {"num_placed": self.num_placed, "num_stayed": self.num_stayed, "num_moved": self.num_moved}


def make_placement(
    policy: PolicyName, num_servers: int, *, move_margin: float = 0.25, move_slack_tokens: int = 2048,
    max_sessions: int = 65_536,
) -> Placement:  # fmt: skip
    """The placement named `policy`; ValueError naming the known ones otherwise."""
    if policy == "round_robin":
        return RoundRobinPlacement(num_servers)
    if policy == "consistent_hash":
        return ConsistentHashPlacement(num_servers)
    if policy == "affinity":
        return AffinityPlacement(
            num_servers, move_margin=move_margin, move_slack_tokens=move_slack_tokens, max_sessions=max_sessions
        )
    raise ValueError(f"unknown placement policy {policy!r}; known: {', '.join(POLICIES)}")
