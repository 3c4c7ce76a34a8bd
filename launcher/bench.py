"""``llamadeploy bench``: a closed-loop load generator for any OpenAI-compatible ``/v1`` base URL.

For each scenario (fixed prompt and output lengths) and each concurrency level, ``concurrency``
clients each send streamed chat completions back to back. The first ``warmup`` requests of a level
warm the server and are not measured; then ``requests`` are measured; clients keep sending filler
requests until the last measured one ends (and those are cancelled then), so the server stays at
the same concurrency for the whole measured window instead of draining at its end.

Reported per level: requests/s and output tokens/s over the window (every token streamed inside
it counts, whichever request carried it), TTFT p50/p95, inter-token latency p50 (gaps between
streamed chunks), end-to-end latency p50/p95 of the measured requests, failures, and the peak
worker memory read from the router's ``GET /workers`` (absent on servers without it). Results go
to the terminal (a table), ``PREFIX.json`` and ``PREFIX.png`` (throughput and latency against
concurrency).

``--ceiling`` then runs, in this process on the same model and prompts, one static left-padded
batch of ``max(concurrency)`` prompts through ``model.generate`` (greedy, exactly the output
length) and prints our output tokens/s at that concurrency as a ratio of it. ``--compare`` overlays
earlier runs (their JSON) in the plot and prints this run's ratio to each.
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Optional

import httpx
import typer

log = logging.getLogger(__name__)

PASSAGE = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps as his "
    "father had taught him. The lamp was older than the town below, and its brass fittings had been polished "
    "by three generations of hands. Ships passed far out at sea, their lights small and steady, and he wrote "
    "each one into the log with the hour, the wind and the state of the water. In winter the storms came from "
    "the north and the tower shook, yet the lamp never failed. One night a small boat appeared near the rocks, "
    "its sail torn and its crew waving lanterns. He rang the bell, lowered the rope ladder, and ran down to the "
    "shore with a coil of line over his shoulder. "
)
QUESTIONS = [
    "What are three tips for staying focused while studying?", "Explain how rainbows form.",
    "Write a short poem about autumn leaves.", "Why is the sky blue?", "Describe a good breakfast.",
    "How do bees make honey?", "Give me ideas for a rainy weekend.", "What makes a good story?",
]


@dataclass(frozen=True)
class Scenario:
    """``input_tokens`` is the templated prompt length (``None``: a short natural chat question)."""

    name: str
    input_tokens: int | None
    output_tokens: int


SCENARIOS = {"long": Scenario("long", 256, 128), "chat": Scenario("chat", None, 64)}


@dataclass
class Sample:
    """One request's timeline (perf_counter seconds)."""

    kind: str  # warmup | measured | filler
    start: float
    chunks: list[float] = field(default_factory=list)
    end: float | None = None
    completion_tokens: int | None = None
    error: str | None = None
    cut: bool = False

    @property
    def ttft(self) -> float | None:
        return self.chunks[0] - self.start if self.chunks else None


# ---- prompts ------------------------------------------------------------------------------


def chat_messages(tokenizer, scenario: Scenario, index: int) -> list[dict]:
    """Request ``index``'s messages: distinct per request, ``input_tokens`` long once templated."""
    if scenario.input_tokens is None:
        return [{"role": "user", "content": f"{QUESTIONS[index % len(QUESTIONS)]} (#{index})"}]
    head = f"Story {index}. Continue this story in at least 500 words.\n\n"
    words = PASSAGE.split()
    body = " ".join(words[index % len(words):] + words[: index % len(words)]) + " " + PASSAGE * 8
    ids = tokenizer(body, add_special_tokens=False)["input_ids"]

    def templated(k: int) -> tuple[list[dict], int]:
        msgs = [{"role": "user", "content": head + tokenizer.decode(ids[:k])}]
        return msgs, len(prompt_ids(tokenizer, msgs))

    k = max(1, scenario.input_tokens - templated(0)[1])
    msgs, n = templated(k)
    for _ in range(8):  # re-tokenizing decoded text can merge or split a token: nudge to the target
        if n == scenario.input_tokens:
            break
        k = max(1, k + scenario.input_tokens - n)
        msgs, n = templated(k)
    return msgs


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ---- one request, one level ---------------------------------------------------------------


