"""A request's status inside the worker, as vLLM's ``RequestStatus`` and nano-vllm's
``SequenceStatus`` keep it: an enum on the request, written only by :class:`worker.scheduler.Scheduler`."""

from __future__ import annotations

import enum


class RequestStatus(enum.Enum):
    """Where a request stands. ``WAITING``: queued, holds no KV block; ``RUNNING``: admitted, its
    blocks allocated, prefilling or decoding; ``PREEMPTED``: queued again after its blocks were
    freed (it recomputes them when readmitted, its output kept); the ``FINISHED_*`` ones: gone from
    the scheduler, blocks freed — ``STOPPED`` (eos or a stop string), ``LENGTH`` (``max_tokens``),
    ``ABORTED`` (cancelled, expired, or failed by the engine)."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "aborted"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)

    @property
    def waiting(self) -> bool:
        return self in (RequestStatus.WAITING, RequestStatus.PREEMPTED)

    @classmethod
    def for_finish_reason(cls, reason: str) -> RequestStatus:
        """The finished status of an OpenAI ``finish_reason`` (``stop`` or ``length``)."""
        return cls.FINISHED_LENGTH if reason == "length" else cls.FINISHED_STOPPED
