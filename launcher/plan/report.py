"""Rich tables for a :class:`launcher.plan.plan.ModelPlan`: the sizing table (one row per way to hold the
weights: float32, 16-bit, int8 and int4 linear layers, and the planned one when it is none of those),
the layouts table (data parallel, tensor parallel and layer split side by side) and the
placement table (per worker). GB = 1e9 bytes, GiB = 2^30 bytes, both labelled."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from launcher.config import DeployConfig
from launcher.plan.embed import EmbedSizing
from launcher.plan.embed_report import embed_placement_table, embed_sizing_table
from launcher.plan.layouts import LAYER_SPLIT, TENSOR_PARALLEL, Layout, choose, compare, tp_unavailable
from launcher.plan.plan import ModelPlan
from launcher.plan.sizing import Sizing, resize
from worker.contract.shapes import UNQUANTIZED, weight_format
from worker.contract.units import GB, GiB


def render(plan: ModelPlan, cfg: DeployConfig) -> Group:
    """Everything ``llamadeploy plan`` prints, as one renderable."""
    if isinstance(plan.sizing, EmbedSizing):  # no KV cache: its own tables, no layouts to compare
        on_gpu = any(f.spec.device == "cuda" for f in plan.fits) or bool(plan.gpus)
        parts = [embed_sizing_table(plan.sizing, on_gpu), embed_placement_table(plan.sizing, plan.fits)]
    else:
        parts = [sizing_table(plan, cfg)]
        if plan.gpus:
            layouts = compare(plan.sizing, plan.gpus, cfg.workers.gpu_memory_utilization, tp_unavailable(cfg))
            parts.append(layouts_table(layouts, plan))
        parts.append(placement_table(plan))
    for e in plan.errors:
        parts.append(Text.assemble(("error: ", "bold red"), e))
    for w in plan.warnings:
        parts.append(Text.assemble(("warning: ", "yellow"), w))
    parts.append(Text.assemble(("recommended on this hardware: ", "bold green"), plan.recommendation.describe()))
    return Group(*parts)


def sizing_table(plan: ModelPlan, cfg: DeployConfig) -> Table:
    """One row per dtype: weights, KV cache, overhead, total, and GPUs one replica needs here."""
    s, shape = plan.sizing, plan.sizing.shape
    gpus = 1 if plan.gpus else 0
    util = cfg.workers.gpu_memory_utilization
    table = Table(
        title=f"{shape.name}: {shape.params / 1e9:.3f} B parameters ({shape.num_layers} layers, hidden "
        f"{shape.hidden_size}, {shape.num_heads} heads, {shape.num_kv_heads} KV heads × {shape.head_dim}, "
        f"vocab {shape.vocab_size})",
        caption=f"KV S×L: max_num_seqs {s.max_num_seqs} × max_model_len {s.max_model_len} tokens. "
        "GB = 10^9 bytes, GiB = 2^30 bytes. int8/int4 (model.quantization): the linear layers at 8 bits "
        "+ a float32 scale per output channel, or 4 bits + a float32 scale and offset per 32 values; the "
        "embeddings and LM head int8 per row; norms in the compute dtype. Overhead: CUDA context/workspace "
        "allowance + prefill activations per GPU (process memory + activations on CPU). * = planned.",
    )
    for col in (
        "weights",
        "weights GB",
        "weights GiB",
        "KV/token KiB",
        "KV S×L GiB",
        "overhead GiB",
        "total GiB",
        "GPUs/replica",
    ):
        table.add_column(col, justify="left" if col == "weights" else "right")
    for label, row in _rows(s):
        total = row.weights + row.overhead(gpus) + row.kv_full
        table.add_row(
            label + (" *" if row == s else ""),
            f"{row.weights / GB:.2f}",
            f"{row.weights / GiB:.2f}",
            f"{row.kv_per_token / 1024:.1f}",
            f"{row.kv_full / GiB:.2f}",
            f"{row.overhead(gpus) / GiB:.2f}",
            f"{total / GiB:.2f}",
            _gpus_cell(row, plan, util, tp_unavailable(cfg)),
        )
    return table


def _rows(s: Sizing) -> list[tuple[str, Sizing]]:
    """(label, sizing) per row: float32 and 16-bit unquantized, int8 and int4 linear layers in the
    planned compute dtype; the planned sizing replaces the row it matches, or is added."""
    half = s.dtype if s.dtype != "float32" else "bfloat16"
    rows = [
        ("float32", resize(s, "float32", UNQUANTIZED)),
        ("bfloat16/float16", resize(s, half, UNQUANTIZED)),
        *((f"{q} + {s.dtype}", resize(s, s.dtype, weight_format(q, None))) for q in ("int8", "int4")),
    ]
    if s not in (row for _, row in rows):
        rows.append((s.label, s))
    return rows


def _gpus_cell(row, plan: ModelPlan, utilization: float, no_tp: str) -> str:
    n = len(plan.gpus)
    if not n:
        return "no GPU"
    chosen = choose(compare(row, plan.gpus, utilization, no_tp))
    if chosen is None:
        return f"no (> {n})"
    k = chosen.gpus_per_replica
    return {TENSOR_PARALLEL: f"{k} (TP)", LAYER_SPLIT: f"{k} (layer split)"}.get(chosen.kind, "1")


def layouts_table(layouts: list[Layout], plan: ModelPlan) -> Table:
    """One row per layout on these GPUs: the GPUs one replica takes, the replicas they give, each
    replica's KV room and full-length sequences; the recommended one marked."""
    s = plan.sizing
    chosen = choose(layouts)
    table = Table(
        title=f"layouts on {len(plan.gpus)} GPU(s) ({s.label})",
        caption="data parallel when a replica fits one GPU; else tensor parallel (every GPU works on every "
        "token); a layer split (one GPU at a time) only where tensor parallel cannot divide the model. "
        "* = recommended.",
    )
    for col in (
        "layout",
        "setting",
        "fits",
        "GPUs/replica",
        "replicas",
        "KV room/replica GiB",
        f"seqs × {s.max_model_len} tok",
    ):
        table.add_column(col, justify="left" if col in ("layout", "setting", "fits") else "right")
    for lay in layouts:
        usable = lay.gpus_per_replica > 0
        table.add_row(
            lay.kind + (" *" if lay is chosen else ""),
            lay.setting if usable else "-",
            "[green]yes[/]" if lay.fits else f"[red]no[/]: {lay.why_not}",
            str(lay.gpus_per_replica) if usable else "-",
            str(lay.replicas) if usable else "-",
            f"{lay.kv_room / GiB:.2f}" if usable else "-",
            str(lay.seqs) if usable else "-",
        )
    return table


def placement_table(plan: ModelPlan) -> Table:
    """One row per placed worker: its budget and what is left for the KV cache."""
    s = plan.sizing
    table = Table(title=f"placement ({s.label})")
    for col in (
        "worker",
        "device",
        "GPUs / cores",
        "budget GiB",
        "weights GiB",
        "overhead GiB",
        "KV room GiB",
        f"seqs × {s.max_model_len} tok",
        "status",
    ):
        table.add_column(col, justify="right" if "GiB" in col or "seqs" in col else "left")
    for f in plan.fits:
        spec = f.spec
        where = spec.hardware
        status = (
            ("[green]ok[/]" if f.seqs >= s.max_num_seqs else "[yellow]fewer seqs[/]")
            if f.fits
            else "[red]does not fit[/]"
        )
        table.add_row(
            str(spec.worker_id),
            spec.label,
            where,
            f"{f.budget / GiB:.2f}",
            f"{s.weights / GiB:.2f}",
            f"{f.overhead / GiB:.2f}",
            f"{f.kv_room / GiB:.2f}",
            str(f.seqs),
            status,
        )
    if not plan.fits:
        table.add_row("-", "-", "nothing placed", "", "", "", "", "", "[red]error[/]")
    return table
