"""One control group per sandbox call: memory (and on cgroup v2 the process count) for the whole call.

    found = cgroup_parent()             # where calls' groups go, or None (logged) where none may be made
    group = CallGroup.create(found, memory_bytes=512 << 20, processes=18)
    group.join(pid)                     # the sandbox's first process, before it runs any code
    ...
    group.oom_kills()                   # processes the kernel killed at the memory limit
    await group.close()                 # kill what is left, remove the group

Memory counts anonymous memory, shared memory (SysV, POSIX, memfd) and tmpfs pages alike, as the kernel
charges each page to the group of the process that touched it. cgroup v2 (`memory.max`, `pids.max`) where
this process's group is delegated with both controllers, else cgroup v1's memory hierarchy
(`memory.limit_in_bytes`) where this process may make groups in it (root, or a group delegated to the
user). `TURNSTILE_SANDBOX_CGROUP` names a v2 group to use instead of this process's own.

On v1 the process count is left to the call's own user namespace, where RLIMIT_NPROC counts only the
call's processes: each hierarchy a process joins costs a migration, which on v1 waits for an RCU grace
period (about 5 ms here) while every fork on the machine waits with it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
from dataclasses import dataclass
from pathlib import Path

import anyio

log = logging.getLogger(__name__)

_ROOT = Path("/sys/fs/cgroup")
_V2_CONTROLLERS = ("memory", "pids")
_V1_CONTROLLERS = ("memory",)
_CLOSE_WAIT_S = 1.0  # how long a closing group waits for its killed processes to go


@dataclass(frozen=True, slots=True)
class CgroupParent:
    """Where each call's group is made: one directory (v2) or one per controller (v1)."""

    version: int
    directories: tuple[Path, ...]  # v2: (group,); v1: (memory group,)

    def describe(self) -> str:
        return f"cgroup v{self.version} under {', '.join(map(str, self.directories))}"


def cgroup_parent() -> CgroupParent | None:
    """Probed once per sandbox start: a place where this process may make a group and set its limits."""
    for probe in (_v2_parent, _v1_parent):
        with contextlib.suppress(OSError):
            found = probe()
            if found is not None and _can_make_group(found):
                return found
    return None


def _own_groups() -> dict[str, str]:
    """This process's group path per hierarchy: "" for v2's, else each v1 controller's name."""
    groups = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            groups[name] = path
    return groups


