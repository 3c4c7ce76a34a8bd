"""What a run prints: the engine suite's table (with targets and, given ``--compare``, ours/peer
per figure) and the load suite's per-level tables."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

from launcher.bench.figures import BY_KEY, FIGURES, compare, meets
from launcher.bench.kernels import kernel_lines
from launcher.bench.load_suite import run_label


def console() -> Console:
    return Console(width=None if sys.stdout.isatty() else 160)


def show(value: float | None, unit: str) -> str:
    """A figure as the benchmark results' tables write it: tok/s to 0.1, times in ms below 1 s, ratios to 0.01."""
    if value is None:
        return "-"
    if unit == "tok/s":
        return f"{value:.1f} tok/s"
    if unit == "s":
        return f"{value * 1e3:.0f} ms" if value < 1 else f"{value:.2f} s"
    return f"{value:.2f}×"


def target_text(key: str) -> str:
    f = BY_KEY[key]
    return f"{'≤' if f.target[0] == '<=' else '≥'} {f.target[1]:g}" if f.target else ""


def engine_table(result: dict, others: list[dict]) -> Table:
    """One row per measured figure: value, own target and whether it is met, then per peer: its
    value, ours/peer, which way is better and who is ahead (and the same-precision target)."""
    opts = result.get("options", {})
    table = Table(
        title=f"{result['label']} · engine suite · {result['base_url']} · "
        f"{opts.get('prompts')} short prompts, {opts.get('clients')} clients, "
        f"{result.get('prompt_tokens', {}).get('doc')}-token document, "
        f"{opts.get('streams')} streams"
    )
    for col in ("figure", result["label"], "target", "met"):
        table.add_column(col, justify="left" if col == "figure" else "right")
    peers = [
        (run_label(o), {c.figure.key: c for c in compare(result["figures"], o.get("figures", {}))}) for o in others
    ]
    for name, _ in peers:
        for col in (name, "ours/peer", "better is", "verdict", "target ours/peer"):
            table.add_column(col, justify="right")
    figures = result["figures"]
    for f in FIGURES:
        if f.key not in figures:
            continue
        ok = meets(f, figures[f.key])
        row = [
            f.label.replace("N clients", f"{opts.get('clients')} clients"),
            show(figures[f.key], f.unit),
            target_text(f.key),
            "" if ok is None else "yes" if ok else "NO",
        ]
        for _, rows in peers:
            c = rows.get(f.key)
            row += (
                [
                    show(c.peer, f.unit),
                    f"{c.ratio:.2f}",
                    f.better,
                    c.verdict,
                    f"≥ {f.peer_target:g}" if f.peer_target else "",
                ]
                if c
                else ["-", "", f.better, "", ""]
            )
        table.add_row(*row)
    return table


def engine_lines(result: dict) -> list[str]:
    """Notes under the table: failures, what the server counted, the stall's coverage, the ceiling,
    the kernel table of the serving worker (ours only)."""
    d = result["details"]
    lines = []
    failed = {k: v["failures"] for k, v in d.items() if v.get("failures")}
    if failed:
        lines.append(
            f"FAILED requests: {failed}; errors: {sorted({e for v in d.values() for e in v.get('errors', [])})[:3]}"
        )
    st = d.get("stall", {})
    if st.get("error"):
        lines.append(f"stall: the document failed: {st['error']}")
    elif st.get("spanning", 0) < st.get("streams", 0):
        lines.append(f"stall: only {st.get('spanning')} of {st.get('streams')} streams ran through the prefill")
    toks = {k: d[k].get("mean_output_tokens") for k in ("c1", "closed_loop", "burst") if k in d}
    lines.append(
        f"output tokens per request (server's count): {toks}; document prompt tokens (server's count): "
        f"{d.get('doc', {}).get('mean_prompt_tokens')}, ours {result.get('prompt_tokens', {}).get('doc')}"
    )
    if st.get("median_gap_s"):
        lines.append(
            f"stall: prefill {show(st['prefill_s'], 's')}, streams' median gap "
            f"{show(st['median_gap_s'], 's')}, longest {show(st['max_gap_s'], 's')}"
        )
    if result.get("ceiling"):
        c = result["ceiling"]
        lines.append(
            f"closed loop / static-batch ceiling ({c['batch']} prompts, {c['output_tokens_per_s']:.1f} tok/s "
            f"in process) = {result['figures']['closed_loop_tok_s'] / c['output_tokens_per_s']:.2f}"
        )
    if result.get("peak_worker_mem_bytes"):
        lines.append(f"peak worker memory {result['peak_worker_mem_bytes'] / 2**20:.0f} MiB")
    return lines + kernel_lines(result.get("kernels"))


def print_engine(result: dict, others: list[dict]) -> None:
    out = console()
    out.print(engine_table(result, others))
    for line in engine_lines(result):
        out.print(line, highlight=False, soft_wrap=True)


def fmt(value, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def print_load(result: dict) -> None:
    out = console()
    for sc in result["scenarios"]:
        table = Table(
            title=f"{result['label']} · {sc['name']} ({sc['input_tokens'] or 'short'} in / "
            f"{sc['output_tokens']} out) · {result['base_url']}"
        )
        for col in (
            "conc",
            "req/s",
            "out tok/s",
            "TTFT p50 ms",
            "TTFT p95 ms",
            "ITL p50 ms",
            "E2E p50 s",
            "E2E p95 s",
            "out tok/req",
            "fail",
            "peak mem MiB",
        ):
            table.add_column(col, justify="right")
        for lv in sc["levels"]:
            table.add_row(
                str(lv["concurrency"]),
                fmt(lv["requests_per_s"]),
                fmt(lv["output_tokens_per_s"], digits=1),
                fmt(lv["ttft_p50_s"], 1e3, 0),
                fmt(lv["ttft_p95_s"], 1e3, 0),
                fmt(lv["itl_p50_s"], 1e3, 1),
                fmt(lv["e2e_p50_s"]),
                fmt(lv["e2e_p95_s"]),
                fmt(lv["mean_output_tokens"], digits=1),
                str(lv["failures"]),
                fmt(lv["peak_worker_mem_bytes"], 2**-20, 0),
            )
        out.print(table)
        for line in sc.get("ratios", []):
            out.print(line, highlight=False)
    for line in kernel_lines(result.get("kernels")):
        out.print(line, highlight=False, soft_wrap=True)
