"""What a layer above the supervisor may ask of it: :class:`SlotControl`, which
:class:`~launcher.supervise.supervisor.Supervisor` implements, and the hook through which an
``apply`` reaches that layer.

The supervisor knows nothing of rollouts. The cli registers an :data:`ApplyHandler`
(:meth:`Supervisor.on_apply <launcher.supervise.supervisor.Supervisor.on_apply>`); when the router
passes on an ``apply``, the supervisor calls it with itself as a :class:`SlotControl`, and steps the
:class:`Stepper` it returns once per supervision step until it says it has ended. Everything the
stepper changes goes through this interface: the supervisor stays the only writer of its own state
and of its slots'.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

from launcher.config import DeployConfig
from launcher.plan.placement import WorkerSpec
from launcher.supervise.admin_client import AdminClient
from launcher.supervise.revisions import Revisions
from launcher.supervise.slots import Slot
from router.admin_protocol import WorkerInfo
from router.rollout_protocol import ApplyRequest


class Stepper(Protocol):
    """Work the supervisor's loop advances a little each step (a rollout)."""

    def advance(self) -> bool:
        """Do what can be done now without waiting; True once it has ended."""
        ...


class SlotControl(Protocol):
    """The supervisor as a rollout sees it: its slots (read; changed through the methods below),
    its configuration and revisions, the router's admin API and its clock."""

    cfg: DeployConfig  # the configuration it runs (changed by :meth:`adopt`)
    revisions: Revisions  # the configuration revisions this deployment has run
    admin: AdminClient  # the router's admin API (drain, restart, live settings, rollout status)
    run_dir: Path  # where the deployment's settings files are written
    worker_settings_path: Path  # the first model's worker settings file (revision 1's)
    worker_settings_paths: list[Path]  # each served model's worker settings file (revision 1's)
    model_paths: list[Path]  # each served model's folder, as ``up`` resolved it
    rollout: Stepper | None  # the apply being carried out, if any

    @property
    def slots(self) -> Mapping[int, Slot]:
        """The worker slots by id."""
        ...

    @property
    def on_cluster(self) -> bool:
        """The slots run on a Ray cluster (no local inventory places them)."""
        ...

    def clock(self) -> float:
        """Monotonic seconds."""
        ...

    def read_table(self) -> dict[int, WorkerInfo] | None:
        """The router's worker table by id; None when it cannot be read."""
        ...

    def add_slot(self, spec: WorkerSpec) -> Slot:
        """A new slot for ``spec``, not started yet."""
        ...

    def start_worker(self, wid: int) -> None:
        """Start slot ``wid``'s process now."""
        ...

    def kill_worker(self, wid: int, why: str) -> None:
        """SIGKILL slot ``wid``'s process (once), logging ``why``; it is reaped as a crash."""
        ...

    def remove_slot(self, wid: int, why: str) -> None:
        """Remove slot ``wid``, which has no process, from the deployment and the router's table."""
        ...

    def report_started(self, wid: int) -> None:
        """Report slot ``wid``'s running process to the router again (its revision changed)."""
        ...

    def ensure_worker_keys(self, wid: int) -> None:
        """Give slot ``wid`` a CURVE key pair when the deployment uses CURVE and it has none."""
        ...

    def adopt(self, cfg: DeployConfig) -> None:
        """Run under ``cfg`` from now on (its own rules, the router settings a restarted router reads)."""
        ...


ApplyHandler = Callable[[SlotControl, ApplyRequest], Stepper | None]
"""Answers an ``apply`` the router passed on: the work to step, or None when there is none (refused,
a dry run, nothing to do, or done at once)."""
