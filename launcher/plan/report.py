"""Rich tables for a :class:`launcher.plan.plan.Plan`: the sizing table (per dtype),
the layouts table (data parallel, tensor parallel and layer split side by side) and the
placement table (per worker). GB = 1e9 bytes, GiB = 2^30 bytes, both labelled."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from launcher.config import DeployConfig
from launcher.plan.layouts import LAYER_SPLIT, TENSOR_PARALLEL, Layout, choose, compare, tp_unavailable
from launcher.plan.plan import Plan
from launcher.plan.sizing import resize
from worker.contract.units import GB, GiB

ROWS = (("float32", "float32"), ("bfloat16", "bfloat16/float16"), ("int8", "int8"), ("int4", "int4"))


def render(plan: Plan, cfg: DeployConfig) -> Group:
    """Everything ``llamadeploy plan`` prints, as one renderable."""
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


def sizing_table(plan: Plan, cfg: DeployConfig) -> Table:
    """One row per dtype: weights, KV cache, overhead, total, and GPUs one replica needs here."""
    s, shape = plan.sizing, plan.sizing.shape
    gpus = 1 if plan.gpus else 0
    util = cfg.workers.gpu_memory_utilization
    table = Table(
        title=f"{shape.name}: {shape.params / 1e9:.3f} B parameters ({shape.num_layers} layers, hidden "
        f"{shape.hidden_size}, {shape.num_heads} heads, {shape.num_kv_heads} KV heads × {shape.head_dim}, "
        f"vocab {shape.vocab_size})",
        caption=f"KV S×L: max_num_seqs {s.max_num_seqs} × max_model_len {s.max_model_len} tokens. "
        "GB = 10^9 bytes, GiB = 2^30 bytes. Overhead: CUDA context/workspace allowance + prefill "
        "activations per GPU (process memory + activations on CPU). * = planned dtype.",
    )
    for col in (
        "dtype",
        "weights GB",
        "weights GiB",
        "KV/token KiB",
        "KV S×L GiB",
        "overhead GiB",
        "total GiB",
        "GPUs/replica",
    ):
        table.add_column(col, justify="left" if col == "dtype" else "right")
    for dtype, label in ROWS:
        row = s if dtype == _row_of(s.dtype) else resize(s, dtype)
        total = row.weights + row.overhead(gpus) + row.kv_full
        table.add_row(
            label + (" *" if dtype == _row_of(s.dtype) else ""),
            f"{row.weights / GB:.2f}",
            f"{row.weights / GiB:.2f}",
            f"{row.kv_per_token / 1024:.1f}",
            f"{row.kv_full / GiB:.2f}",
            f"{row.overhead(gpus) / GiB:.2f}",
            f"{total / GiB:.2f}",
            _gpus_cell(row, plan, util, tp_unavailable(cfg)),
        )
    return table


def _row_of(dtype: str) -> str:
    return "bfloat16" if dtype == "float16" else dtype


def _gpus_cell(row, plan: Plan, utilization: float, no_tp: str) -> str:
    n = len(plan.gpus)
    if not n:
        return "no GPU"
    chosen = choose(compare(row, plan.gpus, utilization, no_tp))
    if chosen is None:
        return f"no (> {n})"
    k = chosen.gpus_per_replica
    return {TENSOR_PARALLEL: f"{k} (TP)", LAYER_SPLIT: f"{k} (layer split)"}.get(chosen.kind, "1")


def layouts_table(layouts: list[Layout], plan: Plan) -> Table:
    """One row per layout on these GPUs: the GPUs one replica takes, the replicas they give, each
    replica's KV room and full-length sequences; the recommended one marked."""
    s = plan.sizing
    chosen = choose(layouts)
    table = Table(
        title=f"layouts on {len(plan.gpus)} GPU(s) ({s.dtype})",
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


def placement_table(plan: Plan) -> Table:
    """One row per placed worker: its budget and what is left for the KV cache."""
    s = plan.sizing
    table = Table(title=f"placement ({s.dtype})")
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
        if spec.device == "cuda":
            share = "" if spec.share == 1 else f", share 1/{round(1 / spec.share)}"
            where = "; ".join(f"{g.index}: {g.name} {g.total_bytes / GiB:.1f} GiB" for g in spec.gpu_info) + share
        else:
            where = f"{len(spec.cpus)} core(s)"
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
