"""Several servers as one backend, so a retried request can go to another server.

    pool = BackendPool([SGLangBackend(url) for url in urls])

Which server a request goes to is the `policy`'s choice (engine/backends/affinity.py): "affinity" (the
default) keeps a session (`session_id`) on its server, so its turns reuse that server's prefix cache, until
that server holds more than a margin above the mean load, and places new sessions on the server home to the
fewest live sessions (`end_session`, which the engine calls as each trajectory ends, retires one);
"consistent_hash" and "round_robin" are there to compare with. Every policy passes over servers that
failed with a retryable error in the last `cooldown_s` seconds (unless all have), so a retry after a
connection error or a 5xx lands elsewhere. The pool tracks each server's load itself: requests and prompt
tokens in flight; given `load_poll_s`, it also reads what each server reports it runs (`GET /v1/loads`) that
often, so other clients' requests (other rollout shards, other jobs) count where it places. Aborts go to the
server that holds the request; pause, resume and weight versions go to every server, and a server that
fails is logged and passed over (one error is raised only when all fail). Given the servers' URLs (or a
router's workers), the pool places by load and cache, which sglang-router's session hashing does not;
benchmarks/scale/run.py compares the three policies over 64 simulated servers. The pool streams when every server
does (engine/backends/base.py): a token listener goes with the request to the server picked.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import anyio
import anyio.abc

from engine.backends.affinity import Placement, PolicyName, ServerLoad, least_loaded, make_placement
from engine.backends.base import (
    Backend,
    GenerateResult,
    ReportedLoad,
    SamplingParams,
    TokenListener,
    can_stream,
    takes_token_buffers,
)
from engine.backends.fanout import agreed_version, combined_error, gather, log_failures
from engine.errors import BackendError

log = logging.getLogger(__name__)


class BackendPool:
    def __init__(
        self,
        backends: Sequence[Backend],
        *,
        policy: PolicyName | Placement = "affinity",
        cooldown_s: float = 5.0,
        max_sessions: int = 65_536,
        move_margin: float = 0.25,
        move_slack_tokens: int = 2048,
        load_poll_s: float | None = None,
        clock=time.monotonic,
    ):
        if not backends:
            raise ValueError("a backend pool needs at least one backend")
        self.backends = list(backends)
        self.cooldown_s = cooldown_s
        self.placement = (
            make_placement(
                policy,
                len(self.backends),
                move_margin=move_margin,
                move_slack_tokens=move_slack_tokens,
                max_sessions=max_sessions,
            )  # fmt: skip
            if isinstance(policy, str)
            else policy
        )
        self._clock = clock
        self._inflight = [0] * len(self.backends)
        self._tokens = [0] * len(self.backends)  # prompt tokens in flight
        self._reported = [(0, 0)] * len(self.backends)  # (requests, tokens) each server last reported
        self._failed_at = [float("-inf")] * len(self.backends)
        self._where: dict[str, int] = {}  # rid -> the server running it
        self.load_poll_s = load_poll_s
        self._watching: anyio.abc.TaskGroup | None = None

    async def __aenter__(self) -> BackendPool:
        if self.load_poll_s is not None and all(hasattr(b, "reported_loads") for b in self.backends):
            self._watching = anyio.create_task_group()
            await self._watching.__aenter__()
            self._watching.start_soon(self._watch_loads, self.load_poll_s)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._watching is not None:
            self._watching.cancel_scope.cancel()
            await self._watching.__aexit__(None, None, None)
            self._watching = None
        await self.aclose()

    async def _watch_loads(self, interval_s: float) -> None:
        """Every `interval_s`: what each server reports it runs, into the placement's view (`note_reported_load`)."""
        while True:
            await self.read_reported_loads()
            await anyio.sleep(interval_s)

    async def read_reported_loads(self) -> None:
        """Each server's `GET /v1/loads` (requests running and waiting, KV tokens in use) noted as its reported load:
        other clients' requests count where the pool places, so several pools (rollout shards, other jobs) sharing
        the servers do not pile onto one. A server that fails or does not say keeps what it last said."""
        calls = {str(i): backend.reported_loads for i, backend in enumerate(self.backends)}
        reported, failures = await gather(calls)  # type: ignore[arg-type]
        for name, exc in failures.items():
            log.debug("server %s: its load could not be read: %s", name, exc)
        for name, loads in reported.items():
            if loads:
                running = sum(load.running + load.waiting for load in loads)
                self.note_reported_load(int(name), running, sum(load.used_tokens for load in loads))

    @property
    def streams(self) -> bool:
        """Whether every server streams (engine/backends/base.py), so a listener can go to whichever is picked."""
        return all(can_stream(backend) for backend in self.backends)

    @property
    def token_buffers(self) -> bool:
        """Whether every server reads `input_ids` as an integer buffer (engine/backends/base.py)."""
        return all(takes_token_buffers(backend) for backend in self.backends)

    def _is_cooling(self, index: int, now: float) -> bool:
        return now - self._failed_at[index] < self.cooldown_s

    def loads(self) -> list[ServerLoad]:
        """Each server's load now, as the placement sees it."""
        now = self._clock()
        return [
            ServerLoad(
                num_requests=self._inflight[i],
                num_tokens=self._tokens[i],
                is_ready=not self._is_cooling(i, now),
                reported_requests=self._reported[i][0],
                reported_tokens=self._reported[i][1],
                last_failed_at=self._failed_at[i],
            )  # fmt: skip
            for i in range(len(self.backends))
        ]

    def note_reported_load(self, index: int, num_requests: int, num_tokens: int) -> None:
        """What server `index` reports it holds (SGLang 0.5.x's `GET /v1/loads`: running and waiting requests,
        `num_used_tokens`; `reported_loads` reads it), other clients' requests included."""
        self._reported[index] = (num_requests, num_tokens)

    def end_session(self, session_id: str) -> None:
        """`session_id`'s trajectory ended: it no longer counts where it was placed (a placement without `end`,
        round robin and consistent hashing among them, keeps no sessions to forget)."""
        end = getattr(self.placement, "end", None)
        if end is not None:
            end(session_id)

    def pick(self, session_id: str | None = None) -> int:
        """The server for the next request of `session_id`, by the placement policy."""
        return self.placement.place(session_id, self.loads())

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplingParams,
        image_data: Sequence[str] | None = None,
        *,
        rid: str | None = None,
        session_id: str | None = None,
        on_tokens: TokenListener | None = None,
    ) -> GenerateResult:
        """On the server the placement picks; `on_tokens` (given only when the pool `streams`) goes with it."""
        index = self.pick(session_id)
        self._inflight[index] += 1
        self._tokens[index] += len(input_ids)
        if rid is not None:
            self._where[rid] = index
        try:
            backend = self.backends[index]
            streaming = {} if on_tokens is None else {"on_tokens": on_tokens}
            return await backend.generate(
                input_ids, sampling_params, image_data, rid=rid, session_id=session_id, **streaming
            )
        except BackendError as exc:
            if exc.retryable:
                self._failed_at[index] = self._clock()
            raise
        finally:
            self._inflight[index] -= 1
            self._tokens[index] -= len(input_ids)
            if rid is not None:
                self._where.pop(rid, None)

    async def read_turn(self, text: str, **names: Any) -> Any:
        """A turn's text as SGLang's parsers read it, on the least loaded server (it is a short CPU job there)."""
        return await self.backends[least_loaded(self.loads())].read_turn(text, **names)

    async def abort(self, rid: str | None = None) -> None:
        if rid is not None and rid in self._where:
            await self.backends[self._where[rid]].abort(rid)
        else:
            await self._each("abort", rid)

    async def pause(self) -> None:
        await self._each("pause")

    async def resume(self) -> None:
        await self._each("resume")

    async def reported_loads(self) -> list[ReportedLoad] | None:
        """What every server reports it runs (engine/backends/base.py); None unless every server can say. Servers
        that fail are left out."""
        if not all(hasattr(backend, "reported_loads") for backend in self.backends):
            return None
        reported = (await self._each("reported_loads")).values()
        if any(loads is None for loads in reported):
            return None
        return [load for loads in reported for load in loads]

    async def weight_version(self) -> str | None:
        """The version most servers report (see `fanout.agreed_version`); servers that fail are left out."""
        return agreed_version(await self._each("weight_version"))

    async def health(self) -> bool:
        """True when any server is healthy."""
        healthy, _ = await gather(self._calls("health"))
        return any(healthy.values())

    async def health_problem(self) -> str | None:
        """None when any server is healthy, else each server's problem."""
        problems, _ = await gather(self._calls("health_problem"))
        if any(problem is None for problem in problems.values()):
            return None
        return "; ".join(f"{server}: {problem}" for server, problem in problems.items())

    async def aclose(self) -> None:
        await self._each("aclose")

    async def _each(self, method: str, *args: object) -> dict[str, Any]:
        """`method` on every server at once, results by server. A server that fails is logged and left out;
        one BackendError, naming each failure, is raised only when every server failed."""
        results, failures = await gather(self._calls(method, *args))
        log_failures(f"BackendPool.{method}", failures)
        if failures and not results:
            raise combined_error(f"BackendPool.{method}", failures, len(self.backends))
        return results

    def _calls(self, method: str, *args: object) -> dict[str, Callable[[], Awaitable[Any]]]:
        """`method(*args)` of every server, by the server's name."""
        return {f"server {i} ({b!r})": partial(getattr(b, method), *args) for i, b in enumerate(self.backends)}

    def statistics(self) -> list[dict[str, float]]:
        now = self._clock()
        return [
            {
                "inflight": self._inflight[i],
                "inflight_tokens": self._tokens[i],
                "cooling_down": float(self._is_cooling(i, now)),
            }
            for i in range(len(self.backends))
        ]

    def placement_statistics(self) -> dict[str, int]:
        """The placement policy's counters (affinity: sessions placed, kept, moved)."""
        return self.placement.statistics()
