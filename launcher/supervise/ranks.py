"""A tensor-parallel worker slot: ``tp`` rank processes started, watched and stopped as one.

Rank 0 runs the normal worker (it alone talks ZeroMQ); ranks 1..N-1 follow it through
``torch.distributed``, rendezvousing at ``--dist-init tcp://127.0.0.1:PORT``, a port picked fresh
for every start of the slot. :class:`RankGroup` has ``subprocess.Popen``'s interface, so the
supervisor's crash rules, drain, hang detection and ``restart-worker`` act on the slot unchanged:
``pid`` is rank 0's (the pid the router shows), and as soon as any rank has exited ``poll()``
reports it and kills the others, since a group missing a rank can only hang in its next
collective. The slot then restarts as a whole, on a new port.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from collections.abc import Callable

from launcher.plan.placement import WorkerSpec
from launcher.plan.ports import free_port
from launcher.supervise.launch import WorkerLaunch

log = logging.getLogger(__name__)

Spawn = Callable[[list[str], dict[str, str]], subprocess.Popen]
REAP_TIMEOUT_S = 5.0  # SIGKILLed ranks are gone within milliseconds; this bounds a process stuck in the kernel
CLEAN_STOP_GRACE_S = 5.0  # followers stopped cleanly: rank 0 is stopping too, and gets this long to finish


class RankGroup:
    """The ``spec.tp`` processes of one tensor-parallel slot, behind Popen's interface.

    :meth:`start` spawns them (each as :meth:`WorkerLaunch.for_rank` says, so each sees only its
    own GPU before torch is imported). ``returncode`` is ``None`` while every rank runs,
    then the exit code of the first rank seen exited (rank 0's when it is among them), and
    ``exited_rank`` says which rank that was.
    """

    def __init__(self, procs: list[subprocess.Popen], dist_init: str):
        self.procs = procs
        self.dist_init = dist_init
        self.returncode: int | None = None
        self.exited_rank: int | None = None
        self._clean_stop_at: float | None = None

    @classmethod
    def start(cls, spec: WorkerSpec, launch: WorkerLaunch, spawn: Spawn) -> RankGroup:
        """Spawn ranks 0..tp-1 of ``launch`` with ``spawn(args, env)``; if one cannot be spawned,
        the ones already started are killed and the error is raised."""
        dist_init = f"tcp://127.0.0.1:{free_port()}"
        procs: list[subprocess.Popen] = []
        try:
            for rank in range(spec.tp):
                one = launch.for_rank(spec, rank, dist_init)
                procs.append(spawn(one.argv(), dict(one.env)))
        except BaseException:
            cls(procs, dist_init).kill()
            raise
        log.info(
            "worker %d: %d ranks (pids %s) meet at %s",
            spec.worker_id,
            spec.tp,
            ", ".join(str(p.pid) for p in procs),
            dist_init,
        )
        return cls(procs, dist_init)

    @property
    def pid(self) -> int:
        return self.procs[0].pid

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def poll(self) -> int | None:
        """``None`` while every rank runs. Once one has exited: its exit code, after the other
        ranks were killed and reaped (the slot is then entirely gone). Followers that exited 0
        were told to stop by rank 0, which is stopping as well: it gets :data:`CLEAN_STOP_GRACE_S`
        to finish (say Bye) before it is killed, and its code is the slot's."""
        if self.returncode is not None:
            return self.returncode
        codes = [p.poll() for p in self.procs]
        exited = [r for r, c in enumerate(codes) if c is not None]
        if not exited:
            return None
        if codes[0] is None and all(codes[r] == 0 for r in exited):
            now = time.monotonic()
            self._clean_stop_at = self._clean_stop_at or now
            if now - self._clean_stop_at < CLEAN_STOP_GRACE_S:
                return None
        self.exited_rank = exited[0]  # rank 0 first when it is among them: its exit says why
        code = codes[self.exited_rank]
        alive = [p for p in self.procs if p.poll() is None]
        if alive:
            log.warning(
                "rank %d (pid %d) of the slot exited (%s); killing ranks with pids %s",
                self.exited_rank,
                self.procs[self.exited_rank].pid,
                code,
                ", ".join(str(p.pid) for p in alive),
            )
        self._kill_and_reap(alive)
        self.returncode = code
        return code

    def wait(self, timeout: float | None = None) -> int:
        """Wait until every rank has exited (after a signal to all of them, each stops on its own);
        returns the slot's exit code as :meth:`poll` chooses it. Raises
        ``subprocess.TimeoutExpired`` when ``timeout`` passes first (then :meth:`kill`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for p in self.procs:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                p.wait(timeout=left)
            except subprocess.TimeoutExpired:
                raise subprocess.TimeoutExpired(f"ranks {self.pids}", timeout) from None
        return self.poll()

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to every rank still running."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL every rank still running (``poll``/``wait`` then reap them)."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()

    @staticmethod
    def _kill_and_reap(procs: list[subprocess.Popen]) -> None:
        for p in procs:
            p.kill()
        for p in procs:
            try:
                p.wait(timeout=REAP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.error("pid %d did not die within %.0fs of SIGKILL", p.pid, REAP_TIMEOUT_S)
