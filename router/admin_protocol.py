"""The supervisor ↔ router contract: typed messages of the admin API's worker endpoints.

The launcher's supervisor and the router each keep a view of every worker slot; they agree through
these structs only (JSON on the wire, ``msgspec`` on both ends), so a renamed state or key fails
loudly at decode time instead of silently turning off hung-worker kills and restarts.

* ``GET /admin/workers`` (and the public ``GET /workers``) → :class:`WorkerTable`.
* ``POST /admin/workers/{id}/started`` ← :class:`Started` (the supervisor spawned a process).
* ``POST /admin/workers/{id}/exited`` ← :class:`Exited` (a process ended; ``failed`` = given up on).
* Router → supervisor, pushed as they happen on the supervisor's event socket: :class:`WorkerReady`,
  :class:`WorkerDown`, :class:`StartRequested` (:mod:`router.supervisor_events`).

:class:`WorkerState` is the one worker-state enum of the project: the router's table holds it and
the supervisor decides on it. This module must stay import-light (msgspec and the wire protocol
only): both sides import it.
"""

from __future__ import annotations

import enum

import msgspec

from router.rollout_protocol import ApplyRequest
from worker.contract.protocol import EngineLoad, KernelChoice


class WorkerState(str, enum.Enum):
    """A worker slot as the router sees it.

    ``starting → ready ⇄ draining → stopped``; any state ``→ dead`` (process gone, silent or
    stalled) ``→ starting`` (started again) or ``→ failed`` (the supervisor gave up on it).
    """

    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    DEAD = "dead"
    FAILED = "failed"
    STOPPED = "stopped"


HAS_NO_PROCESS = frozenset({WorkerState.FAILED, WorkerState.DEAD, WorkerState.STOPPED})


class WorkerInfo(EngineLoad, kw_only=True, forbid_unknown_fields=False):
    """One row of the worker table: the slot as the router sees it, plus every figure of the
    worker's last heartbeat (the :class:`~worker.contract.protocol.EngineLoad` fields, inherited: a new
    figure there is a new column here; their defaults when there is none)."""

    id: int
    state: WorkerState
    model: str = ""  # the served name of the model it serves
    device: str = ""
    pid: int = 0
    in_flight: int = 0
    served: int = 0
    failed_requests: int = 0
    restarts: int = 0
    uptime_s: float = 0.0
    kv_budget_tokens: int = 0
    max_num_seqs: int = 0
    max_waiting: int = 0
    load_seconds: float = 0.0
    exit_reason: str = ""
    start_requested: bool = False  # an operator asked for a start; the supervisor acts on it
    heartbeats: int = 0
    node_id: str = ""  # the cluster node it runs on ("" when local)
    node_ip: str = ""
    gpu_ids: str = ""  # GPU ids the cluster scheduler assigned ("" when local)
    gpu_uuids: list[str] = msgspec.field(default_factory=list)  # the GPUs the worker's torch sees
    weight_bytes: int = 0  # bytes of the weights its model holds (from its Ready)
    kernels: list[KernelChoice] = msgspec.field(
        default_factory=list
    )  # the kernel table it measured at start (its Ready)
    system_fingerprint: str = ""  # what its answers carry as system_fingerprint (its Ready)
    revision: int = 0  # the deployment's configuration revision its process was started with


class RouterInfo(msgspec.Struct, kw_only=True):
    """The router process itself: ``restarts`` counts the supervisor's restarts of it."""

    pid: int
    restarts: int = 0
    uptime_s: float = 0.0


class WorkerTable(msgspec.Struct, kw_only=True):
    """``GET /admin/workers``: the policy, whether new requests are accepted, every slot by id."""

    policy: str
    accepting: bool
    workers: list[WorkerInfo]
    router: RouterInfo | None = None


class Started(msgspec.Struct, forbid_unknown_fields=True):
    """The supervisor started a process for a slot (before it says Hello)."""

    pid: int
    restarts: int = 0
    device: str = ""
    model: str = ""  # the served name of the slot's model
    revision: int = 0  # the configuration revision it was started with (``llamadeploy apply``)


class Exited(msgspec.Struct, forbid_unknown_fields=True):
    """A slot's process ended (``reason`` as ``killed by SIGKILL``); ``failed``: not restarting it."""

    reason: str = "exited"
    failed: bool = False
    pid: int = 0
    removed: bool = False  # the slot is gone for good (a rollout retired it): drop it from the table


# ---- router -> supervisor: pushed events ---------------------------------------------------


class SupervisorEvent(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """What the router tells the supervisor about slot ``worker_id``, pushed as it happens over
    the supervisor's event socket (ZeroMQ PUSH → PULL, msgpack, tagged by class name): the
    supervisor waits on it instead of reading the worker table."""

    worker_id: int


class WorkerReady(SupervisorEvent):
    """Process ``pid`` of the slot is ready (again, after a router restart)."""

    pid: int


class WorkerDown(SupervisorEvent):
    """The router declared process ``pid`` dead (``reason``: silent, stalled); if it still runs it
    is hung, and the supervisor kills it so that it restarts."""

    pid: int
    reason: str


class StartRequested(SupervisorEvent):
    """An operator asked (admin API) to start the slot, which has no process (failed, dead, stopped)."""


class ApplyRequested(SupervisorEvent):
    """An operator's ``llamadeploy apply`` (``worker_id`` is -1: it is about the deployment)."""

    request: ApplyRequest


Event = WorkerReady | WorkerDown | StartRequested | ApplyRequested

_events_out = msgspec.msgpack.Encoder()
_events_in = msgspec.msgpack.Decoder(Event)


def encode_event(event: SupervisorEvent) -> bytes:
    """One event as its msgpack frame."""
    return _events_out.encode(event)


def decode_event(frame: bytes) -> Event:
    """One event frame. Raises ``msgspec.ValidationError``/``DecodeError`` (both ValueError)."""
    return _events_in.decode(frame)


_json = msgspec.json.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    """JSON bytes of one contract message."""
    return _json.encode(msg)


def decode(body: bytes, type_: type):
    """Decode ``body`` as ``type_``. Raises ``msgspec.ValidationError``/``DecodeError`` (both ValueError)."""
    return msgspec.json.decode(body, type=type_)
