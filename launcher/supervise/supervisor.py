"""The supervisor: spawns the router and one process per worker, watches them, restarts them.

* Every exit is reported to the router at once (``POST /admin/workers/{id}/exited``), which fails
  over the worker's in-flight requests. Every start is reported too (``.../started`` with the pid
  and the restart count), so the router's table shows the new process before it says Hello.
* A worker that exits with code 0 was asked to (restart from the admin API): it is started again
  at once. Any other exit is a crash, logged with its exit code or signal: the worker is restarted
  on the same device after an exponential backoff; see :func:`judge_crash` for when it is marked
  ``failed`` instead. An operator's ``restart`` of a failed worker starts it again.
* Once a second the supervisor compares notes with the router: a worker the router declared dead
  (missed heartbeats) whose process is still alive is hung, and is killed so that it restarts.
* A router that exits is restarted under the same rules as a worker (backoff, ``max_restarts``
  within the window; past that ``up`` stops and exits non-zero). It rebinds the same ports and
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
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from launcher.config import DeployConfig
from launcher.plan.placement import WorkerSpec
from launcher.supervise.admin_client import AdminClient, AdminError  # noqa: F401 (AdminError: the CLI's import)
from launcher.supervise.launch import WorkerLaunch
from router.admin_protocol import Exited, Started, WorkerInfo, WorkerState
from worker.contract.env import PARENT_ENV, SECRET_ENVS

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0
SYNC_INTERVAL_S = 1.0  # how often the supervisor reads the router's worker table
TERM_TIMEOUT_S = 10.0  # SIGTERM → SIGKILL


class WorkerStartError(Exception):
    """A worker slot cannot be started at all (no node has room for it, say): the slot is marked
    ``failed`` with this message as the reason instead of being retried."""


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
    recent = tuple(t for t in previous if now - t <= window_s) + (now,)
    if len(recent) > max_restarts:
        return CrashVerdict(recent, True, 0.0)
    return CrashVerdict(recent, False, min(max_backoff_s, backoff_s * 2 ** (len(recent) - 1)))


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


@dataclass
class Slot:
    """One worker slot: its placement, current process and crash history."""

    spec: WorkerSpec
    proc: subprocess.Popen | None = None
    crashes: tuple[float, ...] = ()
    restart_at: float | None = None
    failed: bool = False
    starts: int = 0  # processes started; restarts = starts - 1
    started_at: float = 0.0
    ever_ready: bool = False
    ready_pid: int = 0  # the last process the router showed ready (it re-registers after a router restart)
    last_exit: str = ""
    kill_reason: str = ""  # why the supervisor killed it, if it did

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def where(self) -> str:
        """Where its current process runs: the handle's own label (a Ray node) or the placement's."""
        return getattr(self.proc, "label", "") or self.spec.label


class Supervisor:
    """Owns every child process of one deployment.

    Test seams: ``clock`` (monotonic seconds), :meth:`_pause` (sleeps), :meth:`_spawn` (makes a
    process) and ``admin`` (the router's admin API) can be replaced, as ``tests/unit/test_supervisor_process_table.py`` does.
    """

    def __init__(
        self,
        cfg: DeployConfig,
        specs: list[WorkerSpec],
        model_path: Path,
        run_dir: Path,
        address: str,
        clock: Callable[[], float] = time.monotonic,
        child_env: dict[str, str] | None = None,
        backend=None,
    ):
        self.cfg = cfg
        self.backend = backend  # None: local processes; else an object with spawn_worker(spec, launch)
        self.child_env = dict(child_env or {})  # added to every router and worker (the CURVE keys' folder)
        self.model_path = model_path
        self.run_dir = run_dir
        self.address = address
        self.clock = clock
        # each child reads only its own role's settings: no router secret reaches a worker's file
        self.router_settings_path = run_dir / "router.json"
        self.router_settings_path.write_text(cfg.router_settings().model_dump_json())
        self.worker_settings_path = run_dir / "worker.json"
        self.worker_settings_path.write_text(cfg.worker_settings().model_dump_json())
        self.slots = {s.worker_id: Slot(s) for s in specs}
        self.router: subprocess.Popen | None = None  # None while a dead router waits for its restart
        self.router_starts = 0  # router processes started; its restarts = starts - 1
        self.router_crashes: tuple[float, ...] = ()
        self.router_restart_at: float | None = None
        self.router_answering = False  # the current router process has answered its admin API
        self.standby: subprocess.Popen | None = None  # a loaded router waiting to take over
        self.standby_enabled = False  # set once serving: a standby must not slow the workers' start
        self._standby_at = 0.0  # when a standby may be started (after one died)
        self.admin = AdminClient(cfg.router.admin_url, cfg.router.admin_token)
        self.stopping = False
        self._next_sync = 0.0
        self._sync_failing = False  # the last table read failed (warned once per outage)

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
        per outage: without it no hung worker is killed and no requested start happens)."""
        try:
            table = self.admin.table()
        except (OSError, ValueError) as exc:
            if not self._sync_failing:
                log.warning("cannot read the router's worker table (%s); retrying every %.0fs", exc, SYNC_INTERVAL_S)
            self._sync_failing = True
            return None
        if self._sync_failing:
            log.info("the router's worker table is readable again")
        self._sync_failing = False
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

    def _router_args(self) -> list[str]:
        return [
            "-m",
            "router.main",
            "--config",
            str(self.router_settings_path),
            "--model-path",
            str(self.model_path),
            "--address",
            self.address,
        ]

    def start_router(self) -> None:
        """Start a router on the configured ports and ZeroMQ address (the same every time): the
        standby takes over when there is one (it has loaded already), else a new process."""
        self.router_starts += 1
        self.router_answering = False
        restarts = self.router_starts - 1
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
        self.router = self._spawn([*self._router_args(), "--restarts", str(restarts)], self.child_env)
        log.info("router started (pid %d)%s", self.router.pid, f", restart {restarts}" if restarts else "")

    def keep_standby(self) -> None:
        """With ``supervisor.router_standby``, keep one standby router loaded beside the serving one
        (so a restart takes a moment, not the seconds of importing and loading the tokenizer)."""
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
        if self.standby is None and now >= self._standby_at:
            self.standby = self._spawn([*self._router_args(), "--standby"], self.child_env, stdin_pipe=True)
            log.info("standby router started (pid %d)", self.standby.pid)

    def start_worker(self, wid: int) -> None:
        slot = self.slots[wid]
        spec = slot.spec
        launch = WorkerLaunch.for_slot(spec, self.worker_settings_path, self.model_path, self.address, self.child_env)
        slot.restart_at, slot.kill_reason = None, ""
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
        self._report(wid, Started(pid=slot.proc.pid, restarts=slot.starts - 1, device=label))

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
        deployment: :meth:`sync` kills it and it is restarted like any other.
        """
        deadline = self.clock() + timeout
        while not stop_requested():
            self.poll_once(sync=False)
            table = self.sync() or {}
            for wid, info in table.items():
                if wid in self.slots and info.state == WorkerState.READY:
                    self.slots[wid].ever_ready = True
            pending = [
                wid
                for wid, s in self.slots.items()
                if not s.failed and (wid not in table or table[wid].state != WorkerState.READY)
            ]
            if not any(s.ever_ready for s in self.slots.values()) and all(s.last_exit for s in self.slots.values()):
                exits = "; ".join(f"worker {wid}: {s.last_exit}" for wid, s in self.slots.items())
                raise RuntimeError(f"every worker exited during start-up ({exits}); see their logs above")
            if not pending:
                return
            if self.clock() > deadline:
                late = ", ".join(map(str, pending))
                if any(s.ever_ready for s in self.slots.values()):
                    # Others serve: the late one is killed and restarted like any hung worker (sync).
                    log.warning(
                        "worker(s) %s not ready within %.0fs (workers.startup_timeout_s); serving without "
                        "them while they are restarted",
                        late,
                        timeout,
                    )
                    return
                raise RuntimeError(f"worker(s) {late} not ready within {timeout:.0f}s (workers.startup_timeout_s)")
            self._pause(pause_s)

    def _pause(self, seconds: float) -> None:
        time.sleep(seconds)

    def poll_once(self, sync: bool = True) -> None:
        """One supervision step: watch the router, reap exits, restart what is due, read the
        router's table once a second. Raises RuntimeError when the router is given up on."""
        if not self.stopping:
            self.watch_router()
        self.reap()
        now = self.clock()
        for wid, slot in self.slots.items():
            if (
                not self.stopping
                and not slot.failed
                and slot.proc is None
                and slot.restart_at is not None
                and now >= slot.restart_at
            ):
                self.start_worker(wid)
        if sync and now >= self._next_sync and self.router_answering:
            self._next_sync = now + SYNC_INTERVAL_S
            self.sync()

    def watch_router(self) -> None:
        """Restart a dead router under the workers' crash rules (:func:`judge_crash`); once the
        new one answers, report every worker to it. The workers keep running and re-register.
        Raises RuntimeError when the router crashed more than ``max_restarts`` times in the window."""
        now, sup = self.clock(), self.cfg.supervisor
        if self.router is not None and self.router.poll() is not None:
            code, pid = self.router.returncode, self.router.pid
            self.router, self.router_answering = None, False
            verdict = judge_crash(
                self.router_crashes, now, sup.restart_window_s, sup.max_restarts, sup.restart_backoff_s
            )
            self.router_crashes = verdict.recent
            if verdict.failed:
                raise RuntimeError(
                    f"the router (pid {pid}) {describe_exit(code)}; {len(verdict.recent)} crashes "
                    f"within {sup.restart_window_s:.0f}s (supervisor.max_restarts): giving up"
                )
            self.router_restart_at = now + verdict.delay_s
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
        if self.router is None and self.router_restart_at is not None and now >= self.router_restart_at:
            self.router_restart_at = None
            self.start_router()
        if self.router is not None and not self.router_answering:
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
                self._report(wid, Started(pid=slot.proc.pid, restarts=slot.starts - 1, device=slot.where()))
            elif slot.last_exit:
                self._report(wid, Exited(reason=slot.last_exit, failed=slot.failed))
        log.info(
            "router (pid %d) answers; reported %d running worker(s), which re-register without restarting",
            self.router.pid,
            running,
        )

    def reap(self) -> None:
        """Handle every worker process that has exited: report it, then schedule a restart or give up."""
        sup = self.cfg.supervisor
        for wid, slot in self.slots.items():
            if slot.proc is None or slot.proc.poll() is None:
                continue
            code, pid = slot.proc.returncode, slot.proc.pid
            rank = getattr(slot.proc, "exited_rank", None)  # a tensor-parallel slot: which rank took it down
            why = getattr(slot.proc, "exit_reason", "")  # a backend's handle may know more (a node that left)
            slot.proc = None
            now = self.clock()
            detail = slot.kill_reason or why
            reason = describe_exit(code) + (f" ({detail})" if detail else "")
            if rank is not None and slot.spec.tp > 1:
                reason = f"rank {rank} {reason}"
            slot.last_exit = reason
            failed = False
            if self.stopping:
                log.info("worker %d (pid %d) stopped: %s", wid, pid, reason)
            elif code == 0:
                log.info("worker %d (pid %d) exited on request; starting it again", wid, pid)
                slot.restart_at = now
            else:
                verdict = judge_crash(slot.crashes, now, sup.restart_window_s, sup.max_restarts, sup.restart_backoff_s)
                slot.crashes, failed = verdict.recent, verdict.failed
                if failed:
                    slot.failed = True
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
                    slot.restart_at = now + verdict.delay_s
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
            self._report(wid, Exited(reason=reason, failed=failed, pid=pid))

    def sync(self) -> dict[int, WorkerInfo] | None:
        """Read the router's worker table and act on it: start workers an operator asked for, kill
        hung ones (dead to the router but alive here, or still loading after startup_timeout_s)."""
        table = self.read_table() if self.router_answering else None
        if table is None or self.stopping:
            return table
        now = self.clock()
        for wid, w in table.items():
            slot = self.slots.get(wid)
            if slot is None:
                continue
            if w.start_requested and slot.proc is None:
                log.info("worker %d: start requested through the admin API", wid)
                slot.failed, slot.crashes = False, ()
                self.start_worker(wid)
            elif slot.alive() and w.pid == slot.proc.pid and not slot.kill_reason:
                if w.state == WorkerState.READY:
                    slot.ready_pid = w.pid
                elif w.state == WorkerState.DEAD:
                    self._kill(slot, f"hung: {w.exit_reason or 'missed heartbeats'}")
                elif (
                    w.state == WorkerState.STARTING
                    and slot.ready_pid != w.pid  # not re-registering
                    and now - slot.started_at > self.cfg.workers.startup_timeout_s
                ):
                    self._kill(slot, f"not ready after {self.cfg.workers.startup_timeout_s:.0f}s")
        return table

    def _kill(self, slot: Slot, why: str) -> None:
        log.error("worker %d (pid %d) is %s; killing it", slot.spec.worker_id, slot.proc.pid, why)
        slot.kill_reason = why
        slot.proc.kill()

    def run(self, stop_requested: Callable[[], bool]) -> int:
        """Supervise until ``stop_requested()`` is true; then shut down. Returns the exit code."""
        code = 0
        self.standby_enabled = True
        try:
            while not stop_requested():
                self.poll_once()
                time.sleep(0.2)
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
