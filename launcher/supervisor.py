"""The supervisor: spawns the router and one process per worker, watches them, restarts them.

* A worker that exits with code 0 was asked to (restart from the admin API): it is started again
  at once. Any other exit is a crash: it is reported to the router (which fails over the worker's
  in-flight requests), and the worker is restarted on the same device after an exponential backoff
  (``restart_backoff_s × 2^(n-1)``, at most 30 s). More than ``max_restarts`` crashes within
  ``restart_window_s`` mark it ``failed``; it is then left down and the others keep serving.
* The router exiting is fatal: everything is stopped and ``up`` exits non-zero.
* Children run in their own session (a terminal's Ctrl-C reaches only the launcher) and get
  ``PR_SET_PDEATHSIG``, so they die with the launcher even if it is killed with SIGKILL.
* :meth:`Supervisor.shutdown` is graceful: the router stops taking requests and waits up to
  ``shutdown_grace_s`` for in-flight ones, then workers and router get SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from launcher.config import DeployConfig
from launcher.placement import WorkerSpec

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0


def _die_with_parent() -> None:
    """preexec_fn: ask Linux to SIGKILL this child when the launcher dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


@dataclass
class Slot:
    """One worker slot: its placement, current process and crash history."""

    spec: WorkerSpec
    proc: subprocess.Popen | None = None
    crashes: deque = field(default_factory=deque)
    restart_at: float | None = None
    failed: bool = False
    restarts: int = 0


class AdminClient:
    """Tiny synchronous client for the router's admin API (loopback)."""

    def __init__(self, base_url: str, token: str | None):
        self.base = base_url.rstrip("/")
        self.token = token

    def call(self, method: str, path: str, body: dict | None = None, timeout: float = 5.0) -> dict:
        data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())

    def try_call(self, method: str, path: str, body: dict | None = None, timeout: float = 5.0) -> dict | None:
        try:
            return self.call(method, path, body, timeout)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            log.debug("admin %s %s failed: %s", method, path, exc)
            return None


