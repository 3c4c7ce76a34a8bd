"""The options of one ``llamadeploy bench`` run, as one frozen dataclass (the CLI builds it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

SUITES = ("engine", "load", "embed", "mixed", "hold")


@dataclass(frozen=True)
class BenchOptions:
    """Everything a run needs; no field is read from anywhere else.

    Shared by both suites: ``base_url`` (an OpenAI-compatible ``/v1`` URL), ``model`` (sent as
    ``model``; None: the first of ``GET /models``), ``ignore_eos`` (send it, so every stream runs to
    ``max_tokens``), ``extra_body`` (merged into every request body, for peer-specific fields),
    ``response_format`` (an OpenAI ``response_format`` object: the engine suite adds a ``json``
    figure with it; the load suite sends it in every request), ``api_key``, ``timeout`` (seconds
    per request), ``label``, ``output`` (writes ``OUTPUT.json`` and ``OUTPUT.png``), ``compare``
    (earlier runs' JSON), ``ceiling`` (the in-process static-batch ceiling) and ``replay`` (an
    earlier run's JSON to print and plot again, against ``compare``, instead of running).

    The engine suite (``suite="engine"``): ``prompts`` short prompts one after another (c1) and all
    at once (burst), a closed loop of ``clients`` clients with ``warmup`` + ``requests`` requests,
    a ``doc_tokens``-token document alone, again, and arriving while ``streams`` chat streams run.
    Short answers are ``output_tokens`` long, the document's answer ``doc_output_tokens``.

    The load suite (``suite="load"``): each of ``scenarios`` at each of ``concurrency``.

    The embed suite (``suite="embed"``, :mod:`launcher.bench.embed_suite`): one-sentence
    ``/v1/embeddings`` requests at each of ``concurrency`` (left at its default: 1, 8 and 64),
    ``requests`` per level (default max(64, 8 × concurrency)), then one request of 512 inputs.

    Chat beside embeddings (``suite="engine"`` with ``embedding_load``, :mod:`launcher.bench.beside`):
    the engine suite's c1 and closed loop alone, then beside ``embedding_load`` closed-loop
    embedding clients of ``embedding_model`` (None: the first embedding model of ``GET /models``).

    The mixed suite (``suite="mixed"``, :mod:`launcher.bench.mixed_suite`): ``pipelines`` pipelines
    ask two structured questions (``answer_tokens`` at most) of each of ``documents`` documents
    beside ``chat_clients`` closed-loop chat clients (``output_tokens`` streamed, default 48), after
    the chat clients alone (``requests`` requests, default 4 per client); ``compare`` may hold peer URLs.

    The hold suite (``suite="hold"``, :mod:`launcher.bench.hold_suite`): the deployment ``config``
    describes (one replica) has its only worker replaced three ways under ``streams`` streaming
    clients and a request loop.
    """

    base_url: str = "http://127.0.0.1:8000/v1"
    suite: str = "engine"
    model: str | None = None
    ignore_eos: bool = True
    extra_body: dict = field(default_factory=dict)
    response_format: dict | None = None
    api_key: str | None = None
    timeout: float = 600.0
    label: str = "llamadeploy"
    output: Path = Path("bench")
    compare: tuple[Path, ...] = ()
    ceiling: bool = False
    replay: Path | None = None
    output_tokens: int | None = None
    requests: int | None = None
    warmup: int | None = None
    # engine suite
    prompts: int = 8
    clients: int = 8
    doc_tokens: int = 1500
    doc_output_tokens: int = 16
    streams: int = 4
    # load suite
    scenarios: tuple[str, ...] = ("long", "chat")
    concurrency: tuple[int, ...] = (1, 8)
    # chat beside embeddings (engine suite)
    embedding_load: int | None = None
    embedding_model: str | None = None
    # documents beside chat (mixed suite)
    pipelines: int = 2
    documents: int = 10
    chat_clients: int = 4
    answer_tokens: int = 160
    # the hold suite: the running deployment's deploy.yaml
    config: Path | None = None

    @property
    def short_output_tokens(self) -> int:
        """Output length of the engine suite's short prompts (64 unless ``output_tokens`` says)."""
        return self.output_tokens or 64

    def closed_loop_counts(self, concurrency: int) -> tuple[int, int]:
        """(warm-up, measured) requests of a closed loop at ``concurrency``."""
        warmup = concurrency if self.warmup is None else self.warmup
        return warmup, self.requests or max(8, 4 * concurrency)

    def public(self) -> dict:
        """The options as JSON-able values, stored in the run's JSON."""
        out = {k: (str(v) if isinstance(v, Path) else v) for k, v in self.__dict__.items() if k != "api_key"}
        out["compare"] = [str(p) for p in self.compare]
        out["replay"] = str(self.replay) if self.replay else None
        return out
