"""The router's state, in two objects: :class:`Api`, what every handler shares for the router's
life (the deployment's settings, the worker pool, the served models, the metrics, the Batch API's
store), under one aiohttp ``AppKey``; and :class:`RequestView`, one request's view of it (the
served model its ``model`` field resolved to and the settings it runs under), made per request by
the ONE function that resolves a request's model, :meth:`Api.for_request`. A view is frozen and
holds no reference to the :class:`Api`: what a request resolves never changes what another sees."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from aiohttp import web

from router.errors import ApiError
from router.settings import RouterSettings
from router.shaping import TokenTexts
from router.structured import GrammarChecker
from router.tools import template_has_tools
from router.workers import WorkerPool
from worker.contract.settings import ModelConfig

GENERATE, EMBED = "generate", "embed"
ENDPOINTS = {GENERATE: "/v1/chat/completions (or /v1/completions, /v1/responses)", EMBED: "/v1/embeddings"}


@dataclass(eq=False)
class ServedModel:
    """One model the deployment serves: its ``model`` section (``task`` resolved by the launcher:
    ``generate`` or ``embed``), its tokenizer, and what is derived from the tokenizer, computed once."""

    config: ModelConfig
    tokenizer: Any
    embed_spec: Any = None  # an embedding model's worker.contract.embed_spec.EmbedSpec (router.served)
    path: str | None = None  # its folder, read again when apply changes its section (router.served)

    @property
    def name(self) -> str:
        return self.config.public_name

    @property
    def task(self) -> str:
        """``generate`` or ``embed`` (``auto`` that reached the router counts as ``generate``)."""
        return EMBED if self.config.task == EMBED else GENERATE

    @cached_property
    def grammar_checker(self) -> GrammarChecker:
        """Compiles ``response_format`` and forced-tool grammars before dispatch (router.structured)."""
        return GrammarChecker(self.tokenizer)

    @cached_property
    def token_texts(self) -> TokenTexts:
        """Each token's bytes, for logprobs."""
        return TokenTexts(list(self.grammar_checker.info.decoded_vocab))

    @cached_property
    def native_tools(self) -> bool:
        """The chat template renders ``tools`` itself (router.tools)."""
        return template_has_tools(self.tokenizer)

    @cached_property
    def longest_token_chars(self) -> int:
        """Characters in the vocabulary's longest token: a text longer than ``n`` times this has
        more than ``n`` tokens, so it can be refused without tokenizing it."""
        return max(map(len, self.tokenizer.get_vocab()), default=1)


@dataclass
class Api:
    """What the handlers share for the router's life: settings, worker pool and the served models.

    ``models``: every served model by name, in deploy.yaml's order (the router's start loads them
    with their tokenizers, :func:`router.serve.load_models`); none given: ``cfg.model`` without a tokenizer (a
    router under test that never tokenizes). Its writers: the app factory (``metrics``,
    ``batches``, at start) and a live apply (``cfg``, ``models``: :mod:`router.rollout`); a request
    reads it through its :class:`RequestView` (:meth:`for_request`) and never writes it."""

    cfg: RouterSettings
    pool: WorkerPool
    metrics: Any = None  # router.metrics.Metrics, made by the app factory
    batches: Any = None  # router.batch.api.Batches (the Batch API's store and runner), made by the app factory
    models: dict[str, ServedModel] = field(default_factory=dict)
    # Unix seconds the deployment started (the supervisor's start, the same for every router it
    # starts): each model's ``created`` in /v1/models; a router on its own uses its own start
    started: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.models:
            one = ServedModel(self.cfg.model, tokenizer=None)
            self.models = {one.name: one}

    @property
    def default_model(self) -> ServedModel:
        """The model a request that names none goes to: the first generate model (else the first)."""
        return self.first(GENERATE)

    def named(self, name: str) -> ServedModel:
        """The served model called ``name``; raises 404 ``model_not_found`` listing the served ones."""
        if (chosen := self.models.get(name)) is None:
            served = "', '".join(self.models)
            raise ApiError(
                404,
                f"The model '{_shown(name)}' does not exist; this server serves '{served}'",
                param="model",
                code="model_not_found",
            )
        return chosen

    def for_request(self, name: str | None, endpoint: str, task: str = GENERATE) -> RequestView:
        """A new view for one request to ``endpoint`` (``/v1/chat/completions``...), an endpoint of
        ``task``, of the model it names; ``name`` None is the first model of that task. Raises 404
        ``model_not_found`` for a name not served, 400 ``wrong_endpoint`` when the model is served
        for the other task (naming the model and the endpoints to use)."""
        chosen = self.first(task) if name is None else self.named(name)
        if chosen.task != task:
            what = "an embedding model" if chosen.task == EMBED else "a generative (chat) model"
            raise ApiError(
                400,
                f"The model '{chosen.name}' is {what}, which {endpoint} does not serve: use {ENDPOINTS[chosen.task]}",
                param="model",
                code="wrong_endpoint",
            )
        # the only model: every worker serves it (a worker's model name may lag a rename), no filter
        pick_model = None if len(self.models) == 1 else chosen.name
        return RequestView(chosen, self.cfg, self.pool, pick_model)

    def first(self, task: str) -> ServedModel:
        """The first served model of ``task``, else the first model (whose task then refuses)."""
        return next((m for m in self.models.values() if m.task == task), next(iter(self.models.values())))

    def model_states(self) -> dict[str, str]:
        """Each served model's state (:meth:`WorkerPool.model_state`: ``ready``, ``loading``,
        ``unavailable``), in deploy.yaml's order."""
        if len(self.models) == 1:  # every worker serves it (a worker's model name may lag a rename)
            return {name: self.pool.model_state(None) for name in self.models}
        return {name: self.pool.model_state(name) for name in self.models}


@dataclass(frozen=True)
class RequestView:
    """One request's view of the router (:meth:`Api.for_request` makes one per request): the served
    ``model`` it resolved to, the settings ``cfg`` it runs under (those in force when it was
    resolved: a live apply mid-request does not change its limits), the ``pool`` that dispatches
    it, and ``pick_model``, what :meth:`WorkerPool.pick` is told (the model's name, or None when it
    is the only one: every worker serves it). ``tokenizer`` and the properties are the model's."""

    model: ServedModel
    cfg: RouterSettings
    pool: WorkerPool = field(repr=False)
    pick_model: str | None

    @property
    def tokenizer(self) -> Any:
        return self.model.tokenizer

    @property
    def model_name(self) -> str:
        return self.model.name

    @property
    def max_model_len(self) -> int:
        return self.model.config.max_model_len

    @property
    def max_prompt_tokens(self) -> int:
        """``limits.max_prompt_tokens``, never over this model's ``max_model_len − 1``: the limits
        are one section for every model, and a prompt must leave room for one generated token."""
        return min(self.cfg.limits.max_prompt_tokens or self.max_model_len, self.max_model_len - 1)

    @property
    def grammar_checker(self) -> GrammarChecker:
        return self.model.grammar_checker

    @property
    def token_texts(self) -> TokenTexts:
        return self.model.token_texts

    @property
    def native_tools(self) -> bool:
        return self.model.native_tools

    @property
    def longest_token_chars(self) -> int:
        return self.model.longest_token_chars


API = web.AppKey("api", Api)
REQUEST_ID = web.RequestKey("request_id", str)  # the request's X-Request-ID (client's or made), set first


def _shown(name: str, most: int = 200) -> str:
    """``name`` as an error message quotes it: at most ``most`` characters (a client's id is echoed, not its payload)."""
    return name if len(name) <= most else f"{name[:most]}... ({len(name)} characters)"
