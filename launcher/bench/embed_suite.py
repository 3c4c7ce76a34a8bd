"""``llamadeploy bench --suite embed``: an embeddings server's throughput and latency.

One-sentence inputs (one per request) in a closed loop at each concurrency (default 1, 8 and 64;
:data:`MIN_REQUESTS` requests or :data:`PER_CLIENT` per client, whichever is more):
inputs per second and p50/p95 request latency; then one request of :data:`BATCH_INPUTS` sentences
(the best of :data:`BATCH_RUNS`): its latency and inputs per second. Works against any
OpenAI-compatible ``/v1/embeddings`` (ours, ``llama-server --embedding``...); ``--compare`` with
an earlier run's JSON prints ours over theirs per figure.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import typer

from launcher.bench.client import auth_headers, served_model
from launcher.bench.options import BenchOptions
from launcher.bench.summary import percentile, ratio

EMBED_CONCURRENCY = (1, 8, 64)
# requests per level unless --requests: at least MIN_REQUESTS, and PER_CLIENT per client. 64 at
# concurrency 8 was a window of ~0.35 s, mostly the ramp of the first steps (two runs of one
# server differed by 20%)
MIN_REQUESTS = 320
PER_CLIENT = 8
BATCH_INPUTS = 512
BATCH_RUNS = 3
SUBJECTS = (
    "The engineer",
    "A small dog",
    "The committee",
    "My neighbour",
    "The old bridge",
    "A red train",
    "The river",
)
VERBS = ("inspects", "ignores", "crosses", "describes", "remembers", "waits for", "paints", "repairs")
OBJECTS = ("the harbour", "a letter", "the north tower", "an empty field", "the noisy market", "a broken clock")


def sentences(n: int) -> list[str]:
    """``n`` distinct one-sentence inputs (about 10 tokens each), the same on every run."""
    out = []
    for i in range(n):
        s, v, o = SUBJECTS[i % 7], VERBS[(i // 7) % 8], OBJECTS[(i // 56) % 6]
        out.append(f"{s} {v} {o} on day {i}.")
    return out


class EmbedClient:
    """POSTs ``/embeddings`` (float vectors, as a server is compared on equal terms) over one pool."""

    def __init__(self, opts: BenchOptions, model: str | None):
        self.url = opts.base_url.rstrip("/") + "/embeddings"
        self.body = {"encoding_format": "float", **opts.extra_body, **({"model": model} if model else {})}
        self.http = httpx.AsyncClient(
            timeout=opts.timeout,
            headers=auth_headers(opts.api_key),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )

    async def send(self, inputs: str | list[str]) -> tuple[float, str | None]:
        """One request: (seconds it took, None or what went wrong)."""
        start = time.perf_counter()
        try:
            r = await self.http.post(self.url, json={**self.body, "input": inputs})
            error = None if r.status_code == 200 and r.json().get("data") else f"HTTP {r.status_code}: {r.text[:200]}"
        except (httpx.HTTPError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        return time.perf_counter() - start, error


async def closed_loop(client: EmbedClient, texts: list[str], concurrency: int, warmup: int) -> dict:
    """``concurrency`` clients send ``texts`` one per request (after ``warmup`` unmeasured requests each)."""
    await asyncio.gather(*(client.send(texts[i]) for i in range(min(warmup, len(texts)))))
    queue = list(reversed(texts))
    latencies: list[float] = []
    errors: list[str] = []

    async def worker() -> None:
        while queue:
            took, error = await client.send(queue.pop())
            (errors.append(error) if error else latencies.append(took))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    return {
        "concurrency": concurrency,
        "requests": len(texts),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "inputs_per_s": len(latencies) / wall if wall else None,
        "p50_ms": _ms(percentile(latencies, 50)),
        "p95_ms": _ms(percentile(latencies, 95)),
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


async def one_batch(client: EmbedClient, texts: list[str]) -> dict:
    """The best of :data:`BATCH_RUNS` requests of all ``texts`` at once."""
    runs = [await client.send(texts) for _ in range(BATCH_RUNS)]
    ok = [took for took, error in runs if error is None]
    best = min(ok) if ok else None
    return {
        "inputs": len(texts),
        "errors": len(runs) - len(ok),
        "first_error": next((e for _, e in runs if e), None),
        "latency_ms": _ms(best),
        "inputs_per_s": len(texts) / best if best else None,
    }


async def run_embed_suite(opts: BenchOptions, model: str | None) -> dict:
    """The suite's figures (module docstring)."""
    levels = opts.concurrency if opts.concurrency != BenchOptions().concurrency else EMBED_CONCURRENCY
    client = EmbedClient(opts, model)
    try:
        out = []
        for c in levels:
            count = opts.requests or max(MIN_REQUESTS, PER_CLIENT * c)
            typer.echo(f"embed: concurrency {c}, {count} one-sentence requests ...", err=True)
            out.append(await closed_loop(client, sentences(count), c, opts.warmup if opts.warmup is not None else c))
        typer.echo(f"embed: one request of {BATCH_INPUTS} inputs ×{BATCH_RUNS} ...", err=True)
        batch = await one_batch(client, sentences(BATCH_INPUTS))
    finally:
        await client.http.aclose()
    return {"levels": out, "batch": batch}