class Supervisor:
    """Owns every child process of one deployment."""

    def __init__(self, cfg: DeployConfig, specs: list[WorkerSpec], model_path: Path, run_dir: Path, address: str):
        self.cfg = cfg
        self.model_path = model_path
        self.run_dir = run_dir
        self.address = address
        self.config_path = run_dir / "config.json"
        self.config_path.write_text(cfg.model_dump_json())
        self.slots = {s.worker_id: Slot(s) for s in specs}
        self.router: subprocess.Popen | None = None
        admin_host = "127.0.0.1" if cfg.router.admin_host in ("0.0.0.0", "::", "") else cfg.router.admin_host
        self.admin = AdminClient(f"http://{admin_host}:{cfg.router.admin_port}", cfg.router.admin_token)
        self.stopping = False

    # ---- spawning ---------------------------------------------------------------------

    def _spawn(self, args: list[str], env: dict[str, str]) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, *args], env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
                                start_new_session=True, preexec_fn=_die_with_parent, stdin=subprocess.DEVNULL)

    def start_router(self) -> None:
        self.router = self._spawn(["-m", "router.main", "--config", str(self.config_path), "--model-path",
                                   str(self.model_path), "--address", self.address], {})
        log.info("router started (pid %d)", self.router.pid)

    def start_worker(self, wid: int) -> None:
        slot = self.slots[wid]
        spec = slot.spec
        args = ["-m", "worker.main", "--config", str(self.config_path), "--worker-id", str(wid), "--device",
                spec.device, "--model-path", str(self.model_path), "--address", self.address]
        if spec.cpus:
            args += ["--cpus", ",".join(map(str, spec.cpus))]
        # Set before the child imports torch: the worker sees only its own GPUs ("" hides all on CPU).
        slot.proc = self._spawn(args, {"CUDA_VISIBLE_DEVICES": spec.cuda_visible_devices})
        slot.restart_at = None
        log.info("worker %d started on %s (pid %d)", wid, spec.label, slot.proc.pid)

    def start(self) -> None:
        self.start_router()
        self._wait_router()
        for wid in self.slots:
            self.start_worker(wid)

    def _wait_router(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.router.poll() is not None:
                raise RuntimeError(f"the router exited during start-up ({describe_exit(self.router.returncode)})")
            if self.admin.try_call("GET", "/admin/workers", timeout=1.0) is not None:
                return
            time.sleep(0.2)
        raise RuntimeError(f"the router did not answer on {self.admin.base} within {timeout:.0f}s")

    # ---- watching ---------------------------------------------------------------------

    def wait_ready(self, timeout: float, stop_requested=lambda: False) -> None:
        """Block until every worker is ready (or a stop is requested); raise RuntimeError naming
        the worker that failed first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not stop_requested():
            for wid, slot in self.slots.items():
                code = slot.proc.poll() if slot.proc else None
                if code is not None:
                    raise RuntimeError(f"worker {wid} exited during start-up ({describe_exit(code)}); see its log above")
            if self.router.poll() is not None:
                raise RuntimeError(f"the router exited ({describe_exit(self.router.returncode)})")
            info = self.admin.try_call("GET", "/admin/workers", timeout=2.0)
            states = {w["id"]: w["state"] for w in (info or {}).get("workers", [])}
            if all(states.get(wid) == "ready" for wid in self.slots):
                return
            time.sleep(0.25)
        if stop_requested():
            return
        raise RuntimeError(f"workers not ready within {timeout:.0f}s (workers.startup_timeout_s)")

    def poll_once(self) -> None:
        """Reap exited children, schedule and perform restarts. Raises RuntimeError if the router died."""
        if self.router.poll() is not None and not self.stopping:
            raise RuntimeError(f"the router exited unexpectedly ({describe_exit(self.router.returncode)})")
        now = time.monotonic()
        sup = self.cfg.supervisor
        for wid, slot in self.slots.items():
            if slot.failed or self.stopping:
                continue
            if slot.proc is not None and slot.proc.poll() is not None:
                code = slot.proc.returncode
                slot.proc = None
                if code == 0:
                    log.info("worker %d exited on request; starting it again", wid)
                    slot.restart_at = now
                    slot.restarts += 1
                    continue
                slot.crashes.append(now)
                while slot.crashes and now - slot.crashes[0] > sup.restart_window_s:
                    slot.crashes.popleft()
                reason = describe_exit(code)
                if len(slot.crashes) > sup.max_restarts:
                    slot.failed = True
                    log.error("worker %d %s; %d crashes within %.0fs: marked failed, not restarting",
                              wid, reason, len(slot.crashes), sup.restart_window_s)
                    self.admin.try_call("POST", f"/admin/workers/{wid}/exited", {"reason": reason, "failed": True})
                    continue
                delay = min(MAX_BACKOFF_S, sup.restart_backoff_s * 2 ** (len(slot.crashes) - 1))
                log.warning("worker %d %s; restarting in %.1fs (crash %d of %d allowed)", wid, reason, delay,
                            len(slot.crashes), sup.max_restarts)
                self.admin.try_call("POST", f"/admin/workers/{wid}/exited", {"reason": reason})
                slot.restart_at = now + delay
                slot.restarts += 1
            if slot.proc is None and slot.restart_at is not None and now >= slot.restart_at:
                self.start_worker(wid)

    def run(self, stop_requested) -> int:
        """Supervise until ``stop_requested()`` is true; then shut down. Returns the exit code."""
        code = 0
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

    def shutdown(self) -> None:
        """Graceful stop: drain the router, then SIGTERM children, SIGKILL what is left."""
        self.stopping = True
        grace = self.cfg.supervisor.shutdown_grace_s
        if self.router is not None and self.router.poll() is None:
            log.info("shutting down: refusing new requests, waiting up to %.0fs for in-flight ones", grace)
            self.admin.try_call("POST", f"/admin/shutdown?grace={grace}", timeout=grace + 5)
        workers = [s.proc for s in self.slots.values() if s.proc is not None]
        self._terminate(workers, 10.0)
        if self.router is not None:
            self._terminate([self.router], 10.0)
        log.info("all processes stopped")

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
