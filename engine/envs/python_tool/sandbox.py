"""Run a piece of Python in a separate, limited process, one per call, and report what it did.

    result = await run_python("print(6 * 7)", SandboxLimits(wall_seconds=5))
    result.observation()        # "exit status 0\n--- stdout ---\n42"

The code is hostile: a policy under RL pressure reads whatever it can reach (a task's checker, another
rollout's files, the trainer's secrets) and holds whatever it can. Each call runs, where the machine has it,
under bubblewrap (`bwrap`, Debian's `bubblewrap`), chosen once at start and logged (`isolation()`):

- a root of its own, read-only: the interpreter and its standard library, nothing else of the host (no
  project, no installed packages, no home, no /etc, none of the host's temporary directories); a private
  tmpfs as its working directory, `$HOME` and /tmp, holding the code as `main.py`;
- new user, PID, IPC, network, UTS, cgroup and mount namespaces: no network at all, no host Unix socket
  (none is mounted, abstract ones stay in the host's network namespace), SysV and POSIX shared memory gone
  with the call; no capabilities, no new user namespace (`--disable-userns`), and a seccomp filter
  (seccomp.py) refusing mount, unshare and setns, keyctl, io_uring, ptrace, BPF and the like;
- as root, a uid of its own per call (so not root's, nor another call's);
- one control group per call where this process may make one (cgroups.py): memory (anonymous, shared and
  tmpfs pages together) for the whole call, not per process, and on cgroup v2 the process count;
- inside, child.py: resource limits per process (CPU seconds, address space, open files, processes, file
  size). (The hand-built sandbox adds Landlock: bubblewrap's read-only root and namespaces hold what it
  held, and its ctypes import would double a call's start-up cost.)

Where bubblewrap is missing or cannot run, the hand-built sandbox stays as a fallback (`unshare`
namespaces where allowed, Landlock, resource limits, a scratch directory in the host's temporary
directory), and it says loudly, once, what it cannot hold. `TURNSTILE_SANDBOX=bubblewrap|unshare|none`
picks one at start (an unusable choice is an error).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

import anyio
from anyio.abc import ByteReceiveStream, Process
from pydantic import BaseModel, ConfigDict, Field

from engine.envs.python_tool.cgroups import CallGroup, CgroupParent, cgroup_parent
from engine.envs.python_tool.seccomp import refused_calls_filter

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
SCRATCH = "/sandbox"  # the working directory inside bubblewrap
_UID_BASE = 0x4000_0000  # root's calls run as a uid from here, a fresh one each call
_MIB = 1 << 20
_CHUNK = 1 << 16
_SUPERVISION = 1  # processes a call needs besides the code's: the supervisor (PID 1 of its namespace)


class SandboxLimits(BaseModel):
    """What one run of code may use. A prompt row may set any of them in `metadata["sandbox"]`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    wall_seconds: float = Field(10.0, gt=0, le=600)
    """Wall-clock seconds before the whole process group is killed."""
    cpu_seconds: int = Field(5, gt=0, le=600)
    """CPU seconds per process (RLIMIT_CPU): SIGXCPU, then SIGKILL a second later."""
    memory_mib: int = Field(512, ge=64, le=65536)
    """Memory of the whole call (its control group: anonymous, shared and tmpfs pages), and address space
    per process (RLIMIT_AS), in MiB: past it, allocations fail (MemoryError) or the kernel kills."""
    open_files: int = Field(64, ge=16, le=65536)
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    processes: int = Field(16, ge=1, le=4096)
    """Processes and threads the code may run at once (the call's control group, and RLIMIT_NPROC)."""
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


class Tool(StrEnum):
    """What holds each call."""

    BUBBLEWRAP = "bubblewrap"
    UNSHARE = "unshare"  # the hand-built fallback, with namespaces
    NONE = "none"  # the hand-built fallback, without namespaces


