"""How ``model.quantization: int8 | int4`` cuts a float weight into groups, torch-free (the launcher
checks a tensor-parallel split against it before anything starts; the worker quantizes by it).

- ``int8``: one scale per output channel (a group is a whole row of K values). That is what
  torch's int8 weight-only kernel (``aten._weight_int8pack_mm``, CPU and CUDA) takes, as torchao's
  ``int8_weight_only`` and vLLM's W8A16 checkpoints do; a GGUF Q8_0 file keeps its 32-value groups.
- ``int4``: groups of :data:`INT4_GROUP` values along K with a scale and an offset each (GGUF Q4_1's
  rule), the smallest group torch's int4 kernels take.

With tensor parallelism each rank quantizes its own shard after the split, so a group never
straddles two ranks; a row-parallel shard (o_proj's and down_proj's K / N) must then hold whole
int4 groups.
"""

from __future__ import annotations

INT4_GROUP = 32
KEY = "model.quantization"


def group_size(bits: int, k: int) -> int:
    """The group along K a weight with ``k`` input columns is quantized in, at ``bits``."""
    return k if bits == 8 else INT4_GROUP


def bits_of(quantization: str) -> int | None:
    """8 or 4 for ``int8`` / ``int4``; None for a setting that quantizes nothing at load."""
    return {"int8": 8, "int4": 4}.get(quantization)


def group_problems(hidden: int, attention: int, mlp: int, quantization: str, ranks: int = 1) -> list[str]:
    """Why ``quantization`` cannot cut a Llama-family model's linear weights into whole groups:
    ``hidden`` is the input width of q/k/v and gate/up (whole on every rank), ``attention`` (heads ×
    head dim) that of o_proj and ``mlp`` that of down_proj, both split over ``ranks``. One line per
    problem, naming the key and the fix; empty when it can."""
    if bits_of(quantization) != 4:
        return []
    widths = {"hidden size": (hidden, 1), "attention width": (attention, ranks), "MLP width": (mlp, ranks)}
    bad = [
        f"{what} {k}" + (f" / {n} ranks" if n > 1 else "")
        for what, (k, n) in widths.items()
        if k % n or (k // n) % INT4_GROUP
    ]
    if not bad:
        return []
    fix = "use int8" + (" or another workers.tensor_parallel_size" if ranks > 1 else "")
    return [f"{KEY}: int4 needs input widths in whole {INT4_GROUP}-value groups ({', '.join(bad)}); {fix}"]
