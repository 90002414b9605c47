"""Timeouts for many env calls at once, kept by one watcher instead of one timer each.

    deadlines = Deadlines()
    tg.start_soon(deadlines.watch)                   # once, in a task group that outlives the calls
    with deadlines.after(30.0) as scope:             # per call: a plain cancel scope, registered
        await env_call()
    if scope.cancelled_caught: ...                   # it ran past 30 s

A cancel scope with a deadline arms an event-loop timer on entry and disarms it on exit; with
thousands of env calls a second that is a real share of the engine's loop. Here each call enters a
cancel scope without a deadline and is filed by its deadline; the watcher sleeps until the earliest
one and cancels the scopes whose time is up. Calls with the same timeout end in the order they were
filed, so each timeout keeps its own insertion-ordered dict and the earliest deadline is its first
entry; a call that returns removes its entry at once. Until `watch` runs, `after` falls back to a
cancel scope with a deadline of its own.

Deadlines are on `time.monotonic()` (the watcher only ever sleeps for a difference of two readings), and
the scopes are made from the running backend's own cancel-scope class, looked up once by `watch`:
`anyio.CancelScope()` looks the backend up again on every call, a real share of an env call's cost.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from typing import Any

import anyio


class Deadlines:
    def __init__(self) -> None:
        self._filed: dict[float, dict[int, tuple[float, anyio.CancelScope]]] = {}  # timeout -> key -> entry
        self._keys = itertools.count()
        self._wake = anyio.Event()
        self._sleeping_until = math.inf
        self._scope_type: type[anyio.CancelScope] = anyio.CancelScope
        self.is_watching = False

    def after(self, timeout: float) -> contextlib.AbstractContextManager[anyio.CancelScope]:
        """A cancel scope cancelled once `timeout` seconds have passed."""
        if not self.is_watching:
            return anyio.move_on_after(timeout)
        return _Filed(self, timeout)

    async def watch(self) -> None:
        """Cancel each filed scope once its deadline passes; runs until cancelled."""
        self._scope_type = type(anyio.CancelScope())  # the backend's class: made directly from here on
        self.is_watching = True
        try:
            while True:
                now = time.monotonic()
                earliest = math.inf
                for filed in self._filed.values():
                    while filed:
                        key = next(iter(filed))
                        deadline, scope = filed[key]
                        if deadline > now:
                            earliest = min(earliest, deadline)
                            break
                        del filed[key]
                        scope.cancel()
                self._wake = anyio.Event()
                self._sleeping_until = earliest
                with anyio.move_on_after(earliest - now if earliest < math.inf else None):
                    await self._wake.wait()
        finally:
            self.is_watching = False
            self._sleeping_until = math.inf


class _Filed:
    """One call's cancel scope, filed under its deadline while the call runs."""

    __slots__ = ("deadlines", "timeout", "scope", "key", "filed")

    def __init__(self, deadlines: Deadlines, timeout: float):
        self.deadlines, self.timeout = deadlines, timeout

    def __enter__(self) -> anyio.CancelScope:
        d = self.deadlines
        deadline = time.monotonic() + self.timeout
        filed = d._filed.get(self.timeout)
        if filed is None:
            filed = d._filed[self.timeout] = {}
        self.filed, self.key = filed, next(d._keys)
        self.scope = d._scope_type().__enter__()
        filed[self.key] = (deadline, self.scope)
        if deadline < d._sleeping_until:
            d._wake.set()
        return self.scope

    def __exit__(self, *exc_info: Any) -> bool | None:
        self.filed.pop(self.key, None)
        return self.scope.__exit__(*exc_info)
