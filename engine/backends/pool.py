"""Several servers as one backend, so a retried request can go to another server.

    pool = BackendPool([SGLangBackend(url) for url in urls])

Each request goes to the server with the fewest requests in flight, passing over servers that
failed with a retryable error in the last `cooldown_s` seconds (unless all have). A retry after a
connection error or a 5xx therefore lands elsewhere. A session (`session_id`) stays on the server its
first request went to while that server is not cooling down, so its turns reuse that server's prefix
cache; the pool remembers the last `max_sessions` sessions. Aborts go to the server that holds the
request; pause, resume and weight versions go to every server, and a server that fails is logged and
passed over (one error is raised only when all fail). In production, sglang-router in front of the
servers does the balancing; the pool is for a handful of servers without one.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from functools import partial
from typing import Any

import anyio

from engine.backends.base import Backend, GenerateResult, SamplingParams
from engine.backends.fanout import agreed_version, combined_error, gather, log_failures
from engine.errors import BackendError


class BackendPool:
    def __init__(
        self, backends: Sequence[Backend], *, cooldown_s: float = 5.0, max_sessions: int = 65_536, clock=time.monotonic
    ):
        if not backends:
            raise ValueError("a backend pool needs at least one backend")
        self.backends = list(backends)
        self.cooldown_s = cooldown_s
        self.max_sessions = max_sessions
        self._clock = clock
        self._inflight = [0] * len(self.backends)
        self._failed_at = [float("-inf")] * len(self.backends)
        self._where: dict[str, int] = {}  # rid -> the server running it
        self._sessions: OrderedDict[str, int] = OrderedDict()  # session -> its server, least recent first

    async def __aenter__(self) -> BackendPool:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _is_cooling(self, index: int, now: float) -> bool:
        return now - self._failed_at[index] < self.cooldown_s

    def pick(self, session_id: str | None = None) -> int:
        """The server for the next request: the session's while it is not cooling down, else the one with
        fewest in flight among those not cooling down after a failure."""
        now = self._clock()
        index = self._sessions.get(session_id) if session_id is not None else None
        if index is None or self._is_cooling(index, now):
            ready = [i for i in range(len(self.backends)) if not self._is_cooling(i, now)]
            index = min(ready or range(len(self.backends)), key=lambda i: (self._inflight[i], self._failed_at[i]))
        if session_id is not None:
            self._sessions[session_id] = index
            self._sessions.move_to_end(session_id)
            if len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        return index

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplingParams,
        image_data: Sequence[str] | None = None,
        *,
        rid: str | None = None,
        session_id: str | None = None,
    ) -> GenerateResult:
        index = self.pick(session_id)
        self._inflight[index] += 1
        if rid is not None:
            self._where[rid] = index
        try:
            backend = self.backends[index]
            return await backend.generate(input_ids, sampling_params, image_data, rid=rid, session_id=session_id)
        except BackendError as exc:
            if exc.retryable:
                self._failed_at[index] = self._clock()
            raise
        finally:
            self._inflight[index] -= 1
            if rid is not None:
                self._where.pop(rid, None)

    async def abort(self, rid: str | None = None) -> None:
        if rid is not None and rid in self._where:
            await self.backends[self._where[rid]].abort(rid)
        else:
            await self._each("abort", rid)

    async def pause(self) -> None:
        await self._each("pause")

    async def resume(self) -> None:
        await self._each("resume")

    async def weight_version(self) -> str | None:
        """The version most servers report (see `fanout.agreed_version`); servers that fail are left out."""
        return agreed_version(await self._each("weight_version"))

    async def health(self) -> bool:
        """True when any server is healthy."""
        results = [False] * len(self.backends)

        async def check(i: int) -> None:
            results[i] = await self.backends[i].health()

        async with anyio.create_task_group() as tg:
            for i in range(len(self.backends)):
                tg.start_soon(check, i)
        return any(results)

    async def aclose(self) -> None:
        await self._each("aclose")

    async def _each(self, method: str, *args: object) -> dict[str, Any]:
        """`method` on every server at once, results by server. A server that fails is logged and left out;
        one BackendError, naming each failure, is raised only when every server failed."""
        calls = {f"server {i} ({b!r})": partial(getattr(b, method), *args) for i, b in enumerate(self.backends)}
        results, failures = await gather(calls)
        log_failures(f"BackendPool.{method}", failures)
        if failures and not results:
            raise combined_error(f"BackendPool.{method}", failures, len(self.backends))
        return results

    def statistics(self) -> list[dict[str, float]]:
        now = self._clock()
        return [
            {"inflight": self._inflight[i], "cooling_down": float(self._is_cooling(i, now))}
            for i in range(len(self.backends))
        ]
