"""A wake-up that any number of waiters can wait on, and that none of them can miss.

    changed = Broadcast()
    while not condition():
        await changed.wait()        # in the waiters (any number, any task)
    changed.notify()                # where the condition may have changed: wakes every current waiter

A waiter that checks its condition and then waits cannot miss a `notify` in between: on one event
loop nothing runs between the check and `wait()` taking the current event, and `notify` sets that
event before it makes a new one for later waiters. (Replacing an event on each *wait*, instead, loses
the wake-up of every waiter but the last.)
"""

from __future__ import annotations

import anyio


class Broadcast:
    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = anyio.Event()

    def notify(self) -> None:
        """Wake every task waiting now (with none waiting, nothing to do)."""
        if self._event.statistics().tasks_waiting:
            self._event.set()
            self._event = anyio.Event()

    async def wait(self, timeout: float | None = None) -> None:
        """Until the next `notify` (or `timeout` seconds, when given)."""
        event = self._event
        with anyio.move_on_after(timeout):
            await event.wait()
