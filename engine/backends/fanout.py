"""One call on several servers at once: each server's BackendError is collected by name, so a dead server is
reported rather than raised out of a task group as an ExceptionGroup; and one weight version from several."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

import anyio

from engine.errors import BackendError

log = logging.getLogger(__name__)
T = TypeVar("T")


async def gather(calls: Mapping[str, Callable[[], Awaitable[T]]]) -> tuple[dict[str, T], dict[str, BackendError]]:
    """Run every call concurrently; their results and their BackendErrors by name, both in the order of `calls`."""
    results: dict[str, T] = {}
    failures: dict[str, BackendError] = {}

    async def run(name: str, call: Callable[[], Awaitable[T]]) -> None:
        try:
            results[name] = await call()
        except BackendError as exc:
            failures[name] = exc

    async with anyio.create_task_group() as tg:
        for name, call in calls.items():
            tg.start_soon(run, name, call)
    return {n: results[n] for n in calls if n in results}, {n: failures[n] for n in calls if n in failures}


def describe(name: str, exc: BackendError) -> str:
    """The error's message, led by the server's name unless it names it already."""
    return exc.message if name in exc.message else f"{name}: {exc.message}"


def combined_error(what: str, failures: Mapping[str, BackendError], total: int) -> BackendError:
    """One error naming each failure, of the first failure's class."""
    detail = "; ".join(describe(name, exc) for name, exc in failures.items())
    first = next(iter(failures.values()))
    return BackendError(first.error_class, f"{what} failed on {len(failures)} of {total}: {detail}")


def log_failures(what: str, failures: Mapping[str, BackendError]) -> None:
    for name, exc in failures.items():
        log.warning("%s failed: %s", what, describe(name, exc))


def agreed_version(versions: Mapping[str, str | None]) -> str | None:
    """The weight version most servers report; on a tie, the one reported first. When they differ (a weight
    update under way, or one that failed somewhere) a warning names each server's version."""
    counts = Counter(versions.values())
    version = max(counts, key=counts.__getitem__)  # the first of the most common, in the order of `versions`
    if len(counts) > 1:
        each = ", ".join(f"{name}: {v!r}" for name, v in versions.items())
        log.warning("servers disagree on the weight version (%s); using %r", each, version)
    return version