class Client:
    """Sends streamed chat completions to ``base_url`` and records their timelines."""

    def __init__(self, base_url: str, model: str | None, output_tokens: int, ignore_eos: bool, extra: dict,
                 api_key: str | None, timeout: float):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.body = {"stream": True, "temperature": 0, "max_tokens": output_tokens,
                     "stream_options": {"include_usage": True}, **extra}
        if model:
            self.body["model"] = model
        if ignore_eos:
            self.body["ignore_eos"] = True
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(timeout=timeout, headers=headers,
                                      limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))

    async def send(self, messages: list[dict], sample: Sample) -> None:
        try:
            async with self.http.stream("POST", self.url, json={**self.body, "messages": messages}) as r:
                if r.status_code != 200:
                    sample.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                    return
                async for line in r.aiter_lines():
                    self._on_line(line, sample)
        except httpx.HTTPError as exc:
            sample.error = f"{type(exc).__name__}: {exc}"
        except asyncio.CancelledError:
            sample.cut = True  # a filler still streaming when the measured window closed
            raise
        finally:
            sample.end = time.perf_counter()

    @staticmethod
    def _on_line(line: str, sample: Sample) -> None:
        if not line.startswith("data: ") or line == "data: [DONE]":
            return
        event = json.loads(line[6:])
        if "error" in event:
            sample.error = str(event["error"])[:200]
            return
        if event.get("usage"):
            sample.completion_tokens = event["usage"].get("completion_tokens")
        for choice in event.get("choices") or []:
            if (choice.get("delta") or {}).get("content"):
                sample.chunks.append(time.perf_counter())

    async def close(self) -> None:
        await self.http.aclose()


async def run_level(client: Client, prompts: list[list[dict]], concurrency: int, requests: int,
                    warmup: int) -> tuple[list[Sample], float, float]:
    """Closed loop at ``concurrency``. Returns every sample and the measured window (start, end)."""
    samples: list[Sample] = []
    issued = 0
    window: dict[str, float] = {}
    measured_done = asyncio.Event()
    pending = {"measured": requests}

    async def worker() -> None:
        nonlocal issued
        while not measured_done.is_set():
            index = issued
            issued += 1
            kind = "warmup" if index < warmup else "measured" if index < warmup + requests else "filler"
            if kind == "measured":
                window.setdefault("start", time.perf_counter())
            sample = Sample(kind, time.perf_counter())
            samples.append(sample)
            await client.send(prompts[index % len(prompts)], sample)
            if kind == "measured":
                pending["measured"] -= 1
                if pending["measured"] == 0:
                    window["end"] = time.perf_counter()
                    measured_done.set()

    tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
    await measured_done.wait()
    for t in tasks:
        t.cancel()  # fillers still streaming are cut off (the server cancels them)
    await asyncio.gather(*tasks, return_exceptions=True)
    return samples, window["start"], window["end"]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def summarize(samples: list[Sample], start: float, end: float, output_tokens: int) -> dict:
    """Window throughput and measured latencies.

    Every chunk streamed inside [start, end] counts, whichever request carried it (a chunk counts
    as ``completion_tokens / chunks`` tokens); requests/s counts request-equivalents served in the
    window (each request contributes the share of its tokens that fell inside it; a filler cut off
    at the end, whose total is unknown, counts against ``output_tokens``).
    """
    span = end - start
    tokens = served = 0.0
    for s in samples:
        if s.error or not s.chunks:
            continue
        per_chunk = (s.completion_tokens or len(s.chunks)) / len(s.chunks)
        inside = per_chunk * sum(start <= t <= end for t in s.chunks)
        tokens += inside
        served += inside / (s.completion_tokens or max(output_tokens, len(s.chunks)))
    measured = [s for s in samples if s.kind == "measured"]
    ok = [s for s in measured if not s.error and s.chunks]
    gaps = [b - a for s in ok for a, b in zip(s.chunks, s.chunks[1:])]
    ttft = [s.ttft for s in ok]
    e2e = [s.end - s.start for s in ok]
    out_tokens = [s.completion_tokens for s in ok if s.completion_tokens is not None]
    return {
        "requests": len(measured), "failures": len(measured) - len(ok), "window_s": round(span, 2),
        "requests_per_s": served / span, "output_tokens_per_s": tokens / span,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95), "itl_p50_s": percentile(gaps, 50),
        "e2e_p50_s": percentile(e2e, 50), "e2e_p95_s": percentile(e2e, 95),
        "mean_output_tokens": statistics.mean(out_tokens) if out_tokens else None,
        "errors": sorted({s.error for s in measured if s.error})[:3],
    }


