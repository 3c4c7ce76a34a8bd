"""What the worker's loop (:func:`worker.main.serve`) needs of an engine: the one interface the chat
engine (:class:`worker.engine.Engine`) and the embedding engine
(:class:`worker.embed.engine.EmbedEngine`) both implement, as vLLM's ``EngineCoreClient`` and
nano-vllm's ``LLMEngine`` offer one surface to their callers. Torch-free."""

from __future__ import annotations

from typing import Protocol

from worker.contract.protocol import EngineLoad, Failed, Msg


class EngineCore(Protocol):
    """One replica's engine, driven by one thread. Methods return the messages to send (tokens,
    vectors, failures); the caller sends them, the engine never does."""

    def submit(self, msg) -> list[Msg]:
        """Queue a request (``Generate`` or ``Embed``); a refusal comes back as ``[Failed]``."""
        ...

    def cancel(self, request_id: str) -> None:
        """Forget a request now, whatever its state; nothing more is sent for it."""
        ...

    @property
    def has_work(self) -> bool:
        """Whether :meth:`step` has anything to do."""
        ...

    def step(self) -> list[Msg]:
        """One iteration of the engine; returns its messages in order."""
        ...

    def last_step(self) -> str:
        """What the last :meth:`step` computed, in words (a slow turn's log line)."""
        ...

    def idle(self) -> None:
        """Called on every turn of the loop, work or not (a tensor-parallel keep-alive)."""
        ...

    def in_flight(self) -> list[str]:
        """Ids of the requests held (the loop fails them over when the worker leaves)."""
        ...

    def stats(self) -> EngineLoad:
        """This engine's figures now (the heartbeat's load); called from the I/O thread."""
        ...


def failed(request_id: str, code: int, message: str, retry_after_s: float | None = None) -> Failed:
    """The ``Failed`` answer to a request: an HTTP ``code``, a message, and when a retry may work."""
    return Failed(request_id=request_id, code=code, message=message, retry_after_s=retry_after_s)
