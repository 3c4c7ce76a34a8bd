"""The router's table of workers and their states, fed by the workers' messages and the
supervisor's reports; the front (:class:`WorkerPool`) of the router's dispatch.

The pool is made of small objects, each the only writer of its own state: this module's table of
slots (:class:`~router.slot.Worker`: state, what each worker reported), the ledger of requests in
flight (:mod:`router.ledger`: load accounting), the routing (:mod:`router.routing`: the policy in
force, which owns its own state, :mod:`router.policies`), the event log (:mod:`router.events`) and
the hold queue (:mod:`router.hold`).

Every message from a worker arrives through the ZeroMQ link (:mod:`router.worker_link`, which
checks sender and schema) at :meth:`WorkerPool.on_message`, which updates the table (``Hello``,
``Ready``, ``Heartbeat``, ``Bye``) and routes ``Tokens``/``Failed`` to the request's one record,
:class:`RouterRequest` (held by the worker that owns it), whose queue the HTTP handler waits on.
The launcher's supervisor reports each process start (pid, restart count) and exit at once
through the admin API; as a fallback, a watchdog declares a
worker dead after ``heartbeat_timeout_s`` of silence, or after ``stall_timeout_s`` with work and no
engine step while it still heartbeats (its engine loop is stuck: a hung CUDA call, a deadlock);
the supervisor then kills the hung process, and its requests move to other workers.

Worker states: ``starting → ready ⇄ draining → stopped``; any state ``→ dead`` (process gone or
silent) ``→ starting`` (the supervisor started it again) or ``→ failed`` (the supervisor gave up).
Only ``ready`` workers receive new requests; a worker still loading its model is ``starting``.

After a router restart the table starts empty: the supervisor reports every running process
again, and a worker that sends anything before this router has had its ``Hello`` is asked to
``Identify`` (it answers ``Hello`` and ``Ready`` with its model still loaded). Tokens of requests
this router does not know (in flight at the crash) get a ``Cancel``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
import uuid
from collections.abc import Callable

import zmq
import zmq.asyncio

from router.admin_protocol import (
    HAS_NO_PROCESS,
    Exited,
    RouterInfo,
    Started,
    StartRequested,
    SupervisorEvent,
    WorkerDown,
    WorkerReady,
    WorkerTable,
)
from router.errors import ApiError
from router.events import EventLog
from router.hold import HoldQueue
from router.ledger import Ledger
from router.policies.base import Policy
from router.routing import NoWorker, Overloaded, Routing
from router.slot import RouterRequest, State, Worker, WorkerLost
from router.worker_link import WorkerLink
from worker.contract.keys import ServerKeys
from worker.contract.protocol import (
    PROTOCOL_VERSION,
    Bye,
    Cancel,
    Embedded,
    EngineLoad,
    Failed,
    Generate,
    Heartbeat,
    Hello,
    Identify,
    Ready,
    Shutdown,
    Tokens,
    worker_identity,
)

log = logging.getLogger(__name__)

IDENTIFY_EVERY_S = 1.0  # how often an unregistered worker is asked to say Hello again
MAX_ORPHANS = 4096  # request ids of unknown requests already cancelled (remembered to cancel once)
REPORT_GRACE_S = 30.0  # a new router expects the supervisor's reports of its workers within this

__all__ = ["NoWorker", "Overloaded", "RouterRequest", "State", "Worker", "WorkerLost", "WorkerPool"]


class WorkerPool:
    """The worker table and the request queues of one router, with its link to the workers
    (``curve``: the workers' CURVE keys, for any address but ``ipc://``; :mod:`worker.contract.keys`)."""

    def __init__(
        self,
        address: str,
        policy: str,
        heartbeat_timeout_s: float,
        restarts: int = 0,
        stall_timeout_s: float = 30.0,
        curve: ServerKeys | None = None,
        model_timeouts: dict[str, tuple[float, float]] | None = None,
    ):
        self.address = address
        self.routing = Routing(policy)  # which worker gets a request: the policy in force
        self.ledger = Ledger()  # the requests in flight, each worker's load
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.model_timeouts = model_timeouts or {}  # served name -> (heartbeat, stall) s: see timeouts
        self.router = RouterInfo(pid=os.getpid(), restarts=restarts)  # this router process
        self._router_started = time.time()
        self._asked: dict[int, float] = {}  # worker id -> when it was last asked to Identify
        self._orphans: collections.OrderedDict[str, None] = collections.OrderedDict()  # cancelled unknown ids
        self._posting: set[asyncio.Task] = set()
        self.workers: dict[int, Worker] = {}
        self.accepting = True
        self.link = WorkerLink(address, self.on_message, curve)
        self._tasks: list[asyncio.Task] = []
        self._changed = asyncio.Event()  # set (and replaced) on every change: see wait_change
        self.tell_supervisor: Callable[[SupervisorEvent], None] = lambda event: None  # its event channel
        self.events = EventLog()  # recent state changes, starts and migrations, for the status page
        self.hold = HoldQueue()  # requests waiting for a replica of their model (router.hold)
        self._seen_models: set[str] = set()  # models some slot of which this router has been told of

    @property
    def ctx(self) -> zmq.asyncio.Context:
        return self.link.ctx

    async def start(self) -> None:
        """Bind the workers' socket and start watching heartbeats."""
        await self.link.start()
        self._tasks = [asyncio.create_task(self._watchdog(), name="heartbeat-watchdog")]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.link.close()

    # ---- dispatch ---------------------------------------------------------------------

    def ready_workers(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.state == State.READY]

    def fingerprint(self, worker_id: int | None = None, model: str | None = None) -> str:
        """The ``system_fingerprint`` of worker ``worker_id`` when it is known, else that of a ready
        replica of ``model`` (None: any); "" when there is none (replicas of one revision share one)."""
        if worker_id is not None and (w := self.workers.get(worker_id)) is not None and w.fingerprint:
            return w.fingerprint
        return next((w.fingerprint for w in self.ready_workers() if model is None or w.model == model), "")

    def pick(
        self,
        exclude: set[int] = frozenset(),
        admitting: bool = True,
        prompt: list[int] | None = None,
        model: str | None = None,
    ) -> Worker:
        """Choose a ready worker with room by policy. Raises ``NoWorker`` (503) or ``Overloaded`` (429).

        ``admitting`` is false for the retry of a request already accepted, which is served even
        while the server shuts down; ``prompt`` (token ids) lets the policy prefer a worker whose
        prefix cache likely holds it; ``model`` (a served name) limits the choice to its replicas,
        under that model's own rotation (None: any worker, one deployment's only model)."""
        if admitting and not self.accepting:
            raise NoWorker("the server is shutting down")
        return self.routing.pick(self.workers.values(), exclude, prompt, model)

    def expects(self, model: str | None) -> bool:
        """A replica of ``model`` (None: any worker) is ready or expected to become ready: some slot
        of it is not ``failed`` (starting, restarting, draining to be replaced...), or this router
        is younger than :data:`REPORT_GRACE_S` and has not been told of any slot of it yet (a start
        in progress). False once every slot of the model has failed or been removed."""
        mine = [w for w in self.workers.values() if model is None or w.model == model]
        if not mine:
            told = self._seen_models if model is None else model in self._seen_models
            return not told and time.time() - self._router_started < REPORT_GRACE_S
        return any(w.state != State.FAILED for w in mine)

    def model_state(self, model: str | None) -> str:
        """``ready`` (a replica of ``model`` takes requests), ``loading`` (none does, one is expected:
        requests are held) or ``unavailable`` (none is expected: requests get 503 at once)."""
        if any(w.state == State.READY and (model is None or w.model == model) for w in self.workers.values()):
            return "ready"
        return "loading" if self.expects(model) else "unavailable"

    def stop_accepting(self) -> None:
        """Refuse new requests from now on (shutting down); held ones are answered at once."""
        self.accepting = False
        self.notify()

    @property
    def policy(self) -> Policy:
        """The routing policy in force (:meth:`Routing.set_policy <router.routing.Routing.set_policy>` changes it)."""
        return self.routing.policy

    def register(self, worker: Worker, request_id: str) -> RouterRequest:
        """Count ``request_id`` against ``worker`` at once (:meth:`Ledger.register
        <router.ledger.Ledger.register>`); the caller must :meth:`finish` it on every path."""
        return self.ledger.register(worker, request_id)

    async def send_generate(self, req: RouterRequest, gen: Generate) -> None:
        """Send a registered request; an unreachable worker puts :class:`WorkerLost` on its queue."""
        wid = req.worker.worker_id
        self.routing.dispatched(req, gen.prompt_token_ids)
        try:
            await self._send(wid, gen)
        except zmq.ZMQError:
            req.events.put_nowait(WorkerLost(f"worker {wid} is unreachable", "unreachable"))

    async def send(self, req: RouterRequest, msg) -> None:
        """Send a registered request's message (an ``Embed``); raises ``zmq.ZMQError`` when its
        worker is not connected."""
        await self._send(req.worker.worker_id, msg)

    async def cancel(self, req: RouterRequest) -> None:
        """Tell the owning worker to stop the request (no-op if it is gone)."""
        if req.worker.state not in (State.DEAD, State.FAILED):
            try:
                await self._send(req.worker.worker_id, Cancel(request_id=req.request_id))
            except zmq.ZMQError:
                pass

    def finish(self, req: RouterRequest, ok: bool) -> None:
        """Release the request: on every ending path (done, error, cancel, timeout, loss)."""
        if self.ledger.finish(req, ok):
            self.routing.finished(req)
            self.notify()

    def owner_of(self, request_id: str) -> RouterRequest | None:
        """The record of ``request_id``, whichever worker holds it (None: not in flight)."""
        return self.ledger.owner_of(request_id)

    async def wait_change(self, timeout_s: float) -> None:
        """Return at the next change of any worker's state or load (a state set, a request
        finished), or after ``timeout_s``: what waiting for a worker awaits instead of polling."""
        changed = self._changed
        try:
            await asyncio.wait_for(changed.wait(), timeout=max(0.0, timeout_s))
        except TimeoutError:
            pass

    def notify(self) -> None:
        """Wake every :meth:`wait_change` (a fresh event each time: no waiter misses a change)."""
        self._changed.set()
        self._changed = asyncio.Event()

    @staticmethod
    def new_request_id() -> str:
        return f"req-{uuid.uuid4().hex}"

    # ---- operations -------------------------------------------------------------------

    def table(self) -> WorkerTable:
        """The worker table as the admin API serves it (slots by id)."""
        router = RouterInfo(
            pid=self.router.pid, restarts=self.router.restarts, uptime_s=round(time.time() - self._router_started, 1)
        )
        return WorkerTable(
            policy=self.routing.name,
            accepting=self.accepting,
            router=router,
            workers=[w.report() for w in sorted(self.workers.values(), key=lambda w: w.worker_id)],
        )

    def get(self, worker_id: int) -> Worker:
        if worker_id not in self.workers:
            raise ApiError(404, f"no worker {worker_id}", param="worker_id", code="worker_not_found")
        return self.workers[worker_id]

    async def drain(self, worker_id: int, timeout_s: float) -> bool:
        """Stop routing to the worker and wait for its in-flight requests; True if it emptied in time."""
        w = self.get(worker_id)
        if w.state == State.READY:
            self._set(w, State.DRAINING)
        return await self.wait_idle([w], timeout_s)

    async def wait_idle(self, workers: list[Worker], timeout_s: float) -> bool:
        """Wait until none of ``workers`` has a request in flight; False if ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        while any(w.in_flight for w in workers):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            await self.wait_change(left)
        return True

    def undrain(self, worker_id: int) -> None:
        w = self.get(worker_id)
        if w.state == State.DRAINING:
            self._set(w, State.READY)

    def request_start(self, worker_id: int) -> bool:
        """Ask the supervisor (an event on its channel) to start a worker that has no process:
        ``failed``, ``dead`` or ``stopped``. Returns False when it has one. ``start_requested``
        shows in the table until the supervisor answers with its report (:meth:`on_report`)."""
        w = self.get(worker_id)
        if w.state not in HAS_NO_PROCESS:
            return False
        w.start_requested = True
        self.tell_supervisor(StartRequested(worker_id=worker_id))
        return True

    def on_report(self, worker_id: int, report: Started | Exited) -> None:
        """The supervisor's report on a slot: a process started, or one ended (``failed``: given
        up on). A start, or a start that failed, answers a requested start: the one place its flag
        is cleared."""
        if isinstance(report, Started):
            self.on_started(worker_id, report.pid, report.restarts, report.device, report.model)
            self.workers[worker_id].revision = report.revision
        else:
            self.mark_lost(worker_id, report.reason, failed=report.failed)
            if report.removed and not self.workers[worker_id].requests:
                del self.workers[worker_id]  # retired by a rollout: no slot left to show
                self.notify()
                return
        if isinstance(report, Started) or report.failed:
            self.workers[worker_id].start_requested = False

    def on_started(self, worker_id: int, pid: int, restarts: int, device: str, model: str = "") -> None:
        """The supervisor started a process for this slot (before it says Hello)."""
        w = self.workers.setdefault(worker_id, Worker(worker_id, device=device))
        w.restarts = restarts
        w.model = model or w.model
        self._seen_models.add(w.model)
        if w.pid != pid:
            if w.requests:  # the old process died without us hearing of it
                self.mark_lost(worker_id, "replaced by a new process", kind="replaced")
            w.pid, w.load = pid, None
            self.events.process_started(worker_id, pid, restarts)
            self.routing.worker_gone(worker_id)  # a new process: its prefix cache is empty
            self._set(w, State.STARTING)

    async def shutdown_worker(self, worker_id: int, reason: str) -> None:
        """Ask the worker process to exit (code 0); the supervisor restarts it if it should."""
        try:
            await self._send(worker_id, Shutdown(reason=reason))
        except zmq.ZMQError:
            pass

    def mark_lost(self, worker_id: int, reason: str, failed: bool = False, kind: str = "exited") -> None:
        """The worker process is gone, silent or stalled (or given up on): its in-flight requests
        get :class:`WorkerLost` (``kind`` is its label) and move elsewhere. ``dead`` is told to
        the supervisor (:class:`~router.admin_protocol.WorkerDown`), which kills the process if
        it still runs."""
        w = self.workers.setdefault(worker_id, Worker(worker_id))
        w.exit_reason, w.load = reason, None  # its last load report no longer holds
        if failed:
            self._set(w, State.FAILED)
        elif w.state not in (State.FAILED, State.STOPPED) or w.requests:  # a clean exit after Bye stays "stopped"
            self._set(w, State.DEAD)
            self.tell_supervisor(WorkerDown(worker_id=worker_id, pid=w.pid, reason=reason))  # alive there: hung
        self.routing.worker_gone(worker_id)  # its prefix cache went with its process
        for req in list(w.requests.values()):
            req.events.put_nowait(WorkerLost(f"worker {worker_id} was lost ({reason})", kind))

    # ---- internals --------------------------------------------------------------------

    def _set(self, w: Worker, state: State) -> None:
        if w.state != state:
            log.info("worker %d: %s -> %s", w.worker_id, w.state.value, state.value)
            self.events.state_changed(w.worker_id, w.state, state, w.exit_reason, w.load_seconds)
            w.state = state
            self.notify()
            if state == State.READY:
                self.tell_supervisor(WorkerReady(worker_id=w.worker_id, pid=w.pid))

    async def _send(self, worker_id: int, msg) -> None:
        await self.link.send(worker_id, msg)

    def on_message(self, wid: int, msg) -> None:
        """A schema-checked message from the peer with identity ``worker-<wid>`` (the link checked
        both): route request events to their owner, update the table; drop what the sender may not say."""
        if isinstance(msg, (Tokens, Embedded, Failed)):
            sender = self.workers.get(wid)
            if sender is not None and (req := sender.requests.get(msg.request_id)) is not None:
                req.events.put_nowait(msg)
            elif self.owner_of(msg.request_id) is not None:
                log.warning(
                    "dropped %s for %s from worker %d, which does not own it", type(msg).__name__, msg.request_id, wid
                )
            elif isinstance(msg, Tokens) and msg.finish_reason is None:
                self._cancel_orphan(wid, msg.request_id)
            return  # else: a late event of a request already finished or cancelled
        if getattr(msg, "worker_id", wid) != wid:
            log.warning(
                "dropped %s claiming worker %s from identity %r",
                type(msg).__name__,
                msg.worker_id,
                worker_identity(wid),
            )
            return
        if isinstance(msg, Hello) and msg.protocol != PROTOCOL_VERSION:
            log.warning("dropped Hello of worker %d: protocol %d, expected %d", wid, msg.protocol, PROTOCOL_VERSION)
            return
        self._on_control(wid, msg)

    def _post(self, worker_id: int, msg) -> None:
        """Send ``msg`` from synchronous code (frame handling) without waiting for it."""
        try:
            task = asyncio.get_running_loop().create_task(self._send(worker_id, msg))
        except RuntimeError:  # no event loop: frames handled outside one (unit tests) send nothing
            return
        self._posting.add(task)
        task.add_done_callback(self._posting.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # a ZMQError here is not worth a trace

    def _ask_identify(self, wid: int) -> None:
        """A worker this router has not heard Hello from (it restarted): ask it, at most once a second."""
        now = time.monotonic()
        if now - self._asked.get(wid, -IDENTIFY_EVERY_S) >= IDENTIFY_EVERY_S:
            self._asked[wid] = now
            log.info("worker %d is not registered with this router: asking it to identify", wid)
            self._post(wid, Identify())

    def _cancel_orphan(self, wid: int, request_id: str) -> None:
        """Tokens for a request this router does not know (it was in flight when the router
        restarted): tell the worker to stop it, once."""
        if request_id in self._orphans:
            return
        self._orphans[request_id] = None
        if len(self._orphans) > MAX_ORPHANS:
            self._orphans.popitem(last=False)
        log.info("cancelling %s on worker %d: no client waits for it", request_id, wid)
        self._post(wid, Cancel(request_id=request_id))

    def _on_control(self, wid: int, msg) -> None:
        w = self.workers.get(wid)
        if isinstance(msg, Hello):
            self._on_hello(wid, w, msg)
            return
        if w is None or not w.registered:
            self._ask_identify(wid)  # a heartbeat (or Ready) from before this router's time
            if w is None or isinstance(msg, Ready):
                return  # a Ready counts only after this router's Hello
        w.last_seen = time.monotonic()
        if isinstance(msg, Ready):
            self._on_ready(w, msg)
        elif isinstance(msg, Heartbeat):
            self._on_heartbeat(w, msg.load)
        elif isinstance(msg, Bye):
            w.exit_reason = msg.reason
            self._set(w, State.STOPPED)

    @staticmethod
    def _on_heartbeat(w: Worker, load: EngineLoad) -> None:
        """The worker's load report: an engine step since the last one (or no work) is progress."""
        if not w.busy or w.load is None or load.steps != w.load.steps:
            w.progress_at, w.progress_cpu_s = w.last_seen, load.cpu_s
        w.load = load
        w.heartbeats += 1

    def _on_hello(self, wid: int, w: Worker | None, msg: Hello) -> None:
        """A worker process introduces itself (a new one, or one re-registering): ``starting``."""
        if w is None:
            w = self.workers[wid] = Worker(wid)
        elif w.pid != msg.pid and w.requests:  # the old process died without us hearing of it
            self.mark_lost(wid, "replaced by a new process", kind="replaced")
        # The restart count comes from the supervisor (``on_started``), which also sees the
        # processes that crash before saying Hello; a Hello never counts one.
        w.pid, w.device, w.registered, w.model = msg.pid, msg.device, True, msg.model
        self._seen_models.add(w.model)
        w.max_num_seqs, w.max_waiting = msg.max_num_seqs, msg.max_waiting
        w.node_id, w.node_ip, w.gpu_ids = msg.node_id, msg.node_ip, msg.gpu_ids
        w.started_at, w.last_seen, w.load = time.time(), time.monotonic(), None
        self._set(w, State.STARTING)

    def _on_ready(self, w: Worker, msg: Ready) -> None:
        """The worker's model is loaded and warm: it takes requests (``ready``)."""
        w.kv_budget_tokens, w.load_seconds = msg.kv_budget_tokens, msg.load_seconds
        w.gpu_uuids = list(msg.gpu_uuids)
        w.weight_bytes, w.kernels, w.fingerprint = msg.weight_bytes, list(msg.kernels), msg.fingerprint
        w.block_size = msg.block_size
        if w.state == State.STARTING:
            self._set(w, State.READY)

    def timeouts(self, model: str) -> tuple[float, float]:
        """The (heartbeat, stall) timeouts in seconds a worker of ``model`` (a served name) is
        judged by: its model's own (``model_timeouts``, built from ``RouterSettings.workers_for``),
        else the pool's ``heartbeat_timeout_s`` and ``stall_timeout_s``."""
        return self.model_timeouts.get(model, (self.heartbeat_timeout_s, self.stall_timeout_s))

    async def _watchdog(self) -> None:
        shortest = min([self.heartbeat_timeout_s, *(hb for hb, _ in self.model_timeouts.values())])
        interval = min(1.0, shortest / 4)
        last_tick = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            blocked, last_tick = now - last_tick > 2 * interval, now
            if blocked:  # this loop was blocked: heartbeats may be waiting unread in the socket
                continue
            self.check_workers(now)

    def check_workers(self, now: float) -> None:
        """Declare dead (and fail over the requests of) every ready or draining worker silent for
        its model's heartbeat timeout, or busy without an engine step for its stall timeout
        (:meth:`timeouts`)."""
        for w in list(self.workers.values()):
            if w.state not in (State.READY, State.DRAINING):
                continue
            heartbeat_s, stall_s = self.timeouts(w.model)
            silent = now - w.last_seen
            if silent > heartbeat_s:
                log.warning("worker %d missed heartbeats for %.1fs", w.worker_id, silent)
                self.mark_lost(w.worker_id, f"no heartbeat for {silent:.0f}s", kind="heartbeat_timeout")
            elif w.stalled(now, stall_s):
                stalled = w.stalled_for(now)
                log.warning(
                    "worker %d has had work but no engine step for %.1fs (workers.stall_timeout_s)",
                    w.worker_id,
                    stalled,
                )
                self.mark_lost(w.worker_id, f"stalled: no engine step for {stalled:.0f}s", kind="stalled")
