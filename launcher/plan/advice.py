"""``llamadeploy plan``'s answer when the configured layout does not fit but another does.

:func:`advise` tries, in order, the configured file with the layout its plan recommends
(tensor parallel, a layer split), then the file with its linear layers quantized lighter
(``model.quantization``: int8, then int4) as is and with its recommended layout; the first that
plans without an error is the answer: the deploy.yaml keys to set and that layout's plan, which
``plan`` prints with exit 0. None when nothing fits (``plan`` exits 1).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import yaml

from launcher.config import DeployConfig
from launcher.plan.placement import Inventory
from launcher.plan.plan import ModelPlan, make_plan
from launcher.plan.sizing import QUANTIZATIONS, resize
from worker.contract.shapes import ModelShape, weight_format


@dataclass(frozen=True)
class Advice:
    """The keys to set (dotted, deploy.yaml's spelling) and the plan of the file with them set."""

    keys: dict[str, Any]
    config: DeployConfig
    plan: ModelPlan

    def yaml(self) -> str:
        """The keys as the deploy.yaml sections to paste."""
        nested: dict[str, dict[str, Any]] = {}
        for dotted, value in self.keys.items():
            section, key = dotted.split(".", 1)
            nested.setdefault(section, {})[key] = value
        return yaml.safe_dump(nested, sort_keys=False).rstrip()


def advise(cfg: DeployConfig, inv: Inventory, shape: ModelShape, plan: ModelPlan) -> Advice | None:
    """The layout to recommend when ``plan`` (``cfg`` on ``inv``) has errors and another layout
    or a lighter quantization of the weights plans without one; None when ``plan`` is fine, when
    the deployment has several models or none of the alternatives fits."""
    if plan.ok or cfg.models:
        return None
    for keys in _alternatives(cfg, plan):
        changed = _with(cfg, keys)
        if changed is None:
            continue
        tried = make_plan(changed, inv, shape)
        if tried.ok:
            return Advice(keys, changed, tried)
        layout = _layout_keys(changed, tried)
        if layout and (relaid := _with(changed, layout)) is not None:
            again = make_plan(relaid, inv, shape)
            if again.ok:
                return Advice({**keys, **layout}, relaid, again)
    return None


def _alternatives(cfg: DeployConfig, plan: ModelPlan) -> Iterator[dict[str, Any]]:
    """The key changes to try: the recommended layout, then each quantization lighter than the
    weights as planned."""
    if layout := _layout_keys(cfg, plan):
        yield layout
    s = plan.sizing
    for quantization in QUANTIZATIONS[1:]:
        if resize(s, s.dtype, weight_format(quantization, None)).weights < s.weights:
            yield {"model.quantization": quantization}


def _layout_keys(cfg: DeployConfig, plan: ModelPlan) -> dict[str, Any]:
    """The workers keys of ``plan``'s recommended GPU layout that differ from ``cfg``'s ({} when it
    recommends none, or the layout configured already)."""
    rec = plan.recommendation
    if rec.device != "cuda" or rec.replicas == 0 or rec.embed:
        return {}
    w = cfg.workers
    wanted = {
        "workers.tensor_parallel_size": rec.tensor_parallel_size,
        "workers.gpus_per_replica": rec.gpus_per_replica,
        "workers.replicas": rec.replicas if w.replicas != "auto" else "auto",
    }
    current = {f"workers.{k}": getattr(w, k) for k in ("tensor_parallel_size", "gpus_per_replica", "replicas")}
    keys = {k: v for k, v in wanted.items() if current[k] != v}
    return keys if set(keys) - {"workers.replicas"} else {}


def _with(cfg: DeployConfig, keys: dict[str, Any]) -> DeployConfig | None:
    """``cfg`` with ``keys`` set, validated again; None when the result is not a valid file."""
    data = cfg.model_dump()
    for dotted, value in keys.items():
        section, key = dotted.split(".", 1)
        data[section] = {**data[section], key: value}
    try:
        return DeployConfig.model_validate(data)
    except ValueError:
        return None