@dataclass(frozen=True, slots=True)
class Isolation:
    """What this machine lets the sandbox enforce, and how each call is started."""

    tool: Tool
    landlock_abi: int  # 0: no Landlock
    python: str  # the interpreter the code runs on
    user: int | None = None  # run as this user (root's hand-built sandbox runs as nobody); None: as this one
    uid_per_call: bool = False  # bubblewrap as root: a fresh uid each call
    cgroup: CgroupParent | None = None
    seccomp: bytes | None = field(default=None, repr=False)
    root: tuple[str, ...] = ()  # bubblewrap's arguments that build the read-only root

    @property
    def namespaces(self) -> bool:
        return self.tool is not Tool.NONE

    @property
    def own_user(self) -> bool:
        """The code does not run as root (so the process limit and file permissions bind)."""
        return os.geteuid() != 0 or self.user is not None or self.uid_per_call

    def not_enforced(self) -> list[str]:
        missing = []
        if self.tool is not Tool.BUBBLEWRAP:
            missing.append(
                "no bubblewrap: the code reads every file its user may (the project, its checkers, installed "
                "packages, other calls' scratch directories), reaches Unix sockets on paths, fills the host's "
                "temporary directory, and keeps SysV shared memory after the call"
            )
        if not self.own_user:
            missing.append("the sandbox runs as root: the process limit does not bind (no interpreter runs as nobody)")
        if not self.namespaces:
            missing.append("no network namespace, no PID namespace (unprivileged user namespaces are not allowed)")
            if self.landlock_abi < 4:
                missing.append("no network isolation at all")
            else:
                missing.append("network: only TCP connect and bind are refused (Landlock); UDP is not")
        if self.landlock_abi == 0 and self.tool is not Tool.BUBBLEWRAP:
            missing.append("no Landlock: the code may write wherever this user may")
        if self.cgroup is None:
            missing.append(
                "no control group may be made here: memory and processes are limited per process, not per call "
                "(children, shared memory and tmpfs files add up)"
            )
        if self.tool is Tool.BUBBLEWRAP and self.seccomp is None:
            missing.append("no seccomp filter (libseccomp not loaded): keyctl, io_uring and ptrace stay open")
        return missing

    def describe(self) -> str:
        held = [self.tool.value, f"python {self.python}"]
        held.append(self.cgroup.describe() if self.cgroup else "no cgroup")
        if self.tool is Tool.BUBBLEWRAP:
            held.append("seccomp" if self.seccomp else "no seccomp")
        else:
            held.append(f"landlock ABI {self.landlock_abi}")
        return ", ".join(held)


@functools.cache
def isolation() -> Isolation:
    """Probed once per process: which tool holds the calls, who runs the code on which interpreter, the
    control group and Landlock. What it is, and what is not enforced, is logged once."""
    wanted = os.environ.get("TURNSTILE_SANDBOX", "").strip().lower() or None
    if wanted is not None and wanted not in set(Tool):
        raise ValueError(f"TURNSTILE_SANDBOX={wanted!r}: expected one of {', '.join(Tool)}")
    found = probe(Tool(wanted) if wanted else None)
    log.info("python sandbox: %s", found.describe())
    for what in found.not_enforced():
        log.warning("python sandbox: %s", what)
    return found


def probe(tool: Tool | None = None) -> Isolation:
    """What `tool` (None: the best this machine runs) can hold here; an unusable `tool` is an error."""
    landlock, cgroup = _landlock_abi(), cgroup_parent()
    if tool in (None, Tool.BUBBLEWRAP):
        found = _bubblewrap(landlock, cgroup)
        if found is not None:
            return found
        if tool is Tool.BUBBLEWRAP:
            raise RuntimeError("python sandbox: bubblewrap was asked for, but `bwrap` is missing or cannot run here")
    user, python = _sandbox_user()
    if tool in (None, Tool.UNSHARE):
        if shutil.which(UNSHARE[0]) is not None and _runs([*UNSHARE, python, *_PROBE], user):
            return Isolation(Tool.UNSHARE, landlock, python, user)
        if tool is Tool.UNSHARE:
            raise RuntimeError("python sandbox: unshare was asked for, but user namespaces are not allowed here")
    return Isolation(Tool.NONE, landlock, python, user)


_PROBE = ("-I", "-S", "-c", "import ctypes, json, resource")


