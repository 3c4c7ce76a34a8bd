"""One supervised child's record and the one crash rule every child lives by: a worker slot
(:class:`Slot`) or the router (:class:`Child`), each the only writer of its own fields."""

from __future__ import annotations

import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from launcher.config import SupervisorConfig
from launcher.plan.placement import WorkerSpec

MAX_BACKOFF_S = 30.0


@dataclass(frozen=True)
class CrashVerdict:
    recent: tuple[float, ...]  # crash times inside the window, this one included
    failed: bool
    delay_s: float  # before restarting (0 when failed)


def judge_crash(
    previous: Iterable[float],
    now: float,
    window_s: float,
    max_restarts: int,
    backoff_s: float,
    max_backoff_s: float = MAX_BACKOFF_S,
) -> CrashVerdict:
    """What to do after a crash at ``now``, given the worker's earlier crash times.

    Crashes older than ``window_s`` are forgotten. The n-th crash within the window is restarted
    after ``backoff_s × 2^(n-1)`` seconds (at most ``max_backoff_s``) while ``n <= max_restarts``;
    crash number ``max_restarts + 1`` marks the worker failed. So a worker that always crashes
    runs ``max_restarts + 1`` times.
    """
    recent = (*(t for t in previous if now - t <= window_s), now)
    if len(recent) > max_restarts:
        return CrashVerdict(recent, True, 0.0)
    return CrashVerdict(recent, False, min(max_backoff_s, backoff_s * 2 ** (len(recent) - 1)))


@dataclass(kw_only=True)
class Child:
    """One supervised child, a worker slot or the router: its process and crash history, under
    the one crash rule both live by (:meth:`crashed`)."""

    proc: subprocess.Popen | None = None
    crashes: tuple[float, ...] = ()
    restart_at: float | None = None
    failed: bool = False
    starts: int = 0  # processes started; restarts = starts - 1

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def crashed(self, now: float, rules: SupervisorConfig) -> CrashVerdict:
        """Its process crashed at ``now``: judge it (:func:`judge_crash`), then schedule its
        restart (``restart_at``) or mark it ``failed``."""
        verdict = judge_crash(self.crashes, now, rules.restart_window_s, rules.max_restarts, rules.restart_backoff_s)
        self.crashes, self.failed = verdict.recent, verdict.failed
        self.restart_at = None if verdict.failed else now + verdict.delay_s
        return verdict

    def due(self, now: float) -> bool:
        """It has no process, is not given up on, and its restart time has come."""
        return self.proc is None and not self.failed and self.restart_at is not None and now >= self.restart_at


@dataclass
class Slot(Child):
    """One worker slot: its placement, current process and crash history."""

    spec: WorkerSpec
    started_at: float = 0.0
    ever_ready: bool = False
    ready_pid: int = 0  # the last process the router said is ready (it re-registers after a router restart)
    last_exit: str = ""
    kill_reason: str = ""  # why the supervisor killed it, if it did
    start_requested: bool = False  # an operator asked for a start (the router's event); done when it has no process
    settings_path: Path | None = None  # its worker settings file (None: the deployment's first)
    model_path: Path | None = None  # its model (None: the deployment's first)
    revision: int = 1  # the configuration revision it is started with (``llamadeploy apply``)
    model_name: str = ""  # its served model's name when a rollout renamed it ("": its model's in the config)
    retiring: bool = False  # a rollout stops it for good: its exit removes the slot

    def ready(self) -> bool:
        """Its current process runs and the router said it is ready."""
        return self.alive() and self.ready_pid == self.proc.pid

    def where(self) -> str:
        """Where its current process runs: the handle's own label (a Ray node) or the placement's."""
        return getattr(self.proc, "label", "") or self.spec.label

    def point(self, settings_path: Path, model_path: Path, revision: int, model_name: str | None = None) -> None:
        """Start its next process with ``settings_path`` and ``model_path``, as configuration
        revision ``revision`` (``model_name``: the served name, when it changes)."""
        self.settings_path, self.model_path, self.revision = settings_path, model_path, revision
        if model_name is not None:
            self.model_name = model_name

    def retry_now(self, now: float) -> None:
        """Forget its crash history (and a ``failed`` verdict): it is started at ``now``."""
        self.failed, self.crashes, self.restart_at = False, (), now

    def retire(self) -> None:
        """It stops for good: its next exit removes it rather than restarting it."""
        self.retiring = True
