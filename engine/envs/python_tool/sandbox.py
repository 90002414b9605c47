"""Run a piece of Python in a separate, limited process, one per call, and report what it did.

    result = await run_python("print(6 * 7)", SandboxLimits(wall_seconds=5))
    result.observation()        # "exit status 0\n--- stdout ---\n42"

Each call gets a fresh scratch directory (its working directory and $HOME, removed afterwards), an
environment of a few fixed variables (nothing of the parent's), `python -I -S` (no user site, no
site-packages, no PYTHON* variables), and its own process group, killed whole when the wall-clock limit
passes or the output limit is exceeded. What else holds it depends on the kernel, probed once
(`isolation()`), and logged once where something is not enforced:

- namespaces (`unshare`, where unprivileged user namespaces are allowed): a network namespace with no
  interface but a loopback that is down (no network at all), a PID namespace (every process the code
  starts dies with it, even one that left the process group) with its own /proc, and process counts
  kept apart from the rest of the machine's;
- Landlock (Linux 5.13+, where enabled): writes only beneath the scratch directory, no TCP (ABI 4+),
  no signals to or reading the memory and environment of processes outside the sandbox;
- resource limits always (child.py): CPU seconds, address space, open files, processes, file size.

Without namespaces the process limit counts all of this user's processes (so it is set above their
number now, and root is exempt from it) and there is no network isolation but Landlock's TCP rule;
without Landlock the file system is only as closed as the user's permissions make it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import anyio
from anyio.abc import ByteReceiveStream, Process
from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger(__name__)

CHILD = Path(__file__).with_name("child.py")
UNSHARE = (
    "unshare",
    "--user",
    "--map-root-user",
    "--net",
    "--pid",
    "--fork",
    "--kill-child",
    "--mount",
    "--mount-proc",
)
_MIB = 1 << 20
_CHUNK = 1 << 16


class SandboxLimits(BaseModel):
    """What one run of code may use. A prompt row may set any of them in `metadata["sandbox"]`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    wall_seconds: float = Field(10.0, gt=0, le=600)
    """Wall-clock seconds before the whole process group is killed."""
    cpu_seconds: int = Field(5, gt=0, le=600)
    """CPU seconds per process (RLIMIT_CPU): SIGXCPU, then SIGKILL a second later."""
    memory_mib: int = Field(512, ge=64, le=65536)
    """Address space per process (RLIMIT_AS), in MiB: past it, allocations fail (MemoryError)."""
    open_files: int = Field(64, ge=16, le=65536)
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    processes: int = Field(16, ge=1, le=4096)
    """Processes and threads the code may run at once (RLIMIT_NPROC)."""
    file_mib: int = Field(16, ge=1, le=65536)
    """Largest file the code may write (RLIMIT_FSIZE), in MiB."""
    output_bytes: int = Field(_MIB, ge=1024, le=1 << 30)
    """stdout and stderr together; past it, the process group is killed."""
    shown_chars: int = Field(2000, ge=100, le=1 << 20)
    """Characters of each stream kept in the observation; the middle of a longer one is cut, with a marker."""


class Limit(StrEnum):
    """A limit the code ran into."""

    WALL_TIME = "wall_time"
    CPU_TIME = "cpu_time"
    MEMORY = "memory"
    OUTPUT = "output"
    PROCESSES = "processes"
    FILE_SIZE = "file_size"


@dataclass(frozen=True, slots=True)
class Isolation:
    """What this machine lets the sandbox enforce, besides resource limits and the process group."""

    namespaces: bool  # unshare: network, PID, mount and user namespaces
    landlock_abi: int  # 0: no Landlock
    python: str  # the interpreter the code runs on
    user: int | None = None  # run as this user (root's sandbox runs as nobody); None: as this process's user

    def not_enforced(self) -> list[str]:
        missing = []
        if os.geteuid() == 0 and self.user is None:
            missing.append("the sandbox runs as root: the process limit does not bind (no interpreter runs as nobody)")
        if not self.namespaces:
            missing.append("no network namespace, no PID namespace (unprivileged user namespaces are not allowed)")
            if self.landlock_abi < 4:
                missing.append("no network isolation at all")
            else:
                missing.append("network: only TCP connect and bind are refused (Landlock); UDP is not")
        if self.landlock_abi == 0:
            missing.append("no Landlock: the code may write wherever this user may")
        return missing


@functools.cache
def isolation() -> Isolation:
    """Probed once per process: who runs the code on which interpreter, whether `unshare` may make
    namespaces, and Landlock's ABI version. What is not enforced is logged, once."""
    user, python = _sandbox_user()
    namespaces = shutil.which(UNSHARE[0]) is not None and _runs([*UNSHARE, python, *_PROBE], user)
    found = Isolation(namespaces, _landlock_abi(), python, user)
    for what in found.not_enforced():
        log.warning("python sandbox: %s", what)
    return found


_PROBE = ("-I", "-S", "-c", "import ctypes, json, resource")