def _bubblewrap(landlock: int, cgroup: CgroupParent | None) -> Isolation | None:
    """bubblewrap on the first interpreter the sandbox's user can run in it: this one, or the system's."""
    if shutil.which("bwrap") is None:
        return None
    as_root = os.geteuid() == 0
    seccomp = refused_calls_filter()
    for python in _interpreters():
        found = Isolation(
            Tool.BUBBLEWRAP, landlock, python, uid_per_call=as_root, cgroup=cgroup, seccomp=seccomp,
            root=_root_arguments(python),
        )  # fmt: skip
        passed = {"seccomp": _memory_file("seccomp", seccomp)} if seccomp is not None else {}
        try:
            command = _bwrap_arguments(found, passed) + [python, *_PROBE]
            if _runs(command, _call_uid() if as_root else None, tuple(passed.values())):
                return found
        finally:
            for fd in passed.values():
                os.close(fd)
    return None


def _interpreters() -> list[str]:
    system = shutil.which("python3", path="/usr/bin:/bin") or ""
    return [p for p in dict.fromkeys([os.path.realpath(sys.executable), system]) if p]


def _root_arguments(python: str) -> tuple[str, ...]:
    """The read-only root: /usr and the top-level links into it (or the directories themselves), the
    interpreter's prefix where it lies elsewhere, and a tmpfs over every directory of installed packages."""
    arguments: list[str] = []
    for name in ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = Path("/", name)
        if path.is_symlink():
            arguments += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            arguments += ["--ro-bind", str(path), str(path)]
    prefix, packages = _prefix_and_packages(python)
    if not any(prefix == top or prefix.startswith(top + "/") for top in ("/usr", "/bin", "/lib", "/lib64")):
        arguments += ["--ro-bind", prefix, prefix]
    for directory in packages:
        arguments += ["--tmpfs", directory]
    return tuple(arguments)


def _prefix_and_packages(python: str) -> tuple[str, list[str]]:
    """The interpreter's prefix, and its directories of installed packages that exist."""
    script = (
        "import json, site, sys, sysconfig\n"
        "paths = [*site.getsitepackages(), sysconfig.get_path('purelib'), sysconfig.get_path('platlib')]\n"
        "paths += [p for p in sys.path if p.endswith(('site-packages', 'dist-packages'))]\n"
        "print(json.dumps([sys.base_prefix, paths]))"
    )
    try:
        done = subprocess.run([python, "-I", "-c", script], capture_output=True, text=True, timeout=30, check=True)
        prefix, paths = json.loads(done.stdout)
    except (OSError, subprocess.SubprocessError, ValueError):
        return os.path.dirname(os.path.dirname(python)), []
    real = dict.fromkeys(os.path.realpath(p) for p in paths)
    return os.path.realpath(prefix), sorted(p for p in real if os.path.isdir(p))


def _call_uid() -> int:
    return _UID_BASE + secrets.randbelow(1 << 24)


def _sandbox_user() -> tuple[int | None, str]:
    """Root runs the hand-built sandbox's code as nobody, on an interpreter nobody may run (this one, or
    the system's): the kernel does not hold root to the process limit, nor to file permissions."""
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


def _runs(command: list[str], user: int | None, pass_fds: tuple[int, ...] = ()) -> bool:
    as_user = {"user": user, "group": user, "extra_groups": []} if user is not None else {}
    try:
        done = subprocess.run(command, capture_output=True, timeout=10, cwd="/", pass_fds=pass_fds, **as_user)
        return done.returncode == 0
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
    Limit.MEMORY: "the memory limit of {limits.memory_mib} MiB was reached",
    Limit.OUTPUT: "killed: the output limit of {limits.output_bytes} bytes was exceeded",
    Limit.PROCESSES: "the process limit of {limits.processes} was reached (a fork or thread start failed)",
    Limit.FILE_SIZE: "the file size limit of {limits.file_mib} MiB was reached",
}


async def run_python(
    code: str, limits: SandboxLimits | None = None, *, found: Isolation | None = None
) -> SandboxResult:
    """Run `code` in a fresh sandboxed process and wait for it (at most `limits.wall_seconds`), under
    `found` (default: what `isolation()` found on this machine)."""
    limits = limits or SandboxLimits()
    found = found or isolation()
    if found.tool is Tool.BUBBLEWRAP:
        return await _run_bubblewrap(code, limits, found)
    return await _run_hand_built(code, limits, found)


