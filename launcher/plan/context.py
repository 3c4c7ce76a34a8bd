"""``model.max_model_len: auto``: the model's own context length, reduced to what the KV cache holds.

As vLLM does: the length is the model's ``max_position_embeddings`` (a GGUF file's
``<arch>.context_length``), and when a worker's KV budget cannot hold one sequence of that length
it is reduced to what the smallest budget holds, with one log line saying so and which settings
give more. It is never reduced below ``min(native, FALLBACK)``: a budget that holds less than that
is the plan's error, as for any length. :func:`launcher.plan.plan.make_plan` applies this rule
(``plan`` shows the figure); :mod:`launcher.plan.resolve` writes the figure into the configuration
``up`` and ``apply`` start, so routers and workers only ever see a number.
"""

from __future__ import annotations

import logging

from launcher.config import DeployConfig
from worker.contract.shapes import ModelShape

log = logging.getLogger(__name__)

AUTO = "auto"
FALLBACK = 2048  # a model whose config names no context length (what the old default was)
MOST = 1_048_576  # model.max_model_len's ceiling
STEP = 16  # a reduced length is a multiple of the KV block size


def native_context(shape: ModelShape) -> int:
    """The model's own context length: ``max_position_embeddings`` (GGUF: ``context_length``),
    :data:`FALLBACK` when its config names none, at most :data:`MOST`."""
    return min(int(shape.max_position_embeddings or FALLBACK), MOST)


def fitted_length(native: int, held: int, name: str) -> int:
    """The length ``auto`` serves for a model of ``native`` tokens whose smallest worker KV budget
    holds ``held`` tokens: ``native`` when it fits, else ``held`` rounded down to :data:`STEP` (a
    warning naming the settings that give more), never below ``min(native, FALLBACK)``."""
    floor = min(native, FALLBACK)
    if held >= native:
        log.info("model.max_model_len auto: %d tokens, %s's own context length", native, name)
        return native
    if held < floor:
        return floor  # not even that fits: the plan says so, as for a length given in deploy.yaml
    reduced = held // STEP * STEP
    log.warning(
        "model.max_model_len auto: %s was trained for %d tokens, but the KV cache holds %d tokens for one "
        "sequence: serving %d (give more with workers.kv_cache_gib on CPU or workers.gpu_memory_utilization "
        "on GPU, or set model.max_model_len)",
        name,
        native,
        held,
        reduced,
    )
    return reduced


def with_length(cfg: DeployConfig, length: int, index: int) -> DeployConfig:
    """``cfg`` with served model ``index``'s ``max_model_len`` set to ``length`` (its ``model:``
    section, or its entry of ``models:``)."""
    if not cfg.models:
        return cfg.model_copy(update={"model": cfg.model.model_copy(update={"max_model_len": length})})
    entries = list(cfg.models)
    entries[index] = entries[index].model_copy(update={"max_model_len": length})
    return cfg.model_copy(update={"models": entries})
