"""The supervisor: spawns the router and one process per worker, watches them, restarts them.

* Every exit is reported to the router at once (``POST /admin/workers/{id}/exited``), which fails
  over the worker's in-flight requests. Every start is reported too (``.../started`` with the pid
  and the restart count), so the router's table shows the new process before it says Hello.
* A worker that exits with code 0 was asked to (restart from the admin API): it is started again
  at once. Any other exit is a crash, logged with its exit code or signal: the worker is restarted
  on the same device after an exponential backoff; see :func:`judge_crash` for when it is marked
  ``failed`` instead. An operator's ``restart`` of a failed worker starts it again.
* The router pushes what only it sees as typed events on the supervisor's event socket
  (:mod:`launcher.supervise.events`), which the supervisor's loop waits on: a worker it declared dead (missed
  heartbeats, stalled) whose process is still alive is hung, and is killed so that it restarts; an
  operator's requested start happens at once; a ready worker is noted (one still loading after
  ``startup_timeout_s`` is killed and restarted).
* The router is a :class:`Child` like each worker slot, under the same crash rule
  (:meth:`Child.crashed`: backoff, ``max_restarts`` within the window; past that ``up`` stops and
  exits non-zero). It rebinds the same ports and
  ZeroMQ address; once it answers, the supervisor reports every worker process to it again, and
  the running workers re-register (``Identify`` → ``Hello``/``Ready``) with their models loaded.
* Children run in their own session (a terminal's Ctrl-C reaches only the launcher) and set
  ``PR_SET_PDEATHSIG`` first thing (:mod:`worker.contract.lifeline`), so they die with the launcher even
  if it is killed with SIGKILL.
* :meth:`Supervisor.shutdown` is graceful: the router stops taking requests and the supervisor
  waits up to ``shutdown_grace_s`` for in-flight ones, then workers and router get SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from launcher.config import DeployConfig
from launcher.plan.placement import WorkerSpec
from launcher.supervise.admin_client import AdminClient, AdminError  # noqa: F401 (AdminError: the CLI's import)
from launcher.supervise.control import ApplyHandler, Stepper
from launcher.supervise.events import EventInbox
from launcher.supervise.launch import WorkerLaunch
from launcher.supervise.revisions import Revisions
from launcher.supervise.slots import MAX_BACKOFF_S, Child, Slot, judge_crash  # noqa: F401 (judge_crash: the tests' import)
from launcher.supervise.standby import QuietGate
from router.admin_protocol import (
    ApplyRequested,
    Event,
    Exited,
    Started,
    StartRequested,
    WorkerDown,
    WorkerInfo,
    WorkerReady,
)
from router.args import PROGRAM as ROUTER_PROGRAM
from router.args import RouterArgs
from worker.contract.env import PARENT_ENV, SECRET_ENVS

log = logging.getLogger(__name__)

LOOP_S = 0.2  # the longest the supervisor's loop waits for an event before it looks at its processes
TERM_TIMEOUT_S = 10.0  # SIGTERM → SIGKILL


class WorkerStartError(Exception):
    """A worker slot cannot be started at all (no node has room for it, say): the slot is marked
    ``failed`` with this message as the reason instead of being retried."""


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def spawn(args: list[str], env: dict[str, str], stdin_pipe: bool = False) -> subprocess.Popen:
    """``python ARGS`` in its own session (a terminal's Ctrl-C reaches only the launcher), with
    ``env`` added and stdin a pipe (``stdin_pipe``) or nothing. The child sets its own death signal
    from :data:`~worker.contract.env.PARENT_ENV` (no ``preexec_fn``: the launcher runs threads).
    The launcher's secret variables are left out: the router has its secrets in its settings file,
    and no other child has any."""
    inherited = {k: v for k, v in os.environ.items() if k not in SECRET_ENVS}
    return subprocess.Popen(
        [sys.executable, *args],
        stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
        start_new_session=True,
        text=stdin_pipe,
        env={**inherited, **env, "PYTHONUNBUFFERED": "1", PARENT_ENV: str(os.getpid())},
    )


class Supervisor:
    """Owns every child process of one deployment.

    Test seams: ``clock`` (monotonic seconds), :meth:`_pause` (waits), :meth:`_spawn` (makes a
    process), :meth:`_open_events` (the router's event channel) and ``admin`` (the router's admin
    API) can be replaced, as ``tests/helpers/supervisor_harness.py`` does.
    """

    def __init__(
        self,
        cfg: DeployConfig,
        specs: list[WorkerSpec],
        model_path: Path | list[Path],
        run_dir: Path,
        address: str,
        clock: Callable[[], float] = time.monotonic,
        child_env: dict[str, str] | None = None,
        backend=None,
    ):
        self.cfg = cfg
        self.backend = backend  # None: local processes; else an object with spawn_worker(spec, launch)
        self.child_env = dict(child_env or {})  # added to every router and worker (the CURVE keys' folder)
        self.model_paths = [model_path] if isinstance(model_path, Path | str) else list(model_path)
        self.served = cfg.served()
        self.model_names = [one.name for one in self.served]
        self.run_dir = run_dir
        self.address = address
        self.clock = clock
        self.started = int(time.time())  # Unix seconds: every router it starts shows it as /v1/models' created
        # each child reads only its own role's settings: no router secret reaches a worker's file
        self.router_settings_path = run_dir / "router.json"
        self.router_settings_path.write_text(cfg.router_settings().model_dump_json())
        self.worker_settings_paths = [run_dir / "worker.json"] + [
            run_dir / f"worker-{k}.json" for k in range(1, len(self.model_names))
        ]  # one per model: each worker reads its own model's settings
        for k, path in enumerate(self.worker_settings_paths):
            path.write_text(cfg.worker_settings(k).model_dump_json())
        self.worker_settings_path = self.worker_settings_paths[0]  # the first model's (the one-model form's)
        self.slots = {s.worker_id: Slot(s) for s in specs}
        self.router_child = Child()  # its proc is None while a dead router waits for its restart
        self.router_answering = False  # the current router process has answered its admin API
        self.standby: subprocess.Popen | None = None  # a loaded router waiting to take over
        self.standby_enabled = False  # set once serving: a standby must not slow the workers' start
        self._standby_at = 0.0  # when a standby may be started (after one died)
        self._standby_gate = QuietGate()  # and then at a quiet moment (launcher/supervise/standby.py)
        self.admin = AdminClient(cfg.router.admin_url, cfg.router.admin_token)
        self.events = self._open_events()  # the router's events (a test replaces it)
        self._events: list[Event] = []  # received while pausing, handled by the next poll_once
        self.stopping = False
        self._table_failing = False  # the last table read failed (warned once per outage)
        self.rollout: Stepper | None = None  # the apply being carried out, stepped by poll_once
        self._apply: ApplyHandler | None = None  # answers an apply (registered from above: on_apply)
        self.revisions = Revisions(run_dir, cfg)

    def on_apply(self, handler: ApplyHandler) -> None:
        """Answer the router's ``apply`` events with ``handler`` (the rollout's, registered by the
        cli): the :class:`~launcher.supervise.control.Stepper` it returns is advanced by :meth:`poll_once`."""
        self._apply = handler

    @property
    def on_cluster(self) -> bool:
        """The slots run on a Ray cluster (a backend places them, not the local inventory)."""
        return self.backend is not None

    @property
    def router(self) -> subprocess.Popen | None:
        """The router's current process (None while a dead router waits for its restart)."""
        return self.router_child.proc

    @router.setter
    def router(self, proc: subprocess.Popen | None) -> None:
        self.router_child.proc = proc

    def _open_events(self) -> EventInbox:
        return EventInbox(self.run_dir)

    # ---- the router's admin API -------------------------------------------------------

    def _report(self, wid: int, msg: Started | Exited) -> None:
        if not self.router_answering:
            return  # no router to tell: a restarted one hears about every worker once it answers
        try:
            self.admin.report(wid, msg)
        except (OSError, ValueError) as exc:
            log.warning("could not report worker %d %s to the router: %s", wid, type(msg).__name__.lower(), exc)

    def read_table(self) -> dict[int, WorkerInfo] | None:
        """The router's worker table by id, or None when it cannot be read (logged at WARNING once
        per outage). Read while shutting down, to wait for the requests in flight."""
        try:
            table = self.admin.table()
        except (OSError, ValueError) as exc:
            if not self._table_failing:
                log.warning("cannot read the router's worker table (%s); retrying", exc)
            self._table_failing = True
            return None
        if self._table_failing:
            log.info("the router's worker table is readable again")
        self._table_failing = False
        return {w.id: w for w in table.workers}

    # ---- spawning ---------------------------------------------------------------------

    def _spawn(self, args: list[str], env: dict[str, str], stdin_pipe: bool = False) -> subprocess.Popen:
        return spawn(args, env, stdin_pipe)

    def _spawn_worker(self, spec: WorkerSpec, launch: WorkerLaunch):
        """Start one worker slot and return its handle: a Popen, or anything with Popen's ``pid``,
        ``returncode``, ``poll()``, ``wait(timeout)``, ``send_signal(sig)`` and ``kill()`` (a group
        of ranks, a Ray actor). Raises :class:`WorkerStartError` when the slot cannot be started."""
        if self.backend is not None:
            return self.backend.spawn_worker(spec, launch)
        if spec.tp > 1:
            from launcher.supervise.ranks import RankGroup

            return RankGroup.start(spec, launch, self._spawn)
        return self._spawn(launch.argv(), dict(launch.env))

    def _router_args(self, restarts: int = 0, standby: bool = False) -> list[str]:
        """A router's command line: the same files and addresses for every router it starts."""
        args = RouterArgs(
            config=str(self.router_settings_path),
            model_paths=tuple(str(path) for path in self.model_paths),
            address=self.address,
            events=self.events.address,
            started=self.started,
            event_log=str(self.run_dir / "events.jsonl"),  # outlives each router: the next one shows the same log
            restarts=restarts,
            standby=standby,
        )
        return [*ROUTER_PROGRAM, *args.to_argv()]

    def start_router(self) -> None:
        """Start a router on the configured ports and ZeroMQ address (the same every time): the
        standby takes over when there is one (it has loaded already), else a new process."""
        self.router_child.starts += 1
        self.router_answering = False
        restarts = self.router_child.starts - 1
        standby, self.standby = self.standby, None
        if standby is not None and standby.poll() is None:
            try:
                standby.stdin.write(f"go {restarts}\n")
                standby.stdin.close()
            except OSError:  # it died just now
                standby = None
            else:
                self.router = standby
                log.info("standby router (pid %d) taking over, restart %d", standby.pid, restarts)
                return
        self.router = self._spawn(self._router_args(restarts=restarts), self.child_env)
        log.info("router started (pid %d)%s", self.router.pid, f", restart {restarts}" if restarts else "")

    def keep_standby(self) -> None:
        """With ``supervisor.router_standby``, keep one standby router loaded beside the serving one
        (so a restart takes a moment, not the seconds of importing and loading the tokenizer). It
        loads at a quiet moment (:class:`~launcher.supervise.standby.QuietGate`): its load would
        stall the steps of the workers it shares the cores with."""
        if not (self.standby_enabled and self.cfg.supervisor.router_standby and self.router_answering):
            return
        now = self.clock()
        if self.standby is not None and self.standby.poll() is not None:
            log.warning(
                "standby router (pid %d) %s; starting another in %.0fs",
                self.standby.pid,
                describe_exit(self.standby.returncode),
                MAX_BACKOFF_S,
            )
            self.standby, self._standby_at = None, now + MAX_BACKOFF_S
        if self.standby is not None or now < self._standby_at:
            return
        busy = self._requests_in_flight()
        if self._standby_gate.open(now, busy):
            self._standby_gate.done()
            self.standby = self._spawn(self._router_args(standby=True), self.child_env, stdin_pipe=True)
            log.info("standby router started (pid %d)%s", self.standby.pid, "" if busy is False else ", under load")

    def _requests_in_flight(self) -> bool | None:
        """Whether any worker has a request in flight or in its engine, by the router's table (None
        when it cannot be read)."""
        table = self.read_table()
        if table is None:
            return None
        return any(w.in_flight or w.running or w.waiting for w in table.values())

    def start_worker(self, wid: int) -> None:
        slot = self.slots[wid]
        spec = slot.spec
        settings = slot.settings_path or self.worker_settings_paths[spec.model]
        launch = WorkerLaunch.for_slot(
            spec, settings, slot.model_path or self.model_paths[spec.model], self.address, self.child_env
        )
        slot.restart_at, slot.kill_reason, slot.start_requested = None, "", False
        try:
            # Set before the child imports torch: the worker sees only its own GPUs ("" hides all on CPU).
            slot.proc = self._spawn_worker(spec, launch)
        except WorkerStartError as exc:
            slot.failed, slot.last_exit = True, str(exc)
            log.error("worker %d cannot be started: %s; marked failed", wid, exc)
            self._report(wid, Exited(reason=str(exc), failed=True))
            return
        slot.starts += 1
        slot.started_at = self.clock()
        label = slot.where()
        log.info(
            "worker %d started on %s (pid %d)%s",
            wid,
            label,
            slot.proc.pid,
            f", restart {slot.starts - 1}" if slot.starts > 1 else "",
        )
        self._report(wid, self._started(slot))

    def add_slot(self, spec: WorkerSpec) -> Slot:
        """A new slot (a rollout's surge or scale-up) for ``spec``, not started yet."""
        self.slots[spec.worker_id] = slot = Slot(spec)
        return slot

    def _startup_timeout_s(self, slot: Slot) -> float:
        """``workers.startup_timeout_s`` of the slot's model (its entry may override the top level)."""
        return self.served[slot.spec.model].workers.startup_timeout_s

    def _started(self, slot: Slot) -> Started:
        """The report of ``slot``'s current process: its pid, restarts, where it runs, whose model
        (a rollout's renamed model: the slot's own), which configuration revision."""
        model = slot.model_name or self.model_names[slot.spec.model]
        return Started(
            pid=slot.proc.pid, restarts=slot.starts - 1, device=slot.where(), model=model, revision=slot.revision
        )

    def start(self) -> None:
        self.start_router()
        self._wait_router()
        for wid in self.slots:
            self.start_worker(wid)

    def _wait_router(self, timeout: float = 120.0) -> None:
        deadline = self.clock() + timeout
        while self.clock() < deadline:
            if self.router.poll() is not None:
                raise RuntimeError(f"the router exited during start-up ({describe_exit(self.router.returncode)})")
            try:
                self.admin.table(timeout=1.0)
            except (OSError, ValueError):
                time.sleep(0.2)
                continue
            self.router_answering = True
            return
        raise RuntimeError(f"the router did not answer on {self.admin.base} within {timeout:.0f}s")

    # ---- watching ---------------------------------------------------------------------

    def wait_ready(
        self, timeout: float, stop_requested: Callable[[], bool] = lambda: False, pause_s: float = 0.25
    ) -> None:
        """Supervise until every worker is ready or failed (at least one ready), or a stop is requested.

        Raises RuntimeError when no worker can serve: every worker crashed before any became
        ready (fail fast: that is a configuration problem, not bad luck), or none was ready within
        ``timeout``. Once one is ready, a worker still loading at ``timeout`` does not stop the
        deployment: :meth:`poll_once` kills it and it is restarted like any other.
        """
        deadline = self.clock() + timeout
        while not stop_requested():
            self.poll_once()
            pending = [wid for wid, s in self.slots.items() if not s.failed and not s.ready()]
            if not any(s.ever_ready for s in self.slots.values()) and all(s.last_exit for s in self.slots.values()):
                exits = "; ".join(f"worker {wid}: {s.last_exit}" for wid, s in self.slots.items())
                raise RuntimeError(f"every worker exited during start-up ({exits}); see their logs above")
            if not pending:
                return
            if self.clock() > deadline:
                self._late(pending, timeout)
                return
            self._pause(pause_s)

    def _late(self, pending: list[int], timeout: float) -> None:
        """Workers not ready at the start-up timeout: serve without them when another one is
        ready (they are killed and restarted like any hung worker); else raise RuntimeError."""
        late = ", ".join(map(str, pending))
        if not any(s.ever_ready for s in self.slots.values()):
            raise RuntimeError(f"worker(s) {late} not ready within {timeout:.0f}s (workers.startup_timeout_s)")
        log.warning(
            "worker(s) %s not ready within %.0fs (workers.startup_timeout_s); serving without them while "
            "they are restarted",
            late,
            timeout,
        )

    def _pause(self, seconds: float) -> None:
        """Wait up to ``seconds`` for the router's events (handled by the next :meth:`poll_once`)."""
        self._events += self.events.wait(seconds)

    def poll_once(self) -> None:
        """One supervision step: watch the router, reap exits, act on the router's events, restart
        what is due, kill what is still loading after ``startup_timeout_s``. Raises RuntimeError
        when the router is given up on."""
        events, self._events = self._events + self.events.wait(0), []
        if not self.stopping:
            self.watch_router()
        self.reap()
        if self.stopping:
            return
        for event in events:
            self.on_event(event)
        if self.rollout is not None and self.rollout.advance():
            self.rollout = None
        now = self.clock()
        for wid, slot in self.slots.items():
            if slot.proc is None and slot.start_requested:
                log.info("worker %d: start requested through the admin API", wid)
                slot.failed, slot.crashes = False, ()  # an operator's start gets a fresh crash history
                self.start_worker(wid)
            elif slot.due(now):
                self.start_worker(wid)
            elif self._loading_too_long(slot, now):
                self._kill(slot, f"not ready after {self._startup_timeout_s(slot):.0f}s")

    def _loading_too_long(self, slot: Slot, now: float) -> bool:
        """A process the router answers for but has not called ready within ``startup_timeout_s``
        of its start (a process re-registering after a router restart was ready before)."""
        return (
            self.router_answering
            and slot.alive()
            and not slot.kill_reason
            and slot.ready_pid != slot.proc.pid
            and now - slot.started_at > self._startup_timeout_s(slot)
        )

    def on_event(self, event: Event) -> None:
        """Act on one of the router's events about a slot of this deployment (or an apply)."""
        if isinstance(event, ApplyRequested):
            if self._apply is None:
                log.warning("apply %s: this supervisor takes no apply", event.request.id)
            else:
                self.rollout = self._apply(self, event.request) or self.rollout
            return
        slot = self.slots.get(event.worker_id)
        if slot is None:
            return
        if isinstance(event, StartRequested):
            slot.start_requested = True  # started once it has no process (a hung one is being killed)
            return
        if not slot.alive() or slot.proc.pid != event.pid:
            return  # about a process that is gone already
        if isinstance(event, WorkerReady):
            slot.ready_pid, slot.ever_ready = event.pid, True
        elif isinstance(event, WorkerDown) and not slot.kill_reason:
            self._kill(slot, f"hung: {event.reason or 'missed heartbeats'}")

    def watch_router(self) -> None:
        """Restart a dead router under the workers' crash rule (:meth:`Child.crashed`); once the
        new one answers, report every worker to it. The workers keep running and re-register.
        Raises RuntimeError when the router crashed more than ``max_restarts`` times in the window."""
        now, sup, router = self.clock(), self.cfg.supervisor, self.router_child
        if router.proc is not None and router.proc.poll() is not None:
            code, pid = router.proc.returncode, router.proc.pid
            router.proc, self.router_answering = None, False
            verdict = router.crashed(now, sup)
            if verdict.failed:
                raise RuntimeError(
                    f"the router (pid {pid}) {describe_exit(code)}; {len(verdict.recent)} crashes "
                    f"within {sup.restart_window_s:.0f}s (supervisor.max_restarts): giving up"
                )
            log.error(
                "router (pid %d) %s; restarting it in %.1fs on the same addresses (crash %d, giving up after %d "
                "within %.0fs); workers keep running",
                pid,
                describe_exit(code),
                verdict.delay_s,
                len(verdict.recent),
                sup.max_restarts + 1,
                sup.restart_window_s,
            )
        if router.due(now):
            router.restart_at = None
            self.start_router()
        if router.proc is not None and not self.router_answering:
            try:
                self.admin.table(timeout=0.5)
            except (OSError, ValueError):
                return  # still starting
            self.router_answering = True
            self._tell_router_everything()
        self.keep_standby()

    def _tell_router_everything(self) -> None:
        """A new router process answers: report every slot's process (or its last exit) to it."""
        running = 0
        for wid, slot in self.slots.items():
            if slot.alive():
                running += 1
                self._report(wid, self._started(slot))
            elif slot.last_exit:
                self._report(wid, Exited(reason=slot.last_exit, failed=slot.failed))
        log.info(
            "router (pid %d) answers; reported %d running worker(s), which re-register without restarting",
            self.router.pid,
            running,
        )

    def reap(self) -> None:
        """Handle every worker process that has exited: report it, then schedule a restart or give up."""
        for wid, slot in list(self.slots.items()):
            if slot.proc is None or slot.proc.poll() is None:
                continue
            code, pid = slot.proc.returncode, slot.proc.pid
            rank = getattr(slot.proc, "exited_rank", None)  # a tensor-parallel slot: which rank took it down
            why = getattr(slot.proc, "exit_reason", "")  # a backend's handle may know more (a node that left)
            slot.proc = None
            detail = slot.kill_reason or why
            reason = describe_exit(code) + (f" ({detail})" if detail else "")
            if rank is not None and slot.spec.tp > 1:
                reason = f"rank {rank} {reason}"
            slot.last_exit = reason
            if slot.retiring and not self.stopping:
                self._retired(wid, pid, reason)
                continue
            if self.stopping:
                log.info("worker %d (pid %d) stopped: %s", wid, pid, reason)
            elif code == 0:
                log.info("worker %d (pid %d) exited on request; starting it again", wid, pid)
                slot.restart_at = self.clock()
            else:
                self._crashed(wid, slot, pid, reason)
            self._report(wid, Exited(reason=reason, failed=slot.failed, pid=pid))

    def _retired(self, wid: int, pid: int, reason: str) -> None:
        """A slot a rollout stopped for good has exited: it leaves this deployment and the router's table."""
        del self.slots[wid]
        log.info("worker %d (pid %d) retired: %s", wid, pid, reason)
        self._report(wid, Exited(reason=f"retired ({reason})", pid=pid, removed=True))

    def _crashed(self, wid: int, slot: Slot, pid: int, reason: str) -> None:
        """Worker ``wid``'s process ``pid`` crashed: the crash rule schedules its restart or marks it failed."""
        sup = self.cfg.supervisor
        verdict = slot.crashed(self.clock(), sup)
        if verdict.failed:
            log.error(
                "worker %d (pid %d) %s; %d crashes within %.0fs: marked failed, not restarting "
                "(`llamadeploy restart-worker %d` tries again)",
                wid,
                pid,
                reason,
                len(verdict.recent),
                sup.restart_window_s,
                wid,
            )
        else:
            log.warning(
                "worker %d (pid %d) %s; restarting in %.1fs (crash %d, failed after %d within %.0fs)",
                wid,
                pid,
                reason,
                verdict.delay_s,
                len(verdict.recent),
                sup.max_restarts + 1,
                sup.restart_window_s,
            )

    def _kill(self, slot: Slot, why: str) -> None:
        log.error("worker %d (pid %d) is %s; killing it", slot.spec.worker_id, slot.proc.pid, why)
        slot.kill_reason = why
        slot.proc.kill()

    # ---- what a rollout asks for (launcher.supervise.control.SlotControl) ---------------

    def kill_worker(self, wid: int, why: str) -> None:
        """SIGKILL slot ``wid``'s process, logging ``why``, unless it has none or is being killed already."""
        slot = self.slots[wid]
        if slot.alive() and not slot.kill_reason:
            self._kill(slot, why)

    def remove_slot(self, wid: int, why: str) -> None:
        """Slot ``wid`` has no process and leaves the deployment (and the router's table) for ``why``."""
        del self.slots[wid]
        self._report(wid, Exited(reason=f"retired ({why})", removed=True))

    def report_started(self, wid: int) -> None:
        """Report slot ``wid``'s running process to the router again (its revision changed)."""
        self._report(wid, self._started(self.slots[wid]))

    def ensure_worker_keys(self, wid: int) -> None:
        """Make slot ``wid``'s CURVE key pair when the deployment uses CURVE and it has none (a new
        slot: the router accepts it once the file exists)."""
        from worker.contract.env import KEYS_ENV
        from worker.contract.keys import add_worker_keys

        if folder := self.child_env.get(KEYS_ENV):
            add_worker_keys(Path(folder), wid)

    def adopt(self, cfg: DeployConfig) -> None:
        """Run under ``cfg`` from now on: its own rules, the router settings file a restarted router
        reads, its admin token; a standby router (loaded with the old settings) is replaced."""
        self.cfg, self.served = cfg, cfg.served()
        self.model_names = [one.name for one in self.served]
        self.router_settings_path.write_text(cfg.router_settings().model_dump_json())
        self.admin.token = cfg.router.admin_token
        if self.standby is not None:
            self._terminate([self.standby], 5.0)
            self.standby = None

    def run(self, stop_requested: Callable[[], bool]) -> int:
        """Supervise until ``stop_requested()`` is true; then shut down. Returns the exit code."""
        code = 0
        self.standby_enabled = True
        try:
            while not stop_requested():
                self.poll_once()
                self._pause(LOOP_S)
        except RuntimeError as exc:
            log.error("%s; stopping the deployment", exc)
            code = 1
        self.shutdown()
        return code

    # ---- stopping ---------------------------------------------------------------------

    def shutdown(self, grace: float | None = None) -> None:
        """Graceful stop: the router refuses new requests, in-flight ones get ``grace`` seconds
        (default ``supervisor.shutdown_grace_s``), then SIGTERM to children, SIGKILL to what is left."""
        self.stopping = True
        grace = self.cfg.supervisor.shutdown_grace_s if grace is None else grace
        router_up = self.router is not None and self.router.poll() is None
        if router_up and self.admin.try_call("POST", "/admin/shutdown?grace=0") is not None and grace > 0:
            self._wait_idle(grace)
        self._terminate([s.proc for s in self.slots.values() if s.proc is not None], TERM_TIMEOUT_S)
        self.reap()
        routers = [p for p in (self.router, self.standby) if p is not None]
        self._terminate(routers, TERM_TIMEOUT_S)
        self.events.close()
        log.info("all processes stopped")

    def _wait_idle(self, grace: float) -> None:
        """Wait until the router has no request in flight (at most ``grace`` s), still reporting exits."""
        deadline = self.clock() + grace
        logged = False
        while True:
            self.reap()
            table = self.read_table()
            busy = sum(w.in_flight for w in table.values()) if table else 0
            if table is None or busy == 0:
                return
            if self.clock() >= deadline:
                log.warning(
                    "%d request(s) still in flight after %.0fs (supervisor.shutdown_grace_s); stopping anyway",
                    busy,
                    grace,
                )
                return
            if not logged:
                log.info("shutting down: refusing new requests, waiting up to %.0fs for %d in flight", grace, busy)
                logged = True
            time.sleep(0.2)

    @staticmethod
    def _terminate(procs: list[subprocess.Popen], timeout: float) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("pid %d did not stop in %.0fs; killing it", p.pid, timeout)
                p.kill()
                p.wait()
