"""What the router's handlers share: the deployment's config, the worker pool, the tokenizer and
what is derived from it once (grammar checker, token texts), under one aiohttp ``AppKey``."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from aiohttp import web

from router.settings import RouterSettings
from router.shaping import TokenTexts
from router.structured import GrammarChecker
from router.tools import template_has_tools
from router.workers import WorkerPool


@dataclass
class Api:
    """What the handlers share: config, worker pool and the model's tokenizer."""

    cfg: RouterSettings
    pool: WorkerPool
    tokenizer: Any
    metrics: Any = None  # router.metrics.Metrics, made by the app factory
    task: str = "generate"  # what the model is served for (worker.contract.tasks.resolve_task)
    embed_spec: Any = None  # worker.contract.embed_spec.EmbedSpec of an embedding model

    @property
    def model_name(self) -> str:
        return self.cfg.model.public_name

    @property
    def max_prompt_tokens(self) -> int:
        return self.cfg.limits.max_prompt_tokens or self.cfg.model.max_model_len - 1

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


API = web.AppKey("api", Api)
REQUEST_ID = web.RequestKey("request_id", str)  # the request's X-Request-ID (client's or made), set first
