"""A network namespace of its own for the Ray tests: only a loopback interface, so Ray (which
otherwise binds the host's interface address even when told 127.0.0.1) uses 127.0.0.1 for
everything, and no test traffic can leave the machine.

:func:`enter` moves the *calling thread* (pytest's main thread) into a fresh namespace
(``unshare(CLONE_NEWNET)`` acts on the calling thread) and brings ``lo`` up; every process and
thread it starts from then on is inside. :func:`leave` moves the thread back, so the rest of the
session runs as before. Needs CAP_SYS_ADMIN (root); Linux only.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct

CLONE_NEWNET = 0x40000000  # <linux/sched.h>
SIOCGIFFLAGS, SIOCSIFFLAGS = 0x8913, 0x8914  # <linux/sockios.h>
IFF_UP = 0x1

_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def loopback_up() -> None:
    """``ip link set lo up`` through the SIOCSIFFLAGS ioctl (no iproute2 needed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(s, SIOCGIFFLAGS, ifreq))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | IFF_UP))


def enter() -> int:
    """Move this thread into a new network namespace with loopback up; returns a handle on the
    namespace it was in (for :func:`leave`). Raises OSError (EPERM without root)."""
    original = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        _check(_libc.unshare(CLONE_NEWNET), "unshare(CLONE_NEWNET)")
    except OSError:
        os.close(original)
        raise
    loopback_up()
    return original


def leave(original: int) -> None:
    """Move this thread back into the namespace ``original`` (from :func:`enter`)."""
    try:
        _check(_libc.setns(original, CLONE_NEWNET), "setns")
    finally:
        os.close(original)
