"""``llamadeploy down``: stop a deployment started by ``llamadeploy up`` on this machine.

The router's admin API names the router's pid (``GET /admin/workers``); the process that started
the router is the ``up`` (launcher) process, which is sent SIGTERM: the same stop as Ctrl-C
(in-flight requests get ``supervisor.shutdown_grace_s``, then every child is stopped). Nothing
else is signalled: the parent must be a live ``llamadeploy up`` (or ``python -m launcher.cli up``)
process, read from ``/proc``; anything else is refused, and so is an admin URL that is not an
address of this machine (:func:`on_this_machine`).
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import time
from pathlib import Path
from urllib.parse import urlparse

PROC = Path("/proc")


class StopError(RuntimeError):
    """The deployment could not be stopped from here; ``str()`` says why and what to do."""


def on_this_machine(admin_url: str) -> bool:
    """Whether ``admin_url``'s host is an address of this machine (loopback, or one a socket here
    can bind: an admin API exposed on this machine's own LAN address): only then is the pid the
    router reports a process of this machine (a remote router's pid may be a local one's too)."""
    host = urlparse(admin_url).hostname or ""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(_local(family, addr[0]) for family, _, _, _, addr in infos)


def _local(family: int, ip: str) -> bool:
    if ipaddress.ip_address(ip.split("%")[0]).is_loopback:
        return True
    if ipaddress.ip_address(ip.split("%")[0]).is_unspecified:
        return False
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((ip, 0))  # only an address of one of this machine's interfaces binds
        except OSError:
            return False
    return True


def _stat(pid: int, proc: Path) -> list[str] | None:
    """``proc/<pid>/stat``'s fields after the command name (which may itself hold spaces and
    parentheses): state, parent pid, …; None when there is no such process."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()


def parent_pid(pid: int, proc: Path = PROC) -> int:
    """The parent of process ``pid``. Raises :class:`StopError` when ``pid`` is not a process of
    this machine."""
    fields = _stat(pid, proc)
    if fields is None:
        raise StopError(f"the router's process {pid} is not on this machine")
    return int(fields[1])


def is_launcher(pid: int, proc: Path = PROC) -> bool:
    """Whether ``pid``'s command line is ``llamadeploy up …`` or ``python -m launcher.cli up …``."""
    try:
        argv = (proc / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    words = [a.decode(errors="replace") for a in argv if a]
    for i, word in enumerate(words[:-1]):
        if (word.endswith("llamadeploy") or word == "launcher.cli") and words[i + 1] == "up":
            return True
    return False


def launcher_of(router_pid: int, proc: Path = PROC) -> int:
    """The ``up`` process that started the router ``router_pid``. Raises :class:`StopError` when
    the router's parent is not one (a router started another way, or on another machine)."""
    pid = parent_pid(router_pid, proc)
    if not is_launcher(pid, proc):
        raise StopError(
            f"the router (pid {router_pid}) was not started by `llamadeploy up` on this machine "
            f"(its parent {pid} is something else); stop that process instead"
        )
    return pid


def alive(pid: int, proc: Path = PROC) -> bool:
    """Whether process ``pid`` still exists (a zombie counts as gone)."""
    fields = _stat(pid, proc)
    return fields is not None and fields[0] != "Z"


def stop(pid: int, timeout: float) -> bool:
    """SIGTERM the launcher ``pid`` and wait up to ``timeout`` seconds for it to exit; True when it
    did. The launcher itself stops its router and workers (and SIGKILLs what does not stop)."""
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.2)
    return not alive(pid)
