"""Which model configs the engine's own Llama-family forward (:mod:`worker.llama`) runs; torch-free,
so the launcher can ask before anything starts (tensor parallelism needs that forward)."""

from __future__ import annotations

from collections.abc import Mapping

ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM"}


def _get(config, name: str, default=None):
    value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
    return default if value is None else value


def supports(config) -> str | None:
    """``None`` when the compact forward can run ``config`` (an HF config object or its config.json
    as a dict), else why not (the engine then uses transformers)."""
    archs = set(_get(config, "architectures") or [])
    if not archs & ARCHITECTURES:
        return f"architecture {sorted(archs)} is not Llama-family"
    if (act := _get(config, "hidden_act", "silu")) != "silu":
        return f"hidden_act {act!r}"
    if _get(config, "sliding_window"):
        return "sliding-window attention"
    if _get(config, "mlp_bias", False):
        return "MLP bias"
    return None