def _sandbox_user() -> tuple[int | None, str]:
    """Root runs the code as nobody, on an interpreter nobody may run (this one, or the system's):
    the kernel does not hold root to the process limit, nor to file permissions."""
    if os.geteuid() != 0:
        return None, sys.executable
    nobody = _nobody()
    for python in dict.fromkeys([sys.executable, shutil.which("python3", path="/usr/bin:/bin") or ""]):
        if python and _runs([python, *_PROBE], nobody):
            return nobody, python
    return None, sys.executable


def _nobody() -> int:
    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        return 65534


def _runs(command: list[str], user: int | None) -> bool:
    as_user = {"user": user, "group": user, "extra_groups": []} if user is not None else {}
    try:
        return subprocess.run(command, capture_output=True, timeout=10, cwd="/", **as_user).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _landlock_abi() -> int:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        version = libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))  # LANDLOCK_CREATE_RULESET_VERSION
    except (OSError, AttributeError):
        return 0
    return max(int(version), 0)


@dataclass(frozen=True, slots=True)
class SandboxResult:
    """What one run did: its exit status (or the signal that ended it), its output and the limits it hit."""

    exit_code: int | None  # None: ended by a signal
    signal: str | None
    stdout: str  # as shown: a long stream's middle replaced by a marker
    stderr: str
    stdout_bytes: int  # written in all
    stderr_bytes: int
    limits_hit: tuple[Limit, ...]
    seconds: float
    limits: SandboxLimits

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.limits_hit

    def observation(self) -> str:
        """The result as the model reads it: status, limits hit, then each stream, cut with a marker."""
        status = f"exit status {self.exit_code}" if self.exit_code is not None else f"killed by {self.signal}"
        lines = [status, *(_LIMIT_TEXT[limit].format(limits=self.limits) for limit in self.limits_hit)]
        for name, text, total in (
            ("stdout", self.stdout, self.stdout_bytes),
            ("stderr", self.stderr, self.stderr_bytes),
        ):
            if total:
                lines += [f"--- {name} ---", text.rstrip("\n")]
        if not (self.stdout_bytes or self.stderr_bytes):
            lines.append("(no output)")
        return "\n".join(lines)


_LIMIT_TEXT = {
    Limit.WALL_TIME: "killed: the wall-clock limit of {limits.wall_seconds:g} s was reached",
    Limit.CPU_TIME: "killed: the CPU time limit of {limits.cpu_seconds} s was reached",
    Limit.MEMORY: "the memory limit of {limits.memory_mib} MiB was reached (MemoryError)",
    Limit.OUTPUT: "killed: the output limit of {limits.output_bytes} bytes was exceeded",
    Limit.PROCESSES: "the process limit of {limits.processes} was reached (a fork or thread start failed)",
    Limit.FILE_SIZE: "the file size limit of {limits.file_mib} MiB was reached",
}


async def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `code` in a fresh sandboxed process and wait for it (at most `limits.wall_seconds`)."""
    limits = limits or SandboxLimits()
    found = isolation()
    scratch = Path(tempfile.mkdtemp(prefix="turnstile-sandbox-"))
    try:
        (scratch / "main.py").write_text(code, encoding="utf-8")
        if found.user is not None:
            os.chown(scratch, found.user, found.user)
        status_read, status_write = os.pipe()
        try:
            command = _command(limits, found, status_write)
            return await _run(command, scratch, limits, found.user, (status_read, status_write))
        finally:
            os.close(status_read)
    finally:
        await anyio.to_thread.run_sync(_remove, scratch)


def _command(limits: SandboxLimits, found: Isolation, status_fd: int) -> list[str]:
    if found.namespaces:
        processes = limits.processes
    else:
        processes = _user_processes(os.getuid() if found.user is None else found.user) + limits.processes
    config = {
        "status_fd": status_fd,
        "landlock_abi": found.landlock_abi,
        "limits": {
            "cpu_seconds": limits.cpu_seconds,
            "memory_bytes": limits.memory_mib * _MIB,
            "open_files": limits.open_files,
            "processes": processes,
            "file_bytes": limits.file_mib * _MIB,
        },
    }
    python = [found.python, "-I", "-S", "-c", _child_source(), json.dumps(config)]
    return [*UNSHARE, *python] if found.namespaces else python


@functools.cache
def _child_source() -> str:
    return CHILD.read_text(encoding="utf-8")


def _environment(scratch: Path) -> dict[str, str]:
    """The whole environment of the code: nothing of the parent's."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(scratch), "TMPDIR": str(scratch), "LANG": "C.UTF-8"}


