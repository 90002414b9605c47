"""One judge per settings per event loop, for callers that are plain functions: slime's `--custom-rm-path`
function and the judge env's `build_env` have no place of their own to keep a client.

    judge = shared_judge(JudgeSettings.from_sources(args))     # on the loop that will use it

Sharing is what makes batching work there: every trajectory's reward goes through the same judge. A
judge belongs to one loop (its connection pool and events do), so each loop gets its own; judges of
loops that have closed are dropped. The local model is loaded once per process, whatever the loop.
"""

from __future__ import annotations

import threading

from anyio.lowlevel import EventLoopToken, current_token

from engine.envs.judge.client import Judge
from engine.envs.judge.settings import JudgeSettings
from engine.envs.judge.transports import LocalModelHost


class JudgeRegistry:
    def __init__(self) -> None:
        self._judges: dict[tuple[EventLoopToken, str], Judge] = {}
        self._hosts: dict[str, LocalModelHost] = {}
        self._lock = threading.Lock()

    def judge(self, settings: JudgeSettings) -> Judge:
        """The judge for `settings` on the running event loop (made on first use)."""
        key = (current_token(), settings.key)
        with self._lock:
            self._drop_closed_loops()
            judge = self._judges.get(key)
            if judge is None:
                host = None if settings.url else self._host(settings.local_model)
                judge = self._judges[key] = Judge(settings, local_host=host)
            return judge

    def _host(self, name: str) -> LocalModelHost:
        host = self._hosts.get(name)
        if host is None:
            host = self._hosts[name] = LocalModelHost(name)
        return host

    def _drop_closed_loops(self) -> None:
        for key in [key for key in self._judges if _is_closed(key[0])]:
            del self._judges[key]


def _is_closed(token: EventLoopToken) -> bool:
    is_closed = getattr(token.native_token, "is_closed", None)
    return bool(is_closed()) if callable(is_closed) else False


SHARED_JUDGES = JudgeRegistry()


def shared_judge(settings: JudgeSettings) -> Judge:
    return SHARED_JUDGES.judge(settings)
