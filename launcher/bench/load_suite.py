"""The load suite: throughput and latency against concurrency, per scenario (closed loop at each level).

Reported per level: requests/s and output tokens/s over the measured window, TTFT p50/p95, ITL
p50, end-to-end p50/p95, failures and the peak worker memory read from our ``GET /workers``.
"""

from __future__ import annotations

import asyncio

import typer

from launcher.bench import load
from launcher.bench.client import Client, server_root, watch_memory
from launcher.bench.options import BenchOptions
from launcher.bench.prompts import Scenario, chat_messages
from launcher.bench.summary import summarize


def scenario_prompts(tokenizer, scenario: Scenario, n: int = 64) -> list[list[dict]]:
    """``n`` distinct requests of ``scenario`` (the closed loop cycles through them)."""
    return [chat_messages(tokenizer, scenario, i) for i in range(n)]


async def run_scenario(
    opts: BenchOptions, model: str | None, scenario: Scenario, prompts: list[list[dict]], prompt_tokens: int
) -> dict:
    """Every concurrency level of ``opts`` for one scenario; returns its JSON-able result."""
    client = Client(opts.base_url, model, opts.ignore_eos, opts.extra_body, opts.api_key, opts.timeout)
    overrides = {"max_tokens": scenario.output_tokens}
    if opts.response_format is not None:
        overrides["response_format"] = opts.response_format
    levels = []
    try:
        for c in opts.concurrency:
            warmup, n = opts.closed_loop_counts(c)
            typer.echo(f"{scenario.name}: concurrency {c}, {warmup} warm-up + {n} measured requests ...", err=True)
            peak: dict = {}
            stop = asyncio.Event()
            watcher = asyncio.create_task(watch_memory(server_root(opts.base_url), peak, stop, opts.api_key))
            try:
                samples, start, end = await load.closed_loop(client, prompts, c, n, warmup, **overrides)
            finally:
                stop.set()
                await watcher
            levels.append(
                {
                    "concurrency": c,
                    **summarize(samples, start, end, scenario.output_tokens),
                    "peak_worker_mem_bytes": peak.get("bytes"),
                }
            )
    finally:
        await client.close()
    return {
        "name": scenario.name,
        "input_tokens": scenario.input_tokens,
        "output_tokens": scenario.output_tokens,
        "prompt_tokens": prompt_tokens,
        "levels": levels,
    }


def ratio_lines(sc: dict, others: list[dict], label: str) -> list[str]:
    """Scaling (tok/s and TTFT at the top level over the bottom one), the ceiling and each peer."""
    levels = {lv["concurrency"]: lv for lv in sc["levels"]}
    lo, hi = levels[min(levels)], levels[max(levels)]
    lines = []
    if hi is not lo and lo["output_tokens_per_s"]:
        lines.append(
            f"{sc['name']}: output tok/s at c{hi['concurrency']} / c{lo['concurrency']} = "
            f"{hi['output_tokens_per_s'] / lo['output_tokens_per_s']:.2f}"
        )
        if lo["ttft_p50_s"] and hi["ttft_p50_s"]:
            lines.append(
                f"{sc['name']}: TTFT p50 at c{hi['concurrency']} / c{lo['concurrency']} = "
                f"{hi['ttft_p50_s'] / lo['ttft_p50_s']:.2f}"
            )
    ceiling = sc.get("ceiling")
    if ceiling and hi["output_tokens_per_s"]:
        lines.append(
            f"{sc['name']}: output tok/s at c{hi['concurrency']} / static-batch ceiling "
            f"({ceiling['output_tokens_per_s']:.1f} tok/s) = "
            f"{hi['output_tokens_per_s'] / ceiling['output_tokens_per_s']:.2f}"
        )
    for other in others:
        peer = next((s for s in other.get("scenarios", []) if s["name"] == sc["name"]), None)
        peer_lv = {lv["concurrency"]: lv for lv in peer["levels"]} if peer else {}
        for c, lv in sorted(levels.items()):
            if c in peer_lv and peer_lv[c]["output_tokens_per_s"] and lv["output_tokens_per_s"]:
                mine, theirs = lv["output_tokens_per_s"], peer_lv[c]["output_tokens_per_s"]
                lines.append(
                    f"{sc['name']}: output tok/s at c{c}: {label} {mine:.1f} / {run_label(other)} "
                    f"{theirs:.1f} = {mine / theirs:.2f}"
                )
    return lines


def run_label(result: dict) -> str:
    return result.get("label") or result.get("base_url", "other")
