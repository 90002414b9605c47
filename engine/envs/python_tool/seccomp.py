"""The system calls sandboxed code is refused, as a seccomp BPF program built by libseccomp.

    program = refused_calls_filter()    # bytes for bubblewrap's --seccomp, or None without libseccomp

Everything is allowed but what ordinary Python never needs and an escape would: new namespaces (unshare,
setns, and clone with a namespace flag), mounting, the kernel keyring, io_uring, ptrace and reading other
processes' memory, BPF, perf events, userfaultfd, modules and kexec, file handles (which reach files by
inode, past the mount namespace), and a few more (`REFUSED`). Each fails with EPERM; clone3 fails with
ENOSYS, so the C library falls back to clone, whose flags the filter can read. A system call of another
architecture (32-bit calls on a 64-bit kernel) kills the process: libseccomp's default for a foreign ABI.

libseccomp (Debian's libseccomp2, on every machine that runs systemd or Docker) does the arch checks and
the system call numbers; it is called through ctypes, as it has no Python binding on PyPI that is kept.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import logging
import os

log = logging.getLogger(__name__)

REFUSED = (
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "mount_setattr", "move_mount",
    "open_tree", "fsopen", "fsconfig", "fsmount", "fspick",
    "keyctl", "add_key", "request_key",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "bpf", "perf_event_open", "userfaultfd",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "open_by_handle_at", "name_to_handle_at",
    "swapon", "swapoff", "reboot", "acct", "quotactl", "syslog", "vhangup", "iopl", "ioperm",
    "fanotify_init", "lookup_dcookie", "personality",
)  # fmt: skip
_NAMESPACE_FLAGS = (  # clone(2)'s CLONE_NEW* flags
    0x00000080,  # CLONE_NEWTIME
    0x00020000,  # CLONE_NEWNS
    0x02000000,  # CLONE_NEWCGROUP
    0x04000000,  # CLONE_NEWUTS
    0x08000000,  # CLONE_NEWIPC
    0x10000000,  # CLONE_NEWUSER
    0x20000000,  # CLONE_NEWPID
    0x40000000,  # CLONE_NEWNET
)
_ALLOW = 0x7FFF0000
_MASKED_EQ = 7  # SCMP_CMP_MASKED_EQ


def _errno_action(number: int) -> int:
    return 0x00050000 | (number & 0xFFFF)  # SCMP_ACT_ERRNO


class _ArgCmp(ctypes.Structure):  # struct scmp_arg_cmp
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


@functools.cache
def refused_calls_filter() -> bytes | None:
    """The BPF program (cached), or None where libseccomp cannot be loaded or refuses (logged)."""
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as exc:
        log.warning("python sandbox: no seccomp filter (libseccomp not found: %s)", exc)
        return None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(_ArgCmp),
    ]  # fmt: skip
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    context = lib.seccomp_init(_ALLOW)
    if not context:
        log.warning("python sandbox: no seccomp filter (seccomp_init failed)")
        return None
    try:
        return _build(lib, context)
    except OSError as exc:
        log.warning("python sandbox: no seccomp filter (%s)", exc)
        return None
    finally:
        lib.seccomp_release(context)


def _build(lib: ctypes.CDLL, context: int) -> bytes:
    def rule(action: int, call: str, *compare: _ArgCmp) -> None:
        number = lib.seccomp_syscall_resolve_name(call.encode())
        if number < 0:  # not a system call on this architecture
            return
        array = (_ArgCmp * len(compare))(*compare) if compare else None
        result = lib.seccomp_rule_add_array(context, action, number, len(compare), array)
        if result < 0:
            raise OSError(-result, f"seccomp_rule_add({call}): {os.strerror(-result)}")

    eperm = _errno_action(errno.EPERM)
    for call in REFUSED:
        rule(eperm, call)
    for flag in _NAMESPACE_FLAGS:
        rule(eperm, "clone", _ArgCmp(0, _MASKED_EQ, flag, flag))
    rule(_errno_action(errno.ENOSYS), "clone3")  # its flags sit in memory the filter cannot read
    read_end, write_end = os.pipe()
    try:
        result = lib.seccomp_export_bpf(context, write_end)
        if result < 0:
            raise OSError(-result, f"seccomp_export_bpf: {os.strerror(-result)}")
        os.close(write_end)
        write_end = -1
        chunks = []
        while chunk := os.read(read_end, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)
