"""The steps of a rollout as small state machines the supervisor's loop advances.

Each task's :meth:`~Task.advance` does what it can now without waiting and returns True once its
step is done; it raises :class:`RolloutFailed` (one line) when its new replica crashes, fails or
is not ready in time. :meth:`~Task.abandon` puts back what it had begun (an old replica it was
draining serves again, a new slot it started is stopped) when the rollout fails elsewhere.
What they act through — the supervisor's slots, the router's drain and shutdown — is the
:class:`~launcher.rollout.executor.Rollout` passed in.
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.rollout.plan import Step


class RolloutFailed(Exception):
    """A step cannot complete; ``str()`` is the reason in one line."""


@dataclass
class Task:
    """One step being carried out; ``phase`` names where it stands (for progress lines)."""

    step: Step
    phase: str = "begin"
    since: float = 0.0  # when the current phase began (the rollout's clock)
    starts0: int = 0  # the slot's process starts before its new process
    new_id: int | None = None  # the new slot (surge, start)
    done: bool = False

    def advance(self, ro) -> bool:
        """Move on as far as possible now; True once the step is done."""
        kind = self.step.mode if self.step.kind == "replace" else self.step.kind
        return getattr(self, f"_{kind}")(ro)

    def abandon(self, ro) -> None:
        """The rollout failed: undo what this unfinished step began (its replaced slot is the
        rollback's to replace back)."""
        if self.phase == "draining":
            ro.undrain(self.step.worker_id)
        if self.new_id is not None and self.new_id in ro.sup.slots and not self.done:
            ro.retire(self.new_id, why="its rollout failed")

    def _enter(self, ro, phase: str) -> None:
        self.phase, self.since = phase, ro.now()

    def _drain_then(self, ro, wid: int, then: str) -> bool:
        """Drain ``wid`` (if it serves) and move to ``then`` once it is idle; True when there."""
        if self.phase not in ("draining", then):
            if ro.sup.slots[wid].ready():
                ro.drain(wid)
                self._enter(ro, "draining")
            else:
                self._enter(ro, then)
        if self.phase == "draining" and ro.idle(wid, self.since):
            self._enter(ro, then)
        return self.phase == then

    def _drain_first(self, ro) -> bool:
        wid = self.step.worker_id
        if self.phase in ("begin", "draining") and not self._drain_then(ro, wid, "stopping"):
            return False
        slot = ro.slot(wid)
        if self.phase == "stopping":
            if slot.alive() and not slot.ready():
                ro.kill(wid, "replaced by apply while not ready")  # reaped as a crash: counted before the swap
                return False
            self.starts0 = slot.starts
            ro.swap(wid)  # the next process of the slot runs the new revision
            self._enter(ro, "loading")
        return ro.loaded(wid, self.starts0, self.since)

    def _surge(self, ro) -> bool:
        wid = self.step.worker_id
        if self.phase == "begin":
            self.new_id = ro.add_slot(like=wid)
            self._enter(ro, "loading")
        if self.phase == "loading":
            if not ro.loaded(self.new_id, 0, self.since):
                return False
            self.phase = "begin-drain"
        return self._stop_slot(ro, wid)

    def _start(self, ro) -> bool:
        if self.phase == "begin":
            self.new_id = ro.add_slot(like=None, worker_id=self.step.worker_id, group=self.step.group)
            self._enter(ro, "loading")
        return ro.loaded(self.new_id, 0, self.since)

    def _stop(self, ro) -> bool:
        return self._stop_slot(ro, self.step.worker_id)

    def _stop_slot(self, ro, wid: int) -> bool:
        """Drain ``wid``, then retire it; True once its slot is gone."""
        if wid not in ro.sup.slots:
            return True
        if self.phase != "retiring":
            if not self._drain_then(ro, wid, "retiring"):
                return False
            ro.retire(wid, why="replaced" if self.step.kind == "replace" else "scaled down")
        return wid not in ro.sup.slots
