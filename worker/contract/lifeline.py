"""Children die with the launcher: ``PR_SET_PDEATHSIG``, set by the child itself.

The supervisor puts its pid in the child's environment (:data:`PARENT_ENV`); the first thing the
worker's and the router's entry points do is :func:`die_with_parent`, which asks Linux to SIGKILL
the process when its parent goes, even by SIGKILL, then checks that the parent is still the
launcher (it may have died between the fork and the ``prctl``). Doing this in the child rather
than in a ``preexec_fn`` keeps the fork safe while the launcher runs threads (the progress bar,
rich's refresh thread): ``preexec_fn`` can deadlock in a process that has them.

Import-light (stdlib only): it runs before anything else in the child.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

from worker.contract.env import PARENT_ENV

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
ORPHAN_EXIT_CODE = 1


def die_with_parent(env: dict[str, str] | None = None) -> None:
    """SIGKILL this process when the launcher dies; exit now if it already has.

    A no-op outside a deployment (no :data:`PARENT_ENV`) and where ``prctl`` is missing (not Linux).
    """
    value = (os.environ if env is None else env).get(PARENT_ENV, "")
    if not value.isdigit():
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(value):
        sys.stderr.write(f"the launcher (pid {value}) is gone before this process started; exiting\n")
        os._exit(ORPHAN_EXIT_CODE)