def _mounts() -> list[tuple[str, Path, str, set[str]]]:
    """(root within the hierarchy, mount point, fs type, super options) of each cgroup mount."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields, _, rest = line.partition(" - ")
        parts, tail = fields.split(), rest.split()
        if tail and tail[0] in ("cgroup", "cgroup2"):
            found.append((parts[3], Path(parts[4]), tail[0], set(tail[2].split(",")) if len(tail) > 2 else set()))
    return found


def _inside(mount_root: str, point: Path, path: str) -> Path:
    relative = os.path.relpath(path, mount_root) if path.startswith(mount_root) else path
    return (point / relative.lstrip("/")).resolve() if relative != "." else point


def _v2_parent() -> CgroupParent | None:
    named = os.environ.get("TURNSTILE_SANDBOX_CGROUP")
    if named:
        return CgroupParent(2, (Path(named),))
    own = _own_groups().get("")
    for root, point, kind, _ in _mounts():
        if kind != "cgroup2" or own is None:
            continue
        group = _inside(root, point, own)
        controllers = (group / "cgroup.controllers").read_text().split()
        if all(name in controllers for name in _V2_CONTROLLERS):
            return CgroupParent(2, (group,))
    return None


def _v1_parent() -> CgroupParent | None:
    own = _own_groups()
    directories = []
    for name in _V1_CONTROLLERS:
        mount = next((m for m in _mounts() if m[2] == "cgroup" and name in m[3]), None)
        if mount is None or name not in own:
            return None
        directories.append(_inside(mount[0], mount[1], own[name]))
    return CgroupParent(1, tuple(directories))


def _can_make_group(parent: CgroupParent) -> bool:
    if not all(os.access(d, os.W_OK) for d in parent.directories):
        return False
    if parent.version == 2:
        control = parent.directories[0] / "cgroup.subtree_control"
        enabled = control.read_text().split()
        if not all(name in enabled for name in _V2_CONTROLLERS):
            try:
                control.write_text(" ".join(f"+{name}" for name in _V2_CONTROLLERS))
            except OSError as exc:
                log.info("python sandbox: cannot enable memory and pids in %s: %s", control, exc)
                return False
    try:
        group = CallGroup.create(parent, memory_bytes=64 << 20, processes=4)
    except OSError as exc:
        log.info("python sandbox: cannot make a group under %s: %s", parent.describe(), exc)
        return False
    group.remove()
    return True


@dataclass(slots=True)
class CallGroup:
    """One call's group (a directory per hierarchy); the limits are set before anything joins it."""

    parent: CgroupParent
    directories: tuple[Path, ...]

    @classmethod
    def create(cls, parent: CgroupParent, *, memory_bytes: int, processes: int) -> CallGroup:
        name = f"turnstile-sandbox-{os.getpid()}-{secrets.token_hex(4)}"
        directories = tuple(d / name for d in parent.directories)
        group = cls(parent, ())
        for directory in directories:
            directory.mkdir()
            group.directories += (directory,)
        try:
            if parent.version == 2:
                (group.directories[0] / "memory.max").write_text(str(memory_bytes))
                with contextlib.suppress(FileNotFoundError):  # no swap accounting
                    (group.directories[0] / "memory.swap.max").write_text("0")
                (group.directories[0] / "pids.max").write_text(str(processes))
            else:  # memory only: see the module's docstring
                (memory,) = group.directories
                (memory / "memory.limit_in_bytes").write_text(str(memory_bytes))
                with contextlib.suppress(FileNotFoundError):  # no swap accounting
                    (memory / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
        except OSError:
            group.remove()
            raise
        return group

    def join(self, pid: int) -> None:
        """Move `pid` into the group, in every hierarchy (what it starts afterwards is in it too); a process
        that has already exited is left be."""
        for directory in self.directories:
            with contextlib.suppress(ProcessLookupError):
                (directory / "cgroup.procs").write_text(str(pid))

    def oom_kills(self) -> int:
        """Processes the kernel killed because the group reached its memory limit."""
        events = "memory.events" if self.parent.version == 2 else "memory.oom_control"
        try:
            text = (self.directories[0] / events).read_text()
        except OSError:
            return 0
        fields = dict(line.split() for line in text.splitlines() if len(line.split()) == 2)
        return int(fields.get("oom_kill", 0))

    def pids(self) -> list[int]:
        pids: set[int] = set()
        for directory in self.directories:
            with contextlib.suppress(OSError):
                pids.update(int(p) for p in (directory / "cgroup.procs").read_text().split())
        return sorted(pids)

    def kill(self) -> None:
        """Kill every process in the group."""
        if self.parent.version == 2:
            with contextlib.suppress(OSError):
                (self.directories[0] / "cgroup.kill").write_text("1")
                return
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    async def close(self) -> None:
        """Kill what is left and remove the group, once its processes are gone (they are reaped by the
        sandbox's own first process, or by this one: a few milliseconds after the kill). Shielded, with a
        deadline of its own: a call cancelled while it runs or closes still removes its group."""
        with anyio.move_on_after(_CLOSE_WAIT_S, shield=True):
            while True:
                self.kill()
                if not self.pids():
                    break
                await anyio.sleep(0.005)
        if left := self.pids():
            log.warning("python sandbox: processes %s outlived their call; group kept: %s", left, self.directories)
            return
        self.remove()

    def remove(self) -> None:
        for directory in reversed(self.directories):
            with contextlib.suppress(FileNotFoundError):
                directory.rmdir()
