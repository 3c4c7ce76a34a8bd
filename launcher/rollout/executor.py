"""Carrying out one ``llamadeploy apply``: the rollout, stepped by the supervisor's loop.

:class:`Rollout` runs the plan's steps (:mod:`launcher.rollout.tasks`) wave by wave, through the
supervisor's slots and the router's admin API (drain, shutdown), and posts its
:class:`~router.rollout_protocol.RolloutStatus` as it goes. A step that fails stops the rollout:
the unfinished steps are abandoned, and a rollback — the plan from the new configuration back to
the old one, over the replicas as they stand, replacing only those on the new revision — runs the
same way; then the old router settings are applied again and ``apply`` reports the reason.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import msgspec

from launcher.config import DeployConfig
from launcher.plan.placement import Inventory, WorkerSpec
from launcher.rollout.plan import Replica, RolloutPlan, free_ids, plan_models
from launcher.rollout.room import free_beside, new_spec
from launcher.rollout.tasks import RolloutFailed, Task
from launcher.supervise.control import SlotControl
from launcher.supervise.revisions import Revision
from launcher.supervise.slots import Slot
from router.rollout_protocol import LiveSettings, RolloutStatus

log = logging.getLogger(__name__)

STOP_GRACE_S = 30.0  # a drained worker told to exit is killed after this


@dataclass(frozen=True)
class Target:
    """What a slot of one revision is started with: the revision, and per served model (in
    :meth:`DeployConfig.served` order, a slot's ``spec.model`` indexes them) its worker settings
    file and its model folder."""

    revision: Revision
    settings_paths: tuple[Path, ...]
    model_paths: tuple[Path, ...]

    @property
    def config(self) -> DeployConfig:
        """The revision's configuration."""
        return self.revision.config

    def point(self, slot: Slot) -> None:
        """Start ``slot``'s next process on this target: its model's settings and folder."""
        k = slot.spec.model
        name = self.config.served()[k].name
        slot.point(self.settings_paths[k], self.model_paths[k], self.revision.number, name)

    def index(self, group: str) -> int:
        """The index of the served model called ``group`` (0 when none is: a one-model rename)."""
        names = [one.name for one in self.config.served()]
        return names.index(group) if group in names else 0


class Rollout:
    """One apply from ``old`` to ``new`` carried out through supervisor ``sup`` (a
    :class:`~launcher.supervise.control.SlotControl`: its slots, its admin client, its clock), which
    steps it (:meth:`advance`). ``inventory``: the machine's devices (for new slots and the
    rollback's plan); ``budget``: the plan's max-unavailable."""

    def __init__(
        self,
        sup: SlotControl,
        rollout_id: str,
        old: Target,
        new: Target,
        plan: RolloutPlan,
        inventory: Inventory,
        budget: int,
        is_rollback: bool = False,
    ):
        self.sup, self.id, self.old, self.new, self.inventory = sup, rollout_id, old, new, inventory
        self.is_rollback = is_rollback  # an apply --rollback: its target is an earlier, kept revision
        self.target, self.budget, self.plan_lines = new, budget, plan.lines()
        self.old_counts = counts_of(replicas_of(sup, inventory))  # each model's replicas, for a rollback
        self.began = sup.clock()
        self.progress: list[str] = []
        self.state, self.reason = "running", ""
        self.waves = _waves(plan)
        self.tasks: list[Task] = []
        self._stop_asked: dict[int, tuple[int, float]] = {}  # slot -> (pid, when) told to exit

    # ---- the loop's entry ---------------------------------------------------------------

    def advance(self) -> bool:
        """One step of the rollout from the supervisor's loop; True once it has ended."""
        try:
            self._kill_stragglers()
            while True:
                for task in self.tasks:
                    task.done = task.done or task.advance(self)
                if not all(t.done for t in self.tasks):
                    return False
                if not self.waves:
                    return self._finish()
                self.tasks = [Task(step) for step in self.waves.pop(0)]
                self.note(", ".join(f"{t.step.kind} worker {t.step.worker_id}" for t in self.tasks))
        except RolloutFailed as exc:
            return self._failed(str(exc))

    def _failed(self, reason: str) -> bool:
        """A step failed: abandon the wave, then roll back (or give up if the rollback failed)."""
        for task in self.tasks:
            if not task.done:
                task.abandon(self)
        self.tasks, self.waves = [], []
        if self.state == "rolling_back":
            self.reason = f"{self.reason}; the rollback failed too: {reason}"
            return self._end("failed")
        self.reason, self.state, self.target = reason, "rolling_back", self.old
        self.note(f"failed: {reason}; rolling back to revision {self.old.revision.number}")
        self.waves = _waves(self.plan_to(self.old, self.old_counts))
        self.post()
        return False

    def _finish(self) -> bool:
        if self.state == "rolling_back":
            if self.is_rollback:
                self.sup.revisions.restore(self.old.revision)
            else:
                self.sup.revisions.forget(self.new.revision, self.old.revision)
            self.adopt(self.old.config)
            return self._end("failed")
        self.adopt(self.new.config)
        move_slots(self.sup, self.new)  # the slots it did not replace: their settings are the new ones already
        return self._end("done")

    def _end(self, state: str) -> bool:
        self.state = state
        self.note(f"{state} in {self.sup.clock() - self.began:.1f}s")
        return True

    # ---- what the tasks act through -----------------------------------------------------

    def now(self) -> float:
        """The supervisor's clock (monotonic seconds)."""
        return self.sup.clock()

    def slot(self, wid: int) -> Slot:
        """Slot ``wid``; RolloutFailed when it is gone."""
        slot = self.sup.slots.get(wid)
        if slot is None:
            raise RolloutFailed(f"worker {wid} is gone")
        return slot

    def drain(self, wid: int) -> None:
        """Stop routing new requests to ``wid`` (its in-flight ones go on)."""
        self.sup.admin.try_call("POST", f"/admin/workers/{wid}/drain?timeout=0")
        self.note(f"worker {wid}: draining")

    def undrain(self, wid: int) -> None:
        """Route to ``wid`` again (a step abandoned while draining it)."""
        self.sup.admin.try_call("POST", f"/admin/workers/{wid}/undrain")

    def idle(self, wid: int, since: float) -> bool:
        """``wid`` has no request in flight, or ``supervisor.drain_timeout_s`` passed (what is left
        migrates once it stops, as on a worker's death)."""
        table = self.sup.read_table() or {}
        info = table.get(wid)
        return info is None or info.in_flight == 0 or self.now() - since > self.sup.cfg.supervisor.drain_timeout_s

    def kill(self, wid: int, why: str) -> None:
        """Kill ``wid``'s process (once), logging ``why``."""
        self.slot(wid)
        self.sup.kill_worker(wid, why)

    def swap(self, wid: int) -> None:
        """Point slot ``wid`` at the target and replace its process: a running one is told to
        exit (code 0: the supervisor starts the next at once), a slot with none starts now."""
        slot = self.slot(wid)
        self._point(slot)
        if slot.alive():
            self._ask_exit(wid)
        else:
            slot.retry_now(self.now())
        self.note(f"worker {wid}: starting revision {self.target.revision.number}")

    def loaded(self, wid: int, starts0: int, since: float) -> bool:
        """Slot ``wid``'s process started after ``starts0`` starts is ready on the target revision;
        RolloutFailed when it crashed, was given up on, or is not ready in time."""
        slot = self.slot(wid)
        first = slot.starts > starts0
        if first and slot.ready() and slot.revision == self.target.revision.number:
            self.note(f"worker {wid}: ready on revision {slot.revision} (pid {slot.proc.pid})")
            return True
        if slot.failed or (first and slot.crashes and slot.crashes[-1] >= since and not slot.alive()):
            raise RolloutFailed(f"worker {wid} on revision {self.target.revision.number}: {slot.last_exit}")
        limit = self.sup.cfg.workers.startup_timeout_s
        if self.now() - since > limit + STOP_GRACE_S:
            raise RolloutFailed(f"worker {wid} not ready within {limit:.0f}s (workers.startup_timeout_s)")
        return False

    def add_slot(self, like: int | None, worker_id: int | None = None, group: str = "") -> int:
        """Start a new slot on the target revision: the replacement of slot ``like`` (on a CPU, on
        a spare core set or on ``like``'s own cores), else a new slot of model ``group`` shaped
        like its first; returns its id. RolloutFailed when there is no room for it."""
        wid = worker_id if worker_id is not None else free_ids(self.sup.slots, 1)[0]
        specs = [s.spec for s in self.sup.slots.values()]
        shape = self.sup.slots[like].spec if like is not None else shape_of(specs, self.target.index(group))
        spec = new_spec(shape, wid, specs, self.inventory, cluster=self.sup.on_cluster, share=like is not None)
        if spec is None:
            raise RolloutFailed(f"no room for worker {wid}: no spare set of {len(shape.cpus)} CPU core(s)")
        self.sup.ensure_worker_keys(wid)
        self._point(self.sup.add_slot(spec))
        self.sup.start_worker(wid)
        self.note(f"worker {wid}: started on {spec.label} (revision {self.target.revision.number})")
        return wid

    def retire(self, wid: int, why: str) -> None:
        """Stop slot ``wid`` for good; its exit removes it (from the router's table too)."""
        slot = self.slot(wid)
        slot.retire()
        if not slot.alive():
            self.sup.remove_slot(wid, why)
        elif slot.ready():
            self._ask_exit(wid)
        else:
            self.kill(wid, f"retired ({why})")
        self.note(f"worker {wid}: stopping ({why})")

    def note(self, line: str) -> None:
        """A progress line: logged, and posted to the router for ``apply`` to print."""
        log.info("apply %s: %s", self.id, line)
        self.progress.append(line)
        self.post()

    # ---- helpers ------------------------------------------------------------------------

    def _point(self, slot: Slot) -> None:
        self.target.point(slot)

    def _ask_exit(self, wid: int) -> None:
        """Ask the router to tell ``wid``'s process to exit (code 0); killed after :data:`STOP_GRACE_S`."""
        self.sup.admin.try_call("POST", f"/admin/workers/{wid}/restart")
        self._stop_asked[wid] = (self.sup.slots[wid].proc.pid, self.now())

    def _kill_stragglers(self) -> None:
        """Kill a process asked to exit that still runs after :data:`STOP_GRACE_S` (its
        in-flight requests migrate, as on any worker's death)."""
        for wid, (pid, at) in list(self._stop_asked.items()):
            slot = self.sup.slots.get(wid)
            if slot is None or not slot.alive() or slot.proc.pid != pid:
                del self._stop_asked[wid]  # gone, or replaced by the next process already
            elif self.now() - at > STOP_GRACE_S:
                del self._stop_asked[wid]
                self.kill(wid, f"still running {STOP_GRACE_S:.0f}s after being asked to exit")

    def plan_to(self, target: Target, counts: dict[str, int]) -> RolloutPlan:
        """The plan from the configuration now to ``target`` (the rollback's) with ``counts``
        replicas of each model, replacing only the replicas not on its revision; drain-first (the
        old revision's size is not re-planned)."""
        current = self.new.config if target is self.old else self.old.config
        return plan_models(
            current,
            target.config,
            replicas_of(self.sup, self.inventory),
            counts,
            dict.fromkeys(counts, 2**62),
            max_unavailable=self.budget,
            revision=target.revision.number,
        )

    def adopt(self, cfg: DeployConfig, also: list | None = None) -> None:
        """Make ``cfg`` the supervisor's and the router's settings (live: no process restarts);
        ``also``: model sections the router serves beside ``cfg``'s (a rename in progress)."""
        extra = [m.model_dump(mode="json") for m in also or []]
        live = LiveSettings(settings=cfg.router_settings().model_dump(mode="json"), also_models=extra)
        self.sup.admin.try_call("POST", "/admin/settings", msgspec.to_builtins(live))
        self.sup.adopt(cfg)

    def status(self) -> RolloutStatus:
        """Where the rollout stands, as the router shows it."""
        return RolloutStatus(
            id=self.id,
            state=self.state,
            revision=self.new.revision.number,
            hash=self.new.revision.hash,
            plan=self.plan_lines,
            progress=list(self.progress),
            reason=self.reason,
            wall_s=round(self.sup.clock() - self.began, 2),
        )

    def post(self) -> None:
        """Tell the router where the rollout stands (``POST /admin/rollout``)."""
        self.sup.admin.try_call("POST", "/admin/rollout", msgspec.to_builtins(self.status()))


def replicas_of(sup: SlotControl, inventory: Inventory) -> list[Replica]:
    """Supervisor ``sup``'s slots as the plan sees them (group: the served name of their model in
    their revision)."""
    specs = [s.spec for s in sup.slots.values()]
    names = {r.number: [one.name for one in r.config.served()] for r in sup.revisions.history}
    return [
        Replica(
            wid,
            _name(names.get(s.revision, []), s.spec.model),
            s.revision,
            s.ready(),
            free_beside(s.spec, specs, inventory),
        )
        for wid, s in sup.slots.items()
    ]


def _name(names: list[str], k: int) -> str:
    return names[k] if k < len(names) else ""


def counts_of(replicas: list[Replica]) -> dict[str, int]:
    """Replicas per group (served model name), in first-seen order."""
    counts: dict[str, int] = {}
    for r in replicas:
        counts[r.group] = counts.get(r.group, 0) + 1
    return counts


def shape_of(specs: list[WorkerSpec], model: int) -> WorkerSpec:
    """A new slot's shape for served model ``model``: its first slot's placement (else the first
    slot's, for that model)."""
    return next((s for s in specs if s.model == model), replace(specs[0], model=model))


def _waves(plan: RolloutPlan) -> list[list]:
    """The plan's steps grouped by wave, in order."""
    waves: dict[int, list] = {}
    for step in plan.steps:
        waves.setdefault(step.wave, []).append(step)
    return [waves[w] for w in sorted(waves)]


def post_status(sup: SlotControl, status: RolloutStatus) -> None:
    """Post a status outside a rollout (refused, planned, nothing to do)."""
    sup.admin.try_call("POST", "/admin/rollout", msgspec.to_builtins(status))


def move_slots(sup: SlotControl, target: Target) -> None:
    """Every slot not on ``target`` yet is on it now without restarting (its worker settings did
    not change: only live keys, or another model's): the next start uses the target's files, and
    the router shows the new revision."""
    for wid, slot in sup.slots.items():
        if slot.revision == target.revision.number:
            continue
        target.point(slot)
        if slot.alive():
            sup.report_started(wid)
