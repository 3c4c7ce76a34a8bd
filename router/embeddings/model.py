"""The model a request names, as the endpoints need it: its public name, what it is served for,
its tokenizer, its embedding spec and the workers that serve it.

:func:`model_for` is the router's one way to go from a request's ``model`` to that: a deployment
of several models replaces only this function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from router.errors import ApiError
from router.state import Api
from router.workers import WorkerPool
from worker.contract.embed_spec import EmbedSpec

ENDPOINTS = {"generate": "/v1/chat/completions (or /v1/completions, /v1/responses)", "embed": "/v1/embeddings"}


@dataclass(frozen=True)
class ServedModel:
    """One served model: ``task`` is ``generate`` or ``embed``; ``spec`` is set for ``embed``."""

    name: str
    task: str
    tokenizer: Any
    pool: WorkerPool
    spec: EmbedSpec | None
    max_retries: int


def model_for(api: Api, name: str | None, task: str) -> ServedModel:
    """The model ``name`` (None: the deployment's) for an endpoint of ``task``. 404
    ``model_not_found`` when nothing by that name is served; 400 ``wrong_endpoint`` naming the
    model and its endpoint when it is served for the other task."""
    if name is not None and name != api.model_name:
        raise ApiError(
            404,
            f"The model '{name}' does not exist; this server serves '{api.model_name}'",
            param="model",
            code="model_not_found",
        )
    model = ServedModel(api.model_name, api.task, api.tokenizer, api.pool, api.embed_spec, api.cfg.router.max_retries)
    if model.task != task:
        raise wrong_endpoint(model.name, model.task)
    return model


def wrong_endpoint(name: str, task: str) -> ApiError:
    """400 for a request to an endpoint of the other task than ``name``'s."""
    what = "an embedding model" if task == "embed" else "a generative (chat) model"
    return ApiError(
        400,
        f"The model '{name}' is {what}: use {ENDPOINTS[task]}",
        param="model",
        code="wrong_endpoint",
    )
