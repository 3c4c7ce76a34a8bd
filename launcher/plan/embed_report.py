"""Rich tables for an embedding model's :class:`~launcher.plan.plan.ModelPlan` (:mod:`launcher.plan.embed`):
the sizing (weights, one step's activations, overhead, total; no KV cache) and the placement (per
worker: what it may use against what it needs). GiB = 2^30 bytes."""

from __future__ import annotations

from rich.table import Table

from launcher.plan.embed import EmbedFit, EmbedSizing, embed_params
from worker.contract.units import GB, GiB


def embed_sizing_table(s: EmbedSizing, on_gpu: bool) -> Table:
    """One row: the planned dtype's weights, activations of the largest step, overhead and total."""
    shape, spec = s.shape, s.spec
    kind = "encoder" if spec.encoder else "decoder"
    table = Table(
        title=f"{shape.name}: embeddings ({kind}, {spec.pooling} pooling, {spec.dim} dimensions), "
        f"{embed_params(shape, spec) / 1e6:.1f} M parameters ({shape.num_layers} layers, "
        f"hidden {shape.hidden_size}), inputs up to {spec.max_tokens} tokens",
        caption=f"No KV cache: an embedding worker computes each step of up to {s.step_tokens} tokens "
        "(workers.max_prefill_tokens) and keeps nothing between steps. Activations: that step's peak. "
        "Overhead: " + ("CUDA context/workspace allowance" if on_gpu else "process memory") + " + activations.",
    )
    for col in ("weights", "weights GB", "weights GiB", "activations GiB", "overhead GiB", "total GiB"):
        table.add_column(col, justify="left" if col == "weights" else "right")
    table.add_row(
        s.label,
        f"{s.weights / GB:.3f}",
        f"{s.weights / GiB:.3f}",
        f"{s.activations / GiB:.3f}",
        f"{s.overhead(on_gpu) / GiB:.2f}",
        f"{s.need(on_gpu) / GiB:.2f}",
    )
    return table


def embed_placement_table(s: EmbedSizing, fits: list[EmbedFit]) -> Table:
    """One row per placed embedding worker: its budget, what it needs, whether it fits."""
    table = Table(title=f"placement ({s.label}, embeddings)")
    for col in ("worker", "device", "GPUs / cores", "budget GiB", "weights GiB", "overhead GiB", "need GiB", "status"):
        table.add_column(col, justify="right" if "GiB" in col else "left")
    for f in fits:
        spec = f.spec
        where = spec.hardware
        table.add_row(
            str(spec.worker_id),
            spec.label,
            where,
            f"{f.budget / GiB:.2f}",
            f"{s.weights / GiB:.3f}",
            f"{f.overhead / GiB:.2f}",
            f"{f.need / GiB:.2f}",
            "[green]ok[/]" if f.fits else "[red]does not fit[/]",
        )
    if not fits:
        table.add_row("-", "-", "nothing placed", "", "", "", "", "[red]error[/]")
    return table
