"""The run's picture (``OUTPUT.png``, matplotlib, headless).

Engine suite: the stall scenario's chunk gaps over time with the document's prefill shaded, and
per figure how many times better ours is than each compared run (or, alone, the ratio figures
against their targets). Load suite: throughput and latency against concurrency, earlier runs
dashed, the static-batch ceiling dotted.
"""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

from launcher.bench.figures import FIGURES, compare
from launcher.bench.load_suite import run_label


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_engine(result: dict, others: list[dict], path: Path) -> None:
    plt = _pyplot()
    fig, (ax_gap, ax_fig) = plt.subplots(1, 2, figsize=(12, 4.5))
    tl = result.get("timeline") or {}
    for i, chunks in enumerate(tl.get("streams", [])):
        ax_gap.plot(chunks[1:], [(b - a) * 1e3 for a, b in pairwise(chunks)], ".-", ms=3, label=f"stream {i}")
    if tl.get("doc_first_chunk_s") is not None:
        ax_gap.axvspan(0, tl["doc_first_chunk_s"], color="orange", alpha=0.2, label="document prefill")
    ax_gap.set(
        xlabel="seconds from the document's arrival",
        ylabel="gap before this chunk, ms",
        title=f"{result['label']}: streams while a document prefills",
        yscale="log",
    )
    if others:
        width = 0.8 / len(others)
        for j, other in enumerate(others):
            rows = compare(result["figures"], other.get("figures", {}))
            ys = [k + j * width for k in range(len(rows))]
            ax_fig.barh(ys, [c.advantage for c in rows], height=width, label=f"vs {run_label(other)}")
            ax_fig.set_yticks([k for k in range(len(rows))], [c.figure.key for c in rows], fontsize=7)
        ax_fig.axvline(1, color="grey", linestyle=":")
        ax_fig.set(xscale="log", xlabel="times better than the peer (>1: ours ahead)", title="ours vs peers")
    else:
        rows = [f for f in FIGURES if f.target and result["figures"].get(f.key) is not None]
        ax_fig.barh(range(len(rows)), [result["figures"][f.key] for f in rows], color="tab:blue")
        ax_fig.scatter([f.target[1] for f in rows], range(len(rows)), marker="|", s=400, color="red", label="target")
        ax_fig.set_yticks(range(len(rows)), [f.key for f in rows], fontsize=8)
        ax_fig.set(xlabel="ratio", title="ratio figures against their targets")
    for ax in (ax_gap, ax_fig):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_load(result: dict, others: list[dict], path: Path) -> None:
    plt = _pyplot()
    fig, (ax_tp, ax_lat) = plt.subplots(1, 2, figsize=(11, 4.2))
    for run, style in [(result, "-o")] + [(o, "--s") for o in others]:
        for sc in run.get("scenarios", []):
            xs = [lv["concurrency"] for lv in sc["levels"]]
            name = f"{run_label(run)} · {sc['name']}"
            ax_tp.plot(xs, [lv["output_tokens_per_s"] or 0 for lv in sc["levels"]], style, label=name)
            ax_lat.plot(xs, [lv["ttft_p50_s"] or 0 for lv in sc["levels"]], style, label=f"{name} TTFT p50")
            ax_lat.plot(xs, [lv["e2e_p50_s"] or 0 for lv in sc["levels"]], style, alpha=0.5, label=f"{name} E2E p50")
    for sc in result["scenarios"]:
        if sc.get("ceiling"):
            ax_tp.axhline(
                sc["ceiling"]["output_tokens_per_s"],
                linestyle=":",
                color="grey",
                label=f"static batch ceiling · {sc['name']}",
            )
    ax_tp.set(xlabel="concurrency", ylabel="output tokens/s", title="throughput")
    ax_lat.set(xlabel="concurrency", ylabel="seconds", title="latency", yscale="log")
    for ax in (ax_tp, ax_lat):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
