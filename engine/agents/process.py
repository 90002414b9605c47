"""An agent program as a process: run to its end, and every process it started gone afterwards.

    result = await run_process(["my-agent", "--task", task], env={**os.environ, **run.environ()}, marker=run.id)

The program starts in a session (and process group) of its own, with `TURNSTILE_AGENT=<marker>` in its
environment, which its children inherit. When it exits, is cancelled (its deadline, the engine ending) or
its reader fails, every process of its group, every descendant still attached, and every process whose
environment carries the marker (one that left the group with `setsid` and was re-parented) is killed and
reaped. A process that both leaves the group and clears its environment escapes this; a container or a
sandbox the env starts is the env's to end (its `aclose`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import anyio
import psutil

MARKER = "TURNSTILE_AGENT"
OUTPUT_TAIL = 64 * 1024  # bytes of each stream kept (the end: where a crash says why)
KILL_WAIT_S = 5.0  # how long the killed processes are given to be reaped


@dataclass(frozen=True, slots=True)
class ProcessResult:
    returncode: int
    stdout: str  # the last OUTPUT_TAIL bytes of each, decoded
    stderr: str

    def said(self, most: int = 2000) -> str:
        """What the program said last, wherever it wrote it (a CLI that fails may write its error to stdout, as
        Claude Code's `-p` does): the end of each stream that holds anything."""
        said = [
            f"{name}: {text.strip()[-most:]!r}" for name, text in (("stderr", self.stderr), ("stdout", self.stdout))
        ]
        return "; ".join(line for line, text in zip(said, (self.stderr, self.stdout), strict=True) if text.strip()) or (
            "nothing on stdout or stderr"
        )


async def run_process(
    argv: Sequence[str],
    *,
    marker: str,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    stdin: bytes | None = None,
) -> ProcessResult:
    """Run `argv` to its end (its exit status is the caller's to judge), then end whatever it left running."""
    environ = {**(os.environ if env is None else env), MARKER: marker}
    process = await anyio.open_process(
        list(argv),
        env=environ,
        cwd=cwd,
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    tails = {"stdout": bytearray(), "stderr": bytearray()}
    ended = False
    try:
        async with anyio.create_task_group() as tasks:
            for name, stream in (("stdout", process.stdout), ("stderr", process.stderr)):
                tasks.start_soon(_drain, stream, tails[name])
            if process.stdin is not None:
                async with process.stdin:
                    await process.stdin.send(stdin or b"")
            await process.wait()
            # what it left running may hold its pipes open: once they are gone the reads end
            await anyio.to_thread.run_sync(kill_all, process.pid, marker)
            ended = True
    finally:
        with anyio.CancelScope(shield=True):
            if not ended:
                await anyio.to_thread.run_sync(kill_all, process.pid, marker)
            await process.aclose()
    return ProcessResult(process.returncode if process.returncode is not None else -9, *map(_text, tails.values()))


async def _drain(stream: anyio.abc.ByteReceiveStream | None, tail: bytearray) -> None:
    if stream is None:
        return
    async for chunk in stream:
        tail += chunk
        del tail[:-OUTPUT_TAIL]


def _text(tail: bytearray) -> str:
    return bytes(tail).decode("utf-8", errors="replace")


def kill_all(pid: int, marker: str) -> list[int]:
    """Kill the process `pid`, its process group, its descendants and every process marked `marker`, and reap
    them; the pids killed. Blocking (run it in a thread)."""
    found: dict[int, psutil.Process] = {}
    try:
        root = psutil.Process(pid)
        found[pid] = root
        found.update((child.pid, child) for child in root.children(recursive=True))
    except psutil.Error:
        pass
    with contextlib.suppress(ProcessLookupError, PermissionError, psutil.Error):  # gone already
        os.killpg(pid, signal.SIGKILL)  # the group is the pid's own (start_new_session)
    for process in psutil.process_iter():
        if process.pid in found or process.pid == os.getpid():
            continue
        try:
            if process.environ().get(MARKER) == marker:
                found[process.pid] = process
                found.update((child.pid, child) for child in process.children(recursive=True))
        except psutil.Error:
            continue  # gone, or not ours to read
    for process in found.values():
        with contextlib.suppress(ProcessLookupError, PermissionError, psutil.Error):  # gone already
            process.kill()
    psutil.wait_procs(list(found.values()), timeout=KILL_WAIT_S)
    return sorted(found)
