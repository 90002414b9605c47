"""The sandboxed process's own first steps: lock itself in, then run the model's code.

Run by the sandbox as `python -I -S -c <this file's text> CONFIG` in the scratch directory, which holds
the code as `main.py` (given as text, this file need not be readable by the sandbox's user). It only
uses the standard library (with -S nothing else is importable).

The process stays as a supervisor (PID 1 of the sandbox's PID namespace, where there is one): it forks
the worker, waits for it and writes its exit status, or the signal that ended it, as JSON to the status
pipe the sandbox passed (`status_fd`), which the worker closes before anything else, so the code cannot
write there. Where the call has a control group, the supervisor waits to fork until the sandbox has moved
it into the group (a byte on `go_fd`), so the worker and all it starts are in it. The worker, in order:

1. In the hand-built sandbox, Landlock (where the kernel has it; under bubblewrap, its own root and
   namespaces hold this and more): reading stays allowed everywhere, writing only beneath the scratch
   directory (and /dev/null); TCP connect and bind are refused (Landlock ABI 4 and later); signals and
   abstract Unix sockets stay within the sandbox (ABI 6 and later). Landlock also stops the process
   from reading other processes' memory or /proc/PID/environ.
2. Resource limits, soft and hard alike so the code cannot raise them again: CPU seconds, address
   space, open files, processes, file size, no core files.
3. `main.py`, as `__main__`; a traceback shows the code's own frames only.
"""

import atexit
import contextlib
import json
import os
import resource
import sys
import traceback

# Landlock's ABI (linux/landlock.h). The syscall numbers are the same on every architecture.
_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38
_READ = 1 << 0 | 1 << 2 | 1 << 3  # execute, read file, read dir
_WRITE_FILE, _READ_FILE = 1 << 1, 1 << 2
_FS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 5: (1 << 16) - 1}  # every fs right of each ABI
_NET_TCP = 1 << 0 | 1 << 1  # bind, connect
_SCOPED = 1 << 0 | 1 << 1  # abstract unix sockets, signals


def restrict_filesystem_and_network(scratch: str, abi: int) -> None:
    """Landlock: write only beneath `scratch`, no TCP, no signals out. Raises OSError if the kernel refuses."""
    import ctypes  # here, not at the top: under bubblewrap there is no Landlock to set, nor its import to pay

    class RulesetAttr(ctypes.Structure):
        _fields_ = [
            ("handled_access_fs", ctypes.c_uint64),
            ("handled_access_net", ctypes.c_uint64),
            ("scoped", ctypes.c_uint64),
        ]

    class PathBeneathAttr(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    def check(result: int) -> int:
        if result < 0:
            errno = ctypes.get_errno()
            raise OSError(errno, os.strerror(errno))
        return result

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    handled_fs = _FS_BY_ABI[max(level for level in _FS_BY_ABI if level <= abi)]
    attr = RulesetAttr(handled_fs, _NET_TCP if abi >= 4 else 0, _SCOPED if abi >= 6 else 0)
    size = ctypes.sizeof(attr) if abi >= 6 else 16 if abi >= 4 else 8
    ruleset = check(libc.syscall(_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0)))
    file_rights = _WRITE_FILE | _READ_FILE | (1 << 14 if abi >= 3 else 0)  # truncate
    for path, rights in (("/", _READ), (scratch, handled_fs), ("/dev/null", file_rights)):
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        try:
            rule = PathBeneathAttr(rights, fd)
            check(libc.syscall(_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.byref(rule), ctypes.c_uint32(0)))
        finally:
            os.close(fd)
    check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))
    check(libc.syscall(_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)))
    os.close(ruleset)


def set_limits(limits: dict) -> None:
    """Soft and hard limits alike; CPU gets a second of grace between SIGXCPU and SIGKILL."""
    cpu = limits["cpu_seconds"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    for name, value in (
        ("RLIMIT_AS", limits["memory_bytes"]),
        ("RLIMIT_NOFILE", limits["open_files"]),
        ("RLIMIT_NPROC", limits["processes"]),
        ("RLIMIT_FSIZE", limits["file_bytes"]),
        ("RLIMIT_CORE", 0),
    ):
        resource.setrlimit(getattr(resource, name), (value, value))


def run_main() -> int:
    """The code's exit status, as the interpreter would give it."""
    with open("main.py", encoding="utf-8") as file:
        source = file.read()
    namespace = {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__}
    sys.argv = ["main.py"]
    try:
        exec(compile(source, "main.py", "exec"), namespace)
        atexit._run_exitfuncs()
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException as exc:  # noqa: BLE001 -- the code's own failure, reported as Python would
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
        return 1
    return 0


def work(config: dict) -> None:
    """The worker: lock in, limit, run the code, and exit with its status (never returning)."""
    code = 1
    try:
        os.close(config["status_fd"])
        if config["landlock_abi"] >= 1:
            restrict_filesystem_and_network(os.getcwd(), config["landlock_abi"])
        set_limits(config["limits"])
        code = run_main()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # the code may have closed its own streams
                stream.flush()
        os._exit(code & 0xFF)


def main() -> None:
    config = json.loads(sys.argv[1])
    if config.get("go_fd") is not None:  # the sandbox moves this process into the call's control group first
        os.read(config["go_fd"], 1)
        os.close(config["go_fd"])
    worker = os.fork()
    if worker == 0:
        work(config)
    _, status = os.waitpid(worker, 0)
    os.write(config["status_fd"], json.dumps({"exit_code": os.waitstatus_to_exitcode(status)}).encode())


if __name__ == "__main__":
    main()
