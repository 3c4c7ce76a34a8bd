"""``llamadeploy doctor``'s rows for a model served for embeddings (its shape carries an
:class:`~worker.contract.embed_spec.EmbedSpec`): sized as ``plan`` and ``up``'s preflight size it
(:mod:`launcher.plan.embed`: weights without an LM head plus one step's activations, no KV cache).

An embedding worker computes with float weights, so it has no quantization to resolve; its kernel
table (a BERT encoder's) is measured by the worker itself at load, not by doctor
(:mod:`launcher.plan.doctor_kernels` measures a chat model's).
"""

from __future__ import annotations

from launcher.config import DeployConfig
from launcher.plan.embed import embed_params
from launcher.plan.placement import Inventory
from worker.contract.shapes import ModelShape
from worker.contract.tasks import TaskError, check_task
from worker.contract.units import GiB


def about(name: str, shape: ModelShape) -> str:
    """The model row's first words: its parameters as the embedding worker loads them."""
    assert shape.embed is not None
    spec = shape.embed
    return (
        f"{name}: embeddings, {embed_params(shape, spec) / 1e6:.1f} M parameters (no LM head), "
        f"{spec.dim} dimensions, inputs up to {spec.max_tokens} tokens"
    )


def quantization_row(cfg: DeployConfig, inv: Inventory, shape: ModelShape, specs: list | None) -> tuple[str, str, str]:
    """``(status, detail, fix)`` of the quantization row: ``fail`` for ``int8``/``int4``, which
    ``up`` refuses on an embedding model (:func:`worker.contract.tasks.check_task`); else the float
    weights the worker holds, in the plan's compute dtype."""
    from launcher.plan.plan import make_plan
    from launcher.plan.shape import config_folder

    try:
        check_task(cfg.model, config_folder(shape))
    except TaskError as exc:
        return "fail", str(exc), "set model.quantization: auto"
    s = make_plan(cfg, inv, shape, specs=specs).sizing
    return (
        "ok",
        f"model.quantization: {cfg.model.quantization} → none: an embedding worker computes with float weights; "
        f"compute dtype {s.dtype}; weights {s.weights / GiB:.3f} GiB (no LM head)",
        "",
    )


def kernels_row(shape: ModelShape) -> tuple[str, str, str]:
    """``(status, detail, fix)`` of the kernel row: a BERT encoder's worker measures the kernels of
    its float linears at load (:mod:`worker.embed.bert`; the table is in ``GET /workers``), at its
    own row counts, so nothing is measured here; any other model runs transformers' forward."""
    assert shape.embed is not None
    if shape.embed.encoder:
        return (
            "ok",
            "not measured here: an embedding worker measures its encoder's float kernels at load "
            "(GET /workers and its start-up log show the table)",
            "",
        )
    return "ok", "none: a decoder served for embeddings runs transformers' forward with float weights", ""
