"""Children die with the launcher: the death signal is set by the child itself (no preexec_fn),
and a child whose launcher is already gone when it starts exits at once. Real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from tests.helpers.deployment import alive, wait_for
from worker.contract.env import PARENT_ENV
from worker.contract.lifeline import ORPHAN_EXIT_CODE

CHILD = (
    "from worker.contract.lifeline import die_with_parent; die_with_parent(); import time; print('armed', flush=True); "
    "time.sleep(60)"
)

# A launcher stand-in with a thread running (as the progress bar's), spawning through the
# supervisor's own function; it prints the child's pid and waits.
LAUNCHER = f"""
import threading, time
from launcher.supervise.supervisor import spawn
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
child = spawn(["-c", {CHILD!r}], {{}})
print(child.pid, flush=True)
time.sleep(60)
"""


def test_a_child_started_after_its_launcher_died_exits_at_once():
    env = {**os.environ, PARENT_ENV: str(os.getpid() + 100_000)}  # not this child's parent
    r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=30, check=False)
    assert r.returncode == ORPHAN_EXIT_CODE and "is gone" in r.stderr, r


def test_a_child_dies_when_its_threaded_launcher_is_killed_with_sigkill():
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True)
    try:
        child = int(launcher.stdout.readline())
        assert launcher.stdout.readline().strip() == "armed"  # the child (same stdout) set its death signal
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=10)
        wait_for(lambda: not alive(child), 10, f"child {child} to die with its launcher", interval=0.05)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
