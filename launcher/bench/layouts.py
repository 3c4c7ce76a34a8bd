"""``llamadeploy bench --layouts``: what is run and the table of the results (pure).

The same model on the same N GPUs in three layouts, one deployment at a time: data parallel
(N replicas of one GPU), tensor parallel (one replica of N ranks) and a layer split (one replica
over N GPUs, one working at a time). Per layout: the single-request latency (one short chat
answered end to end, the median of a few, one after another), the throughput of 8 concurrent
clients (output tokens per second over a closed loop) and the peak memory of any of its GPUs
(NVML, sampled through the run). Ratios are against data parallel, the first row: its latency
over the row's (>1 = faster per request) and the row's throughput over its.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.table import Table

from worker.contract.units import GiB


@dataclass(frozen=True)
class LayoutRun:
    """One layout to deploy: ``name`` for the table, ``workers`` the deploy.yaml keys it sets,
    ``skipped`` why it is not run on this host ("" when it is)."""

    name: str
    workers: dict
    skipped: str = ""


def layout_runs(gpu_count: int, n: int | None = None) -> list[LayoutRun]:
    """The three layouts over GPUs ``0..n-1`` (default: every GPU). With fewer than two GPUs only
    data parallel over what there is can run; the others say why not."""
    n = gpu_count if n is None else min(n, gpu_count)
    devices = list(range(n))
    runs = [
        LayoutRun(
            f"data parallel ×{max(n, 1)}",
            {"devices": devices, "replicas": n, "gpus_per_replica": 1, "tensor_parallel_size": 1},
            "" if n >= 1 else "no GPU on this host",
        ),
        LayoutRun(
            f"tensor parallel {max(n, 2)}",
            {"devices": devices, "replicas": 1, "gpus_per_replica": 1, "tensor_parallel_size": n},
        ),
        LayoutRun(
            f"layer split {max(n, 2)}",
            {"devices": devices, "replicas": 1, "gpus_per_replica": n, "tensor_parallel_size": 1},
        ),
    ]
    if n < 2:
        why = f"needs 2 or more GPUs; this host has {gpu_count}"
        runs[1:] = [LayoutRun(r.name, r.workers, why) for r in runs[1:]]
    return runs


@dataclass(frozen=True)
class LayoutResult:
    """What one layout measured: ``latency_s`` (median single-request end-to-end latency),
    ``throughput`` (output tokens/s with 8 concurrent clients), ``peak_bytes`` (the largest
    memory in use on any of its GPUs); ``note`` says why a figure is missing."""

    name: str
    latency_s: float | None = None
    throughput: float | None = None
    peak_bytes: int | None = None
    note: str = ""

    def public(self) -> dict:
        return dict(self.__dict__)


def ratio(value: float | None, base: float | None) -> float | None:
    """``value / base``, or None when either is missing (or ``base`` is 0)."""
    return value / base if value is not None and base else None


def results_table(results: list[LayoutResult]) -> Table:
    """The table: per layout its latency, throughput and peak memory per GPU, with the
    ratios against the first row that measured something (data parallel)."""
    base = next((r for r in results if r.latency_s is not None or r.throughput is not None), None)
    table = Table(
        title="layouts: the same model on the same GPUs",
        caption=(
            f"× = against {base.name}: its latency over the row's (>1: faster per request), the row's "
            "throughput over its"
            if base
            else "nothing was run"
        ),
    )
    for col in ("layout", "single-request latency ms", "×", "8-way output tok/s", "× ", "peak memory/GPU GiB", "note"):
        table.add_column(col, justify="left" if col in ("layout", "note") else "right")
    for r in results:
        speedup = ratio(base.latency_s, r.latency_s) if base else None
        gain = ratio(r.throughput, base.throughput) if base else None
        table.add_row(
            r.name,
            _fmt(r.latency_s, 1000, "{:.0f}"),
            _fmt(speedup, 1, "{:.2f}"),
            _fmt(r.throughput, 1, "{:.1f}"),
            _fmt(gain, 1, "{:.2f}"),
            _fmt(r.peak_bytes, 1 / GiB, "{:.2f}"),
            r.note,
        )
    return table


def _fmt(value: float | None, scale: float, pattern: str) -> str:
    return "-" if value is None else pattern.format(value * scale)