async def _run(
    command: list[str], scratch: Path, limits: SandboxLimits, user: int | None, status: tuple[int, int]
) -> SandboxResult:
    """Start the process, collect its output, kill its group when it ends or a limit passes, and read the
    status its supervisor wrote (none: the supervisor itself was killed)."""
    started = time.monotonic()
    as_user = {"user": user, "group": user, "extra_groups": []} if user is not None else {}
    try:
        process = await anyio.open_process(
            command,
            stdin=subprocess.DEVNULL,
            cwd=scratch,
            env=_environment(scratch),
            start_new_session=True,
            pass_fds=(status[1],),
            **as_user,
        )
    finally:
        os.close(status[1])
    output = _Output(limits.output_bytes, keep=4 * limits.shown_chars)
    hit: list[Limit] = []
    try:
        with anyio.move_on_after(limits.wall_seconds) as timer:
            async with anyio.create_task_group() as group:
                group.start_soon(output.read, process.stdout, "stdout", process)
                group.start_soon(output.read, process.stderr, "stderr", process)
                await process.wait()
                _kill_group(process)  # what the code left running in the background goes with it
        if timer.cancelled_caught:
            hit.append(Limit.WALL_TIME)
    finally:
        _kill_group(process)
        with anyio.move_on_after(5, shield=True):
            await process.wait()
    if output.exceeded:
        hit.append(Limit.OUTPUT)
    return _result(_exit_code(status[0]), output, hit, time.monotonic() - started, limits)


def _exit_code(status_read: int) -> int | None:
    """The worker's exit status (negative: the signal that ended it), as its supervisor wrote it; None
    when the supervisor was killed before it could (the wall-clock or output limit)."""
    os.set_blocking(status_read, False)
    try:
        return json.loads(os.read(status_read, 4096) or b"null")["exit_code"]
    except (BlockingIOError, ValueError, TypeError, KeyError):
        return None


class _Stream:
    """One output stream as it arrives: its first and its last `keep` bytes, and a count of them all."""

    def __init__(self, keep: int):
        self.keep = keep
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.keep - len(self.head)
        self.head += chunk[:room] if room > 0 else b""
        if room < len(chunk):
            self.tail = (self.tail + chunk[max(room, 0) :])[-self.keep :]

    def text(self, chars: int) -> str:
        """At most about `chars` characters: head and tail, the middle replaced by a marker."""
        head = self.head.decode("utf-8", errors="replace")
        if not self.tail and len(head) <= chars:
            return head
        tail = (self.head + self.tail)[-self.keep :].decode("utf-8", errors="replace")
        head, tail = head[: chars // 2], tail[-(chars // 2) :]
        hidden = self.total - len(head.encode()) - len(tail.encode())
        return f"{head}\n[... {hidden} bytes not shown ...]\n{tail}"

    def __contains__(self, marker: bytes) -> bool:
        return marker in self.head or marker in self.tail


class _Output:
    """stdout and stderr as they arrive; the process group is killed once the two together pass `limit`."""

    def __init__(self, limit: int, keep: int):
        self.limit = limit
        self.streams = {"stdout": _Stream(keep), "stderr": _Stream(keep)}
        self.exceeded = False

    async def read(self, stream: ByteReceiveStream | None, name: str, process: Process) -> None:
        if stream is None:
            return
        async for chunk in stream:
            self.streams[name].add(chunk)
            if not self.exceeded and sum(s.total for s in self.streams.values()) > self.limit:
                self.exceeded = True
                _kill_group(process)


def _result(
    code: int | None, output: _Output, hit: list[Limit], seconds: float, limits: SandboxLimits
) -> SandboxResult:
    if code is None:  # killed from outside, with its supervisor
        code = -signal.SIGKILL
    number = -code if code < 0 else None
    stdout, stderr = output.streams["stdout"], output.streams["stderr"]
    if number in (signal.SIGXCPU, signal.SIGKILL) and Limit.WALL_TIME not in hit and Limit.OUTPUT not in hit:
        hit.append(Limit.CPU_TIME)
    for marker, limit in _STDERR_MARKERS:
        if marker in stderr:
            hit.append(limit)
    return SandboxResult(
        exit_code=None if number is not None else code,
        signal=signal.Signals(number).name if number is not None else None,
        stdout=stdout.text(limits.shown_chars),
        stderr=stderr.text(limits.shown_chars),
        stdout_bytes=stdout.total,
        stderr_bytes=stderr.total,
        limits_hit=tuple(dict.fromkeys(hit)),
        seconds=seconds,
        limits=limits,
    )


_STDERR_MARKERS = (  # how Python reports a limit it ran into
    (b"MemoryError", Limit.MEMORY),
    (b"Resource temporarily unavailable", Limit.PROCESSES),
    (b"File too large", Limit.FILE_SIZE),
)


def _kill_group(process: Process) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


def _user_processes(uid: int) -> int:
    """The user's processes now (RLIMIT_NPROC counts them all when there is no user namespace)."""
    count = 0
    for entry in Path("/proc").iterdir():
        try:
            count += entry.name.isdigit() and entry.stat().st_uid == uid
        except OSError:
            continue
    return count


def _remove(scratch: Path) -> None:
    """Remove the scratch directory, whatever permissions the code left on it."""

    def unlock(function: object, path: str, _: object) -> None:
        os.chmod(os.path.dirname(path), 0o700)
        if os.path.isdir(path) and not os.path.islink(path):
            os.chmod(path, 0o700)
            shutil.rmtree(path, onerror=unlock)
        else:
            os.unlink(path)

    shutil.rmtree(scratch, onerror=unlock)
