"""Writing ``model.max_model_len: auto``'s figure (:mod:`launcher.plan.context`) into the
configuration ``up`` and ``apply`` start with: the router's and the workers' settings carry a number."""

from __future__ import annotations

import logging

from launcher.config import DeployConfig
from launcher.plan.context import AUTO, FALLBACK, native_context, with_length
from launcher.plan.placement import Inventory, WorkerSpec
from launcher.plan.plan import make_plan
from worker.contract.shapes import ModelShape

log = logging.getLogger(__name__)


def resolve_context(
    cfg: DeployConfig, inv: Inventory, shapes: list[ModelShape], specs: list[WorkerSpec] | None = None
) -> DeployConfig:
    """``cfg`` with every served model's ``auto`` replaced by the length its plan uses;
    ``shapes`` are the served models' (in :meth:`DeployConfig.served` order), ``specs`` every
    placed worker (each with its ``model`` index) or None to place them here. An embedding model
    keeps its own length (it holds no KV cache)."""
    for k, one in enumerate(cfg.served()):
        if one.model.max_model_len != AUTO:
            continue
        if shapes[k].embed is not None:
            length = native_context(shapes[k])
        else:
            mine = None if specs is None else [s for s in specs if s.model == k]
            length = make_plan(cfg.for_model(k), inv, shapes[k], specs=mine).sizing.max_model_len
        cfg = with_length(cfg, length, k)
    return cfg


def resolve_at_start(cfg: DeployConfig, inv: Inventory | None, specs: list[WorkerSpec] | None = None) -> DeployConfig:
    """What ``up`` starts with: :func:`resolve_context` on the served models' shapes. ``inv`` None
    (a cluster whose GPU memory is unknown) or a model whose config cannot be read here (resolving
    it reports why): the model's own length, else :data:`FALLBACK`, unchecked."""
    from launcher.plan.shape import read_shapes

    if all(one.model.max_model_len != AUTO for one in cfg.served()):
        return cfg
    shapes = read_shapes([one.model for one in cfg.served()])
    if shapes is not None and inv is not None:
        return resolve_context(cfg, inv, shapes, specs)
    for k, one in enumerate(cfg.served()):
        if one.model.max_model_len == AUTO:
            length = native_context(shapes[k]) if shapes is not None else FALLBACK
            log.warning("model.max_model_len auto: %d tokens, not checked against the KV budget", length)
            cfg = with_length(cfg, length, k)
    return cfg


def resolve_for_apply(cfg: DeployConfig, current: DeployConfig) -> DeployConfig:
    """``apply``'s target: each served model with ``auto`` that runs now (served under the same
    name, or the one model of both; same model name and quantization) takes the running
    revision's length (its workers hold the GPUs' memory, so a plan made now would see no room);
    another model is resolved as ``up`` does, on this machine."""
    running = {one.name: one.model for one in current.served()}
    served = cfg.served()
    for k, one in enumerate(served):
        was = current.model if len(served) == len(running) == 1 else running.get(one.name)
        if one.model.max_model_len == AUTO and was is not None and _same(one.model, was):
            cfg = with_length(cfg, was.max_model_len, k)
    if all(one.model.max_model_len != AUTO for one in cfg.served()):
        return cfg
    from launcher.plan.placement import discover

    return resolve_at_start(cfg, discover())


def _same(a, b) -> bool:
    """Two ``model`` sections load the same weights (name and quantization)."""
    return (a.name, a.quantization) == (b.name, b.quantization)
