"""Several servers as one backend, so a retried request can go to another server.

    pool = BackendPool([SGLangBackend(url) for url in urls])

Each request goes to the server with the fewest requests in flight, passing over servers that
failed with a retryable error in the last `cooldown_s` seconds (unless all have). A retry after a
connection error or a 5xx therefore lands elsewhere. Aborts go to the server that holds the request;
pause, resume and weight updates go to every server. In production, sglang-router in front of the
servers does the balancing; the pool is for a handful of servers without one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import anyio

from engine.backends.base import Backend, GenerateResult, SamplingParams
from engine.errors import BackendError


class BackendPool:
    def __init__(self, backends: Sequence[Backend], *, cooldown_s: float = 5.0, clock=time.monotonic):
        if not backends:
            raise ValueError("a backend pool needs at least one backend")
        self.backends = list(backends)
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._inflight = [0] * len(self.backends)
        self._failed_at = [float("-inf")] * len(self.backends)
        self._where: dict[str, int] = {}  # rid -> the server running it

    async def __aenter__(self) -> BackendPool:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def pick(self) -> int:
        """The server for the next request: fewest in flight among those not cooling down after a failure."""
        now = self._clock()
        ready = [i for i in range(len(self.backends)) if now - self._failed_at[i] >= self.cooldown_s]
        return min(ready or range(len(self.backends)), key=lambda i: (self._inflight[i], self._failed_at[i]))

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplingParams,
        image_data: Sequence[str] | None = None,
        *,
        rid: str | None = None,
    ) -> GenerateResult:
        index = self.pick()
        self._inflight[index] += 1
        if rid is not None:
            self._where[rid] = index
        try:
            return await self.backends[index].generate(input_ids, sampling_params, image_data, rid=rid)
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
        return await self.backends[0].weight_version()

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

    async def _each(self, method: str, *args: object) -> None:
        async with anyio.create_task_group() as tg:
            for backend in self.backends:
                tg.start_soon(getattr(backend, method), *args)

    def statistics(self) -> list[dict[str, float]]:
        now = self._clock()
        return [
            {"inflight": self._inflight[i], "cooling_down": float(now - self._failed_at[i] < self.cooldown_s)}
            for i in range(len(self.backends))
        ]
