"""The supervisor over a fake process table and a real router worker table (no processes); the
router's events reach it as the msgpack frames of its event channel."""

from __future__ import annotations

import signal

from launcher.config import DeployConfig
from launcher.plan.placement import WorkerSpec
from launcher.supervise.supervisor import Supervisor
from router import admin_protocol
from router.admin_protocol import WorkerTable
from router.workers import WorkerPool
from worker.contract.protocol import PROTOCOL_VERSION, Hello, Ready, encode, worker_identity


class FakeStdin:
    def __init__(self) -> None:
        self.written, self.closed = "", False

    def write(self, text: str) -> None:
        self.written += text

    def close(self) -> None:
        self.closed = True


class FakeProc:
    """What the supervisor uses of ``subprocess.Popen``."""

    def __init__(self, pid: int, args: list[str], stdin: FakeStdin | None = None):
        self.pid, self.args, self.stdin = pid, args, stdin
        self.returncode: int | None = None
        self.signals: list[int] = []

    def poll(self) -> int | None:
        return self.returncode

    def exit(self, code: int) -> None:
        self.returncode = code

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)
        if self.returncode is None:
            self.returncode = -sig

    def wait(self, timeout: float | None = None) -> int:
        return self.returncode


class FakeInbox:
    """The supervisor's event socket: the frames the router pushed, decoded as the real one does."""

    address = "ipc://unused-events"

    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def push(self, event) -> None:
        self.frames.append(admin_protocol.encode_event(event))

    def wait(self, timeout_s: float) -> list:
        frames, self.frames = self.frames, []
        return [admin_protocol.decode_event(f) for f in frames]

    def close(self) -> None:
        pass


INBOX = FakeInbox()  # shared by every router a test makes, as the supervisor's socket is


class PoolAdmin:
    """The admin API, served by a real WorkerPool; every message crosses the JSON contract."""

    def __init__(self, inbox: FakeInbox = INBOX) -> None:
        self.pool = WorkerPool("inproc://unused", "round_robin", heartbeat_timeout_s=10)
        self.pool.tell_supervisor = inbox.push
        self.down = False
        self.base = "http://fake"

    def _check(self) -> None:
        if self.down:
            raise ConnectionRefusedError("connection refused")

    def table(self, timeout: float = 2.0) -> WorkerTable:
        self._check()
        return admin_protocol.decode(admin_protocol.encode(self.pool.table()), WorkerTable)

    def report(self, worker_id: int, msg, timeout: float = 5.0) -> None:
        self._check()
        self.pool.on_report(worker_id, admin_protocol.decode(admin_protocol.encode(msg), type(msg)))

    def try_call(self, method: str, path: str, body=None, timeout: float = 5.0):
        return None if self.down else {}

    def say(self, wid: int, msg) -> None:
        """A frame from worker ``wid`` through the router's real decode path."""
        self.pool.link.dispatch(worker_identity(wid), encode(msg))


class Harness(Supervisor):
    def __init__(self, tmp_path, config: dict | None = None, workers: int = 2, models: list[int] | None = None):
        """``models[i]``: the model (of ``config``'s ``models:``) worker ``i`` serves (default: 0)."""
        base = {
            "workers": {"devices": "cpu", "startup_timeout_s": 60},
            "supervisor": {"restart_backoff_s": 1.0, "max_restarts": 2},
        }
        for section, keys in (config or {}).items():
            base[section] = {**base.get(section, {}), **keys} if isinstance(keys, dict) else keys
        cfg = DeployConfig.model_validate(base)
        models = models or [0] * workers
        specs = [WorkerSpec(worker_id=i, device="cpu", gpus=(), cpus=(i,), model=models[i]) for i in range(workers)]
        self.now = 1000.0
        INBOX.frames.clear()
        super().__init__(cfg, specs, tmp_path, tmp_path, "ipc://unused", clock=lambda: self.now)
        self.admin = PoolAdmin()
        self.procs: list[FakeProc] = []

    def _open_events(self) -> FakeInbox:
        return INBOX

    def _spawn(self, args, env, stdin_pipe=False):
        self.procs.append(FakeProc(1000 + len(self.procs), args, FakeStdin() if stdin_pipe else None))
        return self.procs[-1]

    def _pause(self, seconds: float) -> None:
        self.now += seconds

    def tick(self, seconds: float = 0.0) -> None:
        self.now += seconds
        self.poll_once()

    def proc_of(self, wid: int) -> FakeProc:
        return self.slots[wid].proc

    def ready(self, wid: int) -> None:
        """The worker's process says Hello, then Ready."""
        pid = self.proc_of(wid).pid
        self.admin.say(
            wid,
            Hello(
                protocol=PROTOCOL_VERSION,
                worker_id=wid,
                pid=pid,
                device="cpu",
                model="m",
                max_num_seqs=8,
                max_waiting=8,
            ),
        )
        self.admin.say(wid, Ready(worker_id=wid, load_seconds=1.0, kv_budget_tokens=100))

    def crash(self, wid: int, code: int) -> None:
        """Worker ``wid`` exits with ``code``; then the backoff passes (it is started again if due)."""
        self.proc_of(wid).exit(code)
        self.tick()
        self.tick(31.0)

    def row(self, wid: int):
        return self.admin.pool.workers[wid].report()


def started(tmp_path, **kw) -> Harness:
    sup = Harness(tmp_path, **kw)
    sup.start()
    for wid in sup.slots:
        sup.ready(wid)
    return sup