def compared(result: dict, others: list[dict]) -> list[str]:
    """Lines of ``result``'s inputs/s over each other run's, per concurrency and for the batch."""
    lines = []
    for other in others:
        theirs = {lv["concurrency"]: lv for lv in other.get("levels", [])}
        for lv in result["levels"]:
            r = ratio(lv["inputs_per_s"], theirs.get(lv["concurrency"], {}).get("inputs_per_s"))
            if r is not None:
                lines.append(f"c{lv['concurrency']}: {result['label']} / {other['label']} inputs/s = {r:.2f}×")
        r = ratio(result["batch"]["inputs_per_s"], other.get("batch", {}).get("inputs_per_s"))
        if r is not None:
            lines.append(f"batch of {BATCH_INPUTS}: {result['label']} / {other['label']} inputs/s = {r:.2f}×")
    return lines


def print_embed(result: dict) -> None:
    """The run's table and its comparison lines."""
    typer.echo(f"{result['label']} ({result['model']}) embeddings at {result['base_url']}")
    typer.echo(f"{'concurrency':>11} {'inputs/s':>10} {'p50 ms':>9} {'p95 ms':>9} {'errors':>7}")
    for lv in result["levels"]:
        typer.echo(
            f"{lv['concurrency']:>11} {_fmt(lv['inputs_per_s'])} {_fmt(lv['p50_ms'])} {_fmt(lv['p95_ms'])} "
            f"{lv['errors']:>7}"
        )
    b = result["batch"]
    typer.echo(
        f"one request of {b['inputs']} inputs: {_fmt(b['latency_ms'])} ms, {_fmt(b['inputs_per_s'])} inputs/s"
        f"{', errors: ' + str(b['errors']) if b['errors'] else ''}"
    )
    for line in result.get("ratios", []):
        typer.echo(line)


def _fmt(value: float | None) -> str:
    return f"{value:>10.1f}" if value is not None else f"{'-':>10}"


def run_embed_bench(opts: BenchOptions, others: list[dict]) -> dict:
    """Run (or with ``--from``, reload) the suite, compare, write ``OUTPUT.json``, print."""
    if opts.replay is not None:
        result = json.loads(opts.replay.read_text())
    else:
        model = opts.model or served_model(opts.base_url, opts.api_key)
        result = {
            "suite": "embed",
            "label": opts.label,
            "base_url": opts.base_url,
            "model": model,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "options": opts.public(),
            **asyncio.run(run_embed_suite(opts, model)),
        }
    result["ratios"] = compared(result, others)
    if opts.replay is None:
        path = opts.output.with_suffix(".json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        typer.echo(f"wrote {path}")
    print_embed(result)
    return result