# ---- server info --------------------------------------------------------------------------


def server_root(base_url: str) -> str:
    return base_url.rstrip("/").removesuffix("/v1")


def served_model(base_url: str, api_key: str | None) -> str | None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base_url.rstrip("/") + "/models", timeout=10, headers=headers)
        return r.json()["data"][0]["id"] if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return None


async def watch_memory(root: str, peak: dict, stop: asyncio.Event, api_key: str | None) -> None:
    """Poll ``GET /workers`` and keep the largest ``mem_bytes`` of any worker (None if absent)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=5, headers=headers) as http:
        while not stop.is_set():
            try:
                r = await http.get(root + "/workers")
                if r.status_code == 200:
                    mem = max((w.get("mem_bytes") or 0 for w in r.json().get("workers", [])), default=0)
                    peak["bytes"] = max(peak.get("bytes") or 0, mem)
            except (httpx.HTTPError, ValueError):
                pass
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except TimeoutError:
                pass


async def bench_level(client: Client, root: str, prompts, concurrency: int, requests: int, warmup: int,
                      api_key: str | None, output_tokens: int) -> dict:
    peak: dict = {}
    stop = asyncio.Event()
    watcher = asyncio.create_task(watch_memory(root, peak, stop, api_key))
    try:
        samples, start, end = await run_level(client, prompts, concurrency, requests, warmup)
    finally:
        stop.set()
        await watcher
    return {"concurrency": concurrency, **summarize(samples, start, end, output_tokens),
            "peak_worker_mem_bytes": peak.get("bytes")}


# ---- the static-batch ceiling -------------------------------------------------------------


@lru_cache(maxsize=1)
def _load_model(model_path: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def static_ceiling(model_path: str, tokenizer, prompts: list[list[dict]], output_tokens: int, ignore_eos: bool) -> dict:
    """Output tokens/s of one left-padded batch of ``prompts`` through ``model.generate`` (greedy, float32)."""
    import torch

    model = _load_model(model_path)
    ids = [prompt_ids(tokenizer, m) for m in prompts]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    batch = tokenizer.pad({"input_ids": ids}, return_tensors="pt", padding_side="left")
    kw = {"max_new_tokens": output_tokens, "do_sample": False, "pad_token_id": pad}
    if ignore_eos:
        kw["min_new_tokens"] = output_tokens
    with torch.inference_mode():
        model.generate(**tokenizer.pad({"input_ids": ids[:1]}, return_tensors="pt"), max_new_tokens=4,
                       do_sample=False, pad_token_id=pad)  # warm-up
        t = time.perf_counter()
        out = model.generate(**batch, **kw)
        elapsed = time.perf_counter() - t
    new = out[:, batch["input_ids"].shape[1]:]
    produced = int(sum(min(len(row), output_tokens) for row in new))
    return {"batch": len(ids), "output_tokens": produced, "seconds": round(elapsed, 2),
            "output_tokens_per_s": produced / elapsed}


# ---- reporting ----------------------------------------------------------------------------


def fmt(value, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def print_table(result: dict) -> None:
    import sys

    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 160)
    for sc in result["scenarios"]:
        table = Table(title=f"{result['label']} · {sc['name']} ({sc['input_tokens'] or 'short'} in / "
                            f"{sc['output_tokens']} out) · {result['base_url']}")
        for col in ("conc", "req/s", "out tok/s", "TTFT p50 ms", "TTFT p95 ms", "ITL p50 ms", "E2E p50 s",
                    "E2E p95 s", "out tok/req", "fail", "peak mem MiB"):
            table.add_column(col, justify="right")
        for lv in sc["levels"]:
            table.add_row(str(lv["concurrency"]), fmt(lv["requests_per_s"]), fmt(lv["output_tokens_per_s"], digits=1),
                          fmt(lv["ttft_p50_s"], 1e3, 0), fmt(lv["ttft_p95_s"], 1e3, 0), fmt(lv["itl_p50_s"], 1e3, 1),
                          fmt(lv["e2e_p50_s"]), fmt(lv["e2e_p95_s"]), fmt(lv["mean_output_tokens"], digits=1),
                          str(lv["failures"]), fmt(lv["peak_worker_mem_bytes"], 2**-20, 0))
        console.print(table)
        for line in sc.get("ratios", []):
            typer.echo(line)


def ratios(sc: dict, ceiling: dict | None, others: list[dict], label: str) -> list[str]:
    """The lines the targets are read from: scaling, TTFT growth, ceiling and peers."""
    levels = {lv["concurrency"]: lv for lv in sc["levels"]}
    lo, hi = levels[min(levels)], levels[max(levels)]
    lines = []
    if hi is not lo:
        lines.append(f"{sc['name']}: output tok/s at c{hi['concurrency']} / c{lo['concurrency']} = "
                     f"{hi['output_tokens_per_s'] / lo['output_tokens_per_s']:.2f}")
        if lo["ttft_p50_s"] and hi["ttft_p50_s"]:
            lines.append(f"{sc['name']}: TTFT p50 at c{hi['concurrency']} / c{lo['concurrency']} = "
                         f"{hi['ttft_p50_s'] / lo['ttft_p50_s']:.2f}")
    if ceiling:
        lines.append(f"{sc['name']}: output tok/s at c{hi['concurrency']} / static-batch ceiling "
                     f"({ceiling['output_tokens_per_s']:.1f} tok/s) = {hi['output_tokens_per_s'] / ceiling['output_tokens_per_s']:.2f}")
    for other in others:
        peer = next((s for s in other["scenarios"] if s["name"] == sc["name"]), None)
        peer_lv = {lv["concurrency"]: lv for lv in peer["levels"]} if peer else {}
        for c, lv in sorted(levels.items()):
            if c in peer_lv and peer_lv[c]["output_tokens_per_s"]:
                mine, theirs = lv["output_tokens_per_s"], peer_lv[c]["output_tokens_per_s"]
                lines.append(f"{sc['name']}: output tok/s at c{c}: {label} {mine:.1f} / {sc_label(other)} "
                             f"{theirs:.1f} = {mine / theirs:.2f}")
    return lines


def sc_label(result: dict) -> str:
    return result.get("label") or result.get("base_url", "other")


def plot(result: dict, others: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tp, ax_lat) = plt.subplots(1, 2, figsize=(11, 4.2))
    for run, style in [(result, "-o")] + [(o, "--s") for o in others]:
        for sc in run["scenarios"]:
            xs = [lv["concurrency"] for lv in sc["levels"]]
            name = f"{sc_label(run)} · {sc['name']}"
            ax_tp.plot(xs, [lv["output_tokens_per_s"] for lv in sc["levels"]], style, label=name)
            ax_lat.plot(xs, [lv["ttft_p50_s"] or 0 for lv in sc["levels"]], style, label=f"{name} TTFT p50")
            ax_lat.plot(xs, [lv["e2e_p50_s"] or 0 for lv in sc["levels"]], style, alpha=0.5, label=f"{name} E2E p50")
    for sc in result["scenarios"]:
        if sc.get("ceiling"):
            ax_tp.axhline(sc["ceiling"]["output_tokens_per_s"], linestyle=":", color="grey",
                          label=f"static batch ceiling · {sc['name']}")
    ax_tp.set(xlabel="concurrency", ylabel="output tokens/s", title="throughput")
    ax_lat.set(xlabel="concurrency", ylabel="seconds", title="latency", yscale="log")
    for ax in (ax_tp, ax_lat):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- entry --------------------------------------------------------------------------------


async def bench_scenario(args: dict, tokenizer, scenario: Scenario, model: str | None) -> dict:
    prompts = [chat_messages(tokenizer, scenario, i) for i in range(64)]
    client = Client(args["base_url"], model, scenario.output_tokens, args["ignore_eos"], args["extra"],
                    args["api_key"], args["timeout"])
    root = server_root(args["base_url"])
    levels = []
    try:
        for c in args["concurrency"]:
            n = args["requests"] or max(8, 4 * c)
            warmup = c if args["warmup"] is None else args["warmup"]
            typer.echo(f"{scenario.name}: concurrency {c}, {warmup} warm-up + {n} measured requests ...", err=True)
            levels.append(await bench_level(client, root, prompts, c, n, warmup, args["api_key"], scenario.output_tokens))
    finally:
        await client.close()
    return {"name": scenario.name, "input_tokens": scenario.input_tokens, "output_tokens": scenario.output_tokens,
            "prompt_tokens": len(prompt_ids(tokenizer, prompts[0])), "levels": levels, "_prompts": prompts}


def bench_command(
    base_url: str = typer.Argument("http://127.0.0.1:8000/v1", help="OpenAI-compatible base URL (ours or a peer's)"),
    model: Optional[str] = typer.Option(None, help="the `model` to request (default: the first of GET /models)"),
    tokenizer: Optional[str] = typer.Option(None, help="tokenizer folder or model name (default: --model, resolved)"),
    scenario: list[str] = typer.Option(["long", "chat"], help="long (256 in / 128 out) and/or chat (short in / 64 out)"),
    output_tokens: Optional[int] = typer.Option(None, help="override every scenario's output length"),
    concurrency: str = typer.Option("1,8", help="comma-separated concurrency levels"),
    requests: Optional[int] = typer.Option(None, help="measured requests per level (default max(8, 4 × concurrency))"),
    warmup: Optional[int] = typer.Option(None, help="warm-up requests per level (default: the concurrency)"),
    ignore_eos: bool = typer.Option(True, help="send ignore_eos so every request streams exactly the output length"),
    extra_body: str = typer.Option("{}", help="JSON merged into every request body (peer-specific fields)"),
    ceiling: bool = typer.Option(False, "--ceiling", help="also run one static padded batch in process and print the ratio"),
    compare: list[Path] = typer.Option([], help="earlier bench JSON to overlay and compare against"),
    label: str = typer.Option("llamadeploy", help="name of this run in the table, JSON and plot"),
    output: Path = typer.Option(Path("bench"), help="writes OUTPUT.json and OUTPUT.png"),
    api_key: Optional[str] = typer.Option(None, envvar="LLAMADEPLOY_BENCH_API_KEY", help="bearer key for /v1"),
    timeout: float = typer.Option(600.0, help="per-request timeout, seconds"),
) -> None:
    """Load-test an OpenAI-compatible server: throughput and latency against concurrency."""
    from transformers import AutoTokenizer

    from launcher.models import ModelNotFound, resolve_model

    unknown = [s for s in scenario if s not in SCENARIOS]
    if unknown:
        raise typer.BadParameter(f"unknown scenario {unknown[0]!r}; choose from {', '.join(SCENARIOS)}")
    model = model or served_model(base_url, api_key)
    try:
        model_path = str(resolve_model(tokenizer or model or "smollm2-135m-instruct", progress=False))
    except ModelNotFound as exc:
        raise typer.BadParameter(f"--tokenizer: {exc}") from None
    tok = AutoTokenizer.from_pretrained(model_path)
    args = {"base_url": base_url, "concurrency": [int(c) for c in concurrency.split(",") if c.strip()],
            "requests": requests, "warmup": warmup, "ignore_eos": ignore_eos, "extra": json.loads(extra_body),
            "api_key": api_key, "timeout": timeout}
    others = [json.loads(p.read_text()) for p in compare]
    result = {"label": label, "base_url": base_url, "model": model, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
              "scenarios": []}
    for name in scenario:
        sc = SCENARIOS[name]
        if output_tokens is not None:
            sc = Scenario(sc.name, sc.input_tokens, output_tokens)
        out = asyncio.run(bench_scenario(args, tok, sc, model))
        prompts = out.pop("_prompts")
        if ceiling:
            typer.echo(f"{sc.name}: static-batch ceiling in process ...", err=True)
            out["ceiling"] = static_ceiling(model_path, tok, prompts[: max(args["concurrency"])], sc.output_tokens,
                                            ignore_eos)
        out["ratios"] = ratios(out, out.get("ceiling"), others, label)
        result["scenarios"].append(out)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.with_suffix(".json").write_text(json.dumps(result, indent=2))
    plot(result, others, output.with_suffix(".png"))
    print_table(result)
    typer.echo(f"wrote {output.with_suffix('.json')} and {output.with_suffix('.png')}")


__all__ = ["SCENARIOS", "Sample", "Scenario", "bench_command", "summarize"]