def _child_config(
    limits: SandboxLimits, found: Isolation, status_fd: int, processes: int, go_fd: int | None = None
) -> str:
    return json.dumps(
        {
            "status_fd": status_fd,
            "go_fd": go_fd,
            "landlock_abi": 0 if found.tool is Tool.BUBBLEWRAP else found.landlock_abi,
            "limits": {
                "cpu_seconds": limits.cpu_seconds,
                "memory_bytes": limits.memory_mib * _MIB,
                "open_files": limits.open_files,
                "processes": processes,
                "file_bytes": limits.file_mib * _MIB,
            },
        }
    )


async def _run_bubblewrap(code: str, limits: SandboxLimits, found: Isolation) -> SandboxResult:
    """One call under bubblewrap: the code and the seccomp program go in as memory files. Where there is a
    control group, the sandbox's first process (the supervisor, PID 1 of its namespace) is moved into it
    while it starts, and forks the code's process only once it is in (`_Handshake`)."""
    group = None
    if found.cgroup is not None:
        group = CallGroup.create(
            found.cgroup, memory_bytes=limits.memory_mib * _MIB, processes=limits.processes + _SUPERVISION
        )
    owned: list[int] = []  # descriptors to close here: those not yet handed to `_run`, which closes its own

    def opened(fd: int) -> int:
        owned.append(fd)
        return fd

    try:
        status_read, status_write = map(opened, os.pipe())
        passed = {"code": opened(_memory_file("main.py", code.encode()))}
        if found.seccomp is not None:
            passed["seccomp"] = opened(_memory_file("seccomp", found.seccomp))
        handshake = go_read = None
        if group is not None:
            info_read, passed["info"] = map(opened, os.pipe())
            go_read, go_write = map(opened, os.pipe())
            handshake = _Handshake(info_read, go_write, group)
        config = _child_config(limits, found, status_write, limits.processes + _SUPERVISION, go_read)
        command = _bwrap_arguments(found, passed) + [found.python, "-I", "-S", "-c", _child_source(), config]
        env = _environment(SCRATCH)
        user = _call_uid() if found.uid_per_call else None
        handed = [status_write, *passed.values(), *([go_read] if go_read is not None else [])]
        owned[:] = [fd for fd in owned if fd not in handed]
        return await _run(command, "/", env, limits, user, status_read, handed, handshake, group)
    finally:
        for fd in owned:
            os.close(fd)
        if group is not None:
            await group.close()


def _bwrap_arguments(found: Isolation, passed: dict[str, int]) -> list[str]:
    """bubblewrap's command line up to the program: namespaces, the read-only root, the scratch tmpfs (the
    code as main.py, /tmp a link to it), /proc and a minimal /dev, and the descriptors in `passed`."""
    arguments = [
        "bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--as-pid-1",
        "--cap-drop", "ALL",
        "--hostname", "sandbox", *found.root, "--proc", "/proc", "--dev", "/dev", "--tmpfs", SCRATCH,
        "--symlink", SCRATCH, "/tmp", "--remount-ro", "/", "--chdir", SCRATCH,
    ]  # fmt: skip
    if "code" in passed:
        arguments += ["--file", str(passed["code"]), f"{SCRATCH}/main.py"]
    if "seccomp" in passed:
        arguments += ["--seccomp", str(passed["seccomp"])]
    if "info" in passed:
        arguments += ["--info-fd", str(passed["info"])]
    return arguments


