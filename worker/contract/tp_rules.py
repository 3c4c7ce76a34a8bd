"""Tensor parallelism's arithmetic, torch-free: whether a model splits over N ranks, and which rows or
columns of each weight rank r holds.

The split is Megatron-LM's (and vLLM's): q/k/v and gate/up are column-parallel (rank r computes
its own query heads, KV heads and MLP channels), o_proj and down_proj row-parallel (rank r
multiplies its slice of their inputs; one all-reduce sums the ranks' partial outputs). Embeddings,
norms and the LM head are replicated. So the attention heads, the KV heads and the MLP width must
each divide by N; :func:`tp_problems` says so before anything starts (the launcher) and the worker
checks it again with the same words.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from worker.contract.llama_family import supports
from worker.contract.shapes import attention_heads

KEY = "workers.tensor_parallel_size"


def _get(config, *names: str) -> int | None:
    """The first of ``names`` that ``config`` (an HF config object, its config.json as a dict, or
    :class:`worker.contract.shapes.ModelShape`) has and sets."""
    for name in names:
        value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
        if value is not None:
            return int(value)
    return None


def _has(config, name: str) -> bool:
    return (config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)) is not None


def split_sizes(config) -> dict[str, int]:
    """The three counts a split divides: ``{"attention heads", "KV heads", "MLP width"}``. KV heads
    default to the attention heads (no GQA), as transformers does."""
    heads, kv = attention_heads(config)
    width = _get(config, "intermediate_size")
    if width is None:
        raise ValueError("the model config has no intermediate_size")
    return {"attention heads": heads, "KV heads": kv, "MLP width": width}


def valid_sizes(config, most: int = 64) -> list[int]:
    """Every tensor-parallel size up to ``most`` that divides the model: the divisors of the gcd
    of its heads, KV heads and MLP width."""
    g = math.gcd(*split_sizes(config).values())
    return [n for n in range(1, min(g, most) + 1) if g % n == 0]


def tp_problems(config, n: int, quantization: str = "none") -> list[str]:
    """Why ``config`` cannot be split over ``n`` tensor-parallel ranks: one line per problem, each
    naming ``workers.tensor_parallel_size`` and the fix; empty when it can. ``config``: an HF config
    object, a config.json dict or a ``ModelShape``; where it names its ``architectures`` (not a
    ``ModelShape``), a model the Llama-family forward cannot run is refused too. With
    ``quantization`` at load, each rank's shard must hold whole groups
    (:func:`worker.contract.quant_rules.group_problems`). Pure (no torch, no files)."""
    if n < 1:
        return [f"{KEY}: {n} must be at least 1"]
    if n == 1:
        return []
    if _has(config, "architectures") and (why := supports(config)):
        return [f"{KEY}: {n} needs a Llama-family model, the only forward that is split ({why}); use 1"]
    sizes = split_sizes(config)
    bad = [f"{count} {what}" for what, count in sizes.items() if count % n]
    if not bad:
        return quant_problems(config, quantization, n)
    fits = [str(v) for v in valid_sizes(config) if v > 1]
    fix = f"use one of {', '.join(fits)}" if fits else "this model does not split; use 1 (or workers.gpus_per_replica)"
    return [f"{KEY}: {n} does not divide the model's {', '.join(bad)}; {fix}"]


def quant_problems(config, quantization: str, n: int = 1) -> list[str]:
    """Why ``quantization`` at load cannot cut ``config``'s linear weights over ``n`` ranks into
    whole groups (:func:`worker.contract.quant_rules.group_problems`); empty when it can."""
    from worker.contract.quant_rules import group_problems

    heads = _get(config, "num_attention_heads", "num_heads")
    hidden = _get(config, "hidden_size")
    if heads is None or hidden is None:
        return []
    head_dim = _get(config, "head_dim") or hidden // heads
    return group_problems(hidden, heads * head_dim, split_sizes(config)["MLP width"], quantization, n)


def shard_range(name: str, shape: tuple[int, ...], rank: int, world: int) -> tuple[int, int, int] | None:
    """Which part of the weight ``name`` (transformers' Llama names, full ``shape``) rank ``rank`` of
    ``world`` holds: ``(dim, start, stop)`` along one dimension, or ``None`` for a replicated tensor.

    q/k/v (weights and biases) and gate/up: rows, in whole heads or channels; o_proj and down_proj:
    columns. Contiguous slices keep grouped-query attention intact: rank r's query heads
    ``[r·H/N, (r+1)·H/N)`` are exactly those of its KV heads ``[r·KVH/N, (r+1)·KVH/N)``."""
    if world == 1:
        return None
    leaf = name.rsplit(".", 2)
    if len(leaf) < 3:
        return None
    module = leaf[-2]
    if module in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        dim = 0
    elif module in ("o_proj", "down_proj") and leaf[-1] == "weight":
        dim = 1
    else:
        return None
    size = shape[dim]
    if size % world:
        raise ValueError(f"{name}: {size} along dim {dim} does not divide by {world} ranks")
    part = size // world
    return dim, rank * part, (rank + 1) * part
