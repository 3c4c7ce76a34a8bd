"""One worker slot as the router sees it (:class:`Worker`, a row of the worker table), one request
attempt on it (:class:`RouterRequest`) and what a request's queue gets when its worker is lost
(:class:`WorkerLost`). The worker table (:mod:`router.workers`) writes a slot's state and what its
worker reported; the ledger (:mod:`router.ledger`) its requests and their counts."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import msgspec

from router.admin_protocol import WorkerInfo, WorkerState
from router.stall import is_stalled, no_step_for
from worker.contract.protocol import EngineLoad

State = WorkerState  # the one worker-state enum, shared with the supervisor (router.admin_protocol)


class WorkerLost(Exception):
    """Put on a request's queue when its worker dies with the request in flight. ``reason`` is a
    bounded label (``exited``, ``heartbeat_timeout``, ``stalled``, ``replaced``, ``unreachable``);
    ``str()`` says what happened."""

    def __init__(self, message: str, reason: str = "exited"):
        super().__init__(message)
        self.reason = reason


@dataclass(eq=False)
class RouterRequest:
    """One attempt of a request on one worker, the router's only record of it: its wire id, the
    worker that owns it (which holds the record in :attr:`Worker.requests` until it is finished)
    and the queue its events (``Tokens``, ``Failed``, :class:`WorkerLost`) go to."""

    request_id: str
    worker: Worker = field(repr=False)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)


@dataclass
class Worker:
    """The router's view of one worker slot (its id survives restarts)."""

    worker_id: int
    state: State = State.STARTING
    model: str = ""  # the served name of its model (the supervisor's Started, then its Hello)
    device: str = ""
    pid: int = 0
    max_num_seqs: int = 1
    max_waiting: int = 0
    kv_budget_tokens: int = 0
    block_size: int = 0  # from its Ready: tokens per KV block of its prefix cache (0: none)
    served: int = 0
    failed_requests: int = 0
    restarts: int = 0
    started_at: float = field(default_factory=time.time)
    last_seen: float = field(default_factory=time.monotonic)
    load_seconds: float = 0.0
    load: EngineLoad | None = None  # from its last heartbeat (None: none since its process started)
    heartbeats: int = 0  # Heartbeat frames accepted from this slot's processes
    requests: dict[str, RouterRequest] = field(default_factory=dict)  # in flight here, by request id
    exit_reason: str = ""  # why its last process ended
    registered: bool = False  # this router process has had a Hello from the slot
    node_id: str = ""  # from its Hello: the cluster node ("" when local)
    node_ip: str = ""
    gpu_ids: str = ""
    gpu_uuids: list[str] = field(default_factory=list)  # from its Ready
    weight_bytes: int = 0  # from its Ready
    kernels: list = field(default_factory=list)  # from its Ready: KernelChoice rows
    fingerprint: str = ""  # from its Ready: its system_fingerprint (worker.contract.fingerprint)
    progress_at: float = field(default_factory=time.monotonic)  # last engine step seen, or last idle moment
    progress_cpu_s: float | None = None  # its process's CPU seconds (EngineLoad.cpu_s) at progress_at

    @property
    def in_flight(self) -> int:
        """Requests the router has sent this worker and not yet finished."""
        return len(self.requests)

    @property
    def busy(self) -> bool:
        """It has work: requests the router sent it, or sequences its last heartbeat reported."""
        load = self.load
        return bool(self.in_flight or (load is not None and (load.running or load.waiting)))

    def stalled_for(self, now: float) -> float:
        """Seconds its engine has had work but made no step, by the router's clock and the worker's
        own (:func:`router.stall.no_step_for`; 0 when it is idle or does not report its steps)."""
        load = self.load
        if load is None or not self.busy or (load.steps is None and load.last_step_age_s is None):
            return 0.0
        return no_step_for(now - self.progress_at, load.last_step_age_s, now - self.last_seen)

    def stalled(self, now: float, timeout_s: float) -> bool:
        """Its engine loop is stuck (:func:`router.stall.is_stalled`): no step for ``timeout_s`` by
        both clocks while its process used next to no CPU, or no step for far longer."""
        load, mark = self.load, self.progress_cpu_s
        cpu = load.cpu_s - mark if load is not None and load.cpu_s is not None and mark is not None else None
        return is_stalled(self.stalled_for(now), cpu, timeout_s)

    start_requested: bool = False  # an operator asked the supervisor to start it (it is failed or dead)
    revision: int = 0  # the configuration revision its process was started with (the supervisor's report)

    @property
    def capacity(self) -> int:
        """Requests this worker may hold at once: its batch plus its waiting queue."""
        return self.max_num_seqs + self.max_waiting

    def report(self) -> WorkerInfo:
        """This slot as one row of the admin API's worker table (every figure of its last load report)."""
        up = self.state in (State.READY, State.DRAINING)
        return WorkerInfo(
            **msgspec.structs.asdict(self.load or EngineLoad()),
            id=self.worker_id,
            model=self.model,
            device=self.device,
            pid=self.pid,
            state=self.state,
            in_flight=self.in_flight,
            served=self.served,
            failed_requests=self.failed_requests,
            restarts=self.restarts,
            uptime_s=round(time.time() - self.started_at, 1) if up else 0.0,
            kv_budget_tokens=self.kv_budget_tokens,
            max_num_seqs=self.max_num_seqs,
            max_waiting=self.max_waiting,
            load_seconds=round(self.load_seconds, 2),
            exit_reason=self.exit_reason,
            start_requested=self.start_requested,
            heartbeats=self.heartbeats,
            node_id=self.node_id,
            node_ip=self.node_ip,
            gpu_ids=self.gpu_ids,
            gpu_uuids=list(self.gpu_uuids),
            weight_bytes=self.weight_bytes,
            kernels=list(self.kernels),
            system_fingerprint=self.fingerprint,
            revision=self.revision,
        )

    def info(self) -> dict:
        """:meth:`report` as plain JSON-ready data."""
        return msgspec.to_builtins(self.report())