def _memory_file(name: str, data: bytes) -> int:
    """A descriptor of an anonymous file holding `data`, read from its start (bubblewrap reads it whole)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


@dataclass(slots=True)
class _Handshake:
    """bubblewrap writes its first process's pid to `info`; that process (the supervisor, starting up
    meanwhile) waits for a byte on `go` before it forks the code's. In between, it joins the call's control
    group (in a thread: on cgroup v1 a move waits for an RCU grace period, milliseconds)."""

    info: int
    go: int
    group: CallGroup

    async def release(self) -> None:
        data = bytearray()
        os.set_blocking(self.info, False)
        with anyio.fail_after(30):
            while True:
                await anyio.wait_readable(self.info)
                try:
                    chunk = os.read(self.info, _CHUNK)
                except BlockingIOError:
                    continue
                if not chunk:
                    break
                data += chunk
        if data:  # nothing: bubblewrap failed before starting anything (its stderr says why)
            await anyio.to_thread.run_sync(self.group.join, json.loads(data)["child-pid"])
        with contextlib.suppress(BrokenPipeError):  # the supervisor is gone already
            os.write(self.go, b"1")


async def _run_hand_built(code: str, limits: SandboxLimits, found: Isolation) -> SandboxResult:
    """One call in the hand-built sandbox: a scratch directory in the host's temporary directory, and
    `unshare` namespaces where allowed."""
    scratch = Path(tempfile.mkdtemp(prefix="turnstile-sandbox-"))
    try:
        (scratch / "main.py").write_text(code, encoding="utf-8")
        if found.user is not None:
            os.chown(scratch, found.user, found.user)
        status_read, status_write = os.pipe()
        try:
            if found.namespaces:
                processes = limits.processes
            else:
                processes = _user_processes(os.getuid() if found.user is None else found.user) + limits.processes
            python = [found.python, "-I", "-S", "-c", _child_source()]
            python.append(_child_config(limits, found, status_write, processes))
            command = [*UNSHARE, *python] if found.namespaces else python
            env = _environment(str(scratch))
            return await _run(command, scratch, env, limits, found.user, status_read, [status_write])
        finally:
            os.close(status_read)
    finally:
        await anyio.to_thread.run_sync(_remove, scratch)


@functools.cache
def _child_source() -> str:
    return CHILD.read_text(encoding="utf-8")


def _environment(scratch: str) -> dict[str, str]:
    """The whole environment of the code: nothing of the parent's."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "PWD": scratch, "LANG": "C.UTF-8",
    }  # fmt: skip


async def _run(
    command: list[str],
    cwd: Path | str,
    env: dict[str, str],
    limits: SandboxLimits,
    user: int | None,
    status_read: int,
    child_fds: list[int],
    handshake: _Handshake | None = None,
    group: CallGroup | None = None,
) -> SandboxResult:
    """Start the process (handing it `child_fds`, closed here once it has them), collect its output, kill
    its group when it ends or a limit passes, and read the status its supervisor wrote (none: the
    supervisor itself was killed)."""
    started = time.monotonic()
    as_user = {"user": user, "group": user, "extra_groups": []} if user is not None else {}
    try:
        process = await anyio.open_process(
            command,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            env=env,
            start_new_session=True,
            pass_fds=tuple(child_fds),
            **as_user,
        )
    finally:
        for fd in child_fds:
            _close_quietly(fd)
    output = _Output(limits.output_bytes, keep=4 * limits.shown_chars)
    hit: list[Limit] = []
    try:
        with anyio.move_on_after(limits.wall_seconds) as timer:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(output.read, process.stdout, "stdout", process)
                tasks.start_soon(output.read, process.stderr, "stderr", process)
                if handshake is not None:
                    await handshake.release()
                await process.wait()
                _kill_group(process)  # what the code left running in the background goes with it
        if timer.cancelled_caught:
            hit.append(Limit.WALL_TIME)
    finally:
        _kill_group(process)
        if group is not None:
            group.kill()
        with anyio.move_on_after(5, shield=True):
            await process.wait()
    if group is not None and group.oom_kills():
        hit.append(Limit.MEMORY)
    if output.exceeded:
        hit.append(Limit.OUTPUT)
    code = _exit_code(status_read)
    if code is None and not hit and process.returncode and process.returncode > 0:
        code = process.returncode  # the sandbox itself failed before the code ran (its stderr says why)
        log.warning("python sandbox: %s exited %d before running the code", command[0], code)
    return _result(code, output, hit, time.monotonic() - started, limits)


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
    if number in (signal.SIGXCPU, signal.SIGKILL) and not {Limit.WALL_TIME, Limit.OUTPUT, Limit.MEMORY} & set(hit):
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
    (b"Cannot allocate memory", Limit.MEMORY),  # the call's control group is full (a write to tmpfs, a fork)
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
