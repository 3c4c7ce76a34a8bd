"""A served model as the router holds it (:class:`router.state.ServedModel`), from its ``model``
section and its folder: read at start (:mod:`router.serve`) and again when ``apply`` changes the
section (:mod:`router.rollout`), so both resolve the task and an embedding model's spec alike."""

from __future__ import annotations

from router.state import ServedModel
from worker.contract.embed_spec import read_spec
from worker.contract.settings import ModelConfig
from worker.contract.tasks import resolve_task


def served_model(config: ModelConfig, path: str | None, tokenizer) -> ServedModel:
    """The model in ``path`` with ``task: auto`` resolved from its files (:mod:`worker.contract.tasks`,
    the rule the worker applies too) and, for an embedding model, its pooling spec (its
    ``max_model_len`` then the tokens one input may have, what /v1/models shows). ``path`` None
    (a router built without folders): the section as it is."""
    if path is None:
        return ServedModel(config, tokenizer)
    config = config.model_copy(update={"task": resolve_task(config, path)})
    if config.task != "embed":
        return ServedModel(config, tokenizer, path=path)
    spec = read_spec(path, config.max_model_len)
    return ServedModel(config.model_copy(update={"max_model_len": spec.max_tokens}), tokenizer, spec, path)
