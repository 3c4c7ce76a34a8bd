"""``llamadeploy bench URL --suite engine --embedding-load C``: chat beside a steady embedding load.

For a deployment serving a chat model and an embedding model: the engine suite's c1 and closed-loop
parts (:mod:`launcher.bench.engine_suite`) run twice, first with the embedding model idle, then
while ``C`` closed-loop clients each send one-sentence ``/v1/embeddings`` requests back to back
(started before the chat part, stopped after it). The figures come out side by side with
``with load / alone`` per figure; the aim, when the two models have their own cores, is that chat
stays within :data:`TOLERANCE` of chat alone (throughput at least 0.9×, latency at most 1.1×).
The embedding clients' inputs/s during the loaded run is printed too, so a run where the load
did not flow (errors, a wrong model) is plain.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import typer

from launcher.bench import load
from launcher.bench.client import Client, auth_headers
from launcher.bench.embed_suite import EmbedClient, sentences
from launcher.bench.engine_suite import build_prompts, step
from launcher.bench.options import BenchOptions
from launcher.bench.summary import batch_summary, ratio, summarize

TOLERANCE = 0.10
# (key, what, which way is better): the figures compared, from the c1 and closed-loop summaries
FIGURES = (
    ("c1_tok_s", "c1: output tok/s", "higher"),
    ("c1_ttft_p50_s", "c1: TTFT p50", "lower"),
    ("closed_loop_tok_s", "closed loop: output tok/s", "higher"),
    ("closed_loop_ttft_p50_s", "closed loop: TTFT p50", "lower"),
)


class SteadyEmbeddings:
    """``clients`` closed-loop clients sending one sentence per ``/v1/embeddings`` request until
    :meth:`stop`; counts the inputs answered and the errors."""

    def __init__(self, client: EmbedClient, clients: int):
        self.client = client
        self.clients = clients
        self.served = 0
        self.errors: list[str] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        texts = sentences(4096)
        self._tasks = [asyncio.create_task(self._one(k, texts)) for k in range(self.clients)]

    async def _one(self, k: int, texts: list[str]) -> None:
        i = k
        while not self._stop.is_set():
            _, error = await self.client.send(texts[i % len(texts)])
            if error:
                self.errors.append(error)
            else:
                self.served += 1
            i += self.clients

    async def wait_flowing(self, timeout: float) -> None:
        """Return once every client has had an answer (the load is on); raise if none comes."""
        deadline = time.perf_counter() + timeout
        while self.served + len(self.errors) < self.clients:
            if time.perf_counter() > deadline:
                raise typer.BadParameter(f"the embedding load got no answer within {timeout:.0f}s")
            await asyncio.sleep(0.01)
        if self.errors and not self.served:
            raise typer.BadParameter(f"the embedding load fails: {self.errors[0]}")

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def chat_parts(opts: BenchOptions, client: Client, tokenizer) -> dict[str, float | None]:
    """The engine suite's warm-up, c1 and closed loop, with fresh prompts: the figures of :data:`FIGURES`."""
    prompts = build_prompts(tokenizer, opts)
    short = {"max_tokens": opts.short_output_tokens}
    await load.one_after_another(client, prompts.warm, "warmup", **short)
    step(f"c1 ({len(prompts.c1)} short prompts one after another)")
    c1 = batch_summary(await load.one_after_another(client, prompts.c1, "c1", **short))
    warmup, requests = opts.closed_loop_counts(opts.clients)
    step(f"closed loop ({opts.clients} clients, {warmup} warm-up + {requests} measured)")
    samples, start, end = await load.closed_loop(client, prompts.closed, opts.clients, requests, warmup, **short)
    closed = summarize(samples, start, end, opts.short_output_tokens)
    if c1["failures"] or closed["failures"]:
        typer.echo(f"chat failures: {c1['errors'] or closed.get('errors') or 'see the server log'}", err=True)
    return {
        "c1_tok_s": c1["output_tokens_per_s"],
        "c1_ttft_p50_s": c1["ttft_p50_s"],
        "closed_loop_tok_s": closed["output_tokens_per_s"],
        "closed_loop_ttft_p50_s": closed["ttft_p50_s"],
    }


async def run_beside(opts: BenchOptions, model: str | None, embedding_model: str, tokenizer) -> dict:
    """Chat alone, then chat beside ``opts.embedding_load`` embedding clients (module docstring)."""
    chat = Client(opts.base_url, model, opts.ignore_eos, opts.extra_body, opts.api_key, opts.timeout)
    embeddings = EmbedClient(opts, embedding_model)
    try:
        typer.echo("chat alone (the embedding model idle) ...", err=True)
        alone = await chat_parts(opts, chat, tokenizer)
        typer.echo(f"chat beside {opts.embedding_load} embedding clients ...", err=True)
        steady = SteadyEmbeddings(embeddings, opts.embedding_load)
        steady.start()
        try:
            await steady.wait_flowing(opts.timeout)
            served, began = steady.served, time.perf_counter()
            loaded = await chat_parts(opts, chat, tokenizer)
            rate = (steady.served - served) / (time.perf_counter() - began)
        finally:
            await steady.stop()
    finally:
        await chat.close()
        await embeddings.http.aclose()
    load_figures = {"clients": opts.embedding_load, "inputs_per_s": rate, "errors": len(steady.errors)}
    return {"alone": alone, "loaded": loaded, "embedding_load": load_figures}


def compared(alone: dict, loaded: dict) -> list[dict]:
    """Per figure: both values, ``loaded / alone`` and whether it stays within :data:`TOLERANCE`
    (None where either value is missing)."""
    rows = []
    for key, label, better in FIGURES:
        r = ratio(loaded.get(key), alone.get(key))
        within = None if r is None else (r >= 1 - TOLERANCE if better == "higher" else r <= 1 + TOLERANCE)
        rows.append(
            {
                "key": key,
                "label": label,
                "alone": alone.get(key),
                "loaded": loaded.get(key),
                "ratio": r,
                "within": within,
            }
        )
    return rows


def lines(result: dict) -> list[str]:
    """The printed table: one line per figure, then the embedding load's own rate."""
    emb = result["embedding_load"]
    out = [
        f"{result['label']}: chat ({result['model']}) alone and beside {emb['clients']} embedding clients "
        f"({result['embedding_model']}) at {result['base_url']}",
        f"{'figure':<28} {'alone':>10} {'with load':>10} {'ratio':>7}  within {TOLERANCE:.0%}",
    ]
    for row in result["ratios"]:
        seconds = row["key"].endswith("_p50_s")  # a latency, shown in ms
        r = f"{row['ratio']:>6.2f}×" if row["ratio"] is not None else f"{'-':>7}"
        verdict = {True: "yes", False: "NO", None: "-"}[row["within"]]
        out.append(
            f"{row['label'] + (' ms' if seconds else ''):<28} {_value(row['alone'], seconds)} "
            f"{_value(row['loaded'], seconds)} {r}  {verdict}"
        )
    rate = emb["inputs_per_s"]
    out.append(
        f"embedding load during the chat part: {rate:.1f} inputs/s, {emb['errors']} errors"
        if rate is not None
        else "embedding load: not measured"
    )
    return out


def _value(value: float | None, seconds: bool) -> str:
    if value is None:
        return f"{'-':>10}"
    return f"{value * (1000 if seconds else 1):>10.1f}"


def first_embedding_model(base_url: str, api_key: str | None) -> str:
    """The id of the first ``task: embed`` model of ``GET /models``; BadParameter when there is none."""
    try:
        r = httpx.get(base_url.rstrip("/") + "/models", timeout=10, headers=auth_headers(api_key))
        found = next((m["id"] for m in r.json()["data"] if m.get("task") == "embed"), None)
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        raise typer.BadParameter(f"--embedding-load: could not list {base_url}/models: {exc}") from None
    if found is None:
        raise typer.BadParameter(
            f"--embedding-load: {base_url} serves no embedding model (task: embed); name one with --embedding-model"
        )
    return found


def run_beside_bench(opts: BenchOptions, head: dict, tokenizer) -> dict:
    """Run (or with ``--from``, reload) the comparison, write ``OUTPUT.json``, print it."""
    if opts.replay is not None:
        result = json.loads(opts.replay.read_text())
    else:
        embedding_model = opts.embedding_model or first_embedding_model(opts.base_url, opts.api_key)
        result = {"suite": "beside", **head, "embedding_model": embedding_model}
        result.update(asyncio.run(run_beside(opts, head["model"], embedding_model, tokenizer)))
        result["ratios"] = compared(result["alone"], result["loaded"])
        path = opts.output.with_suffix(".json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        typer.echo(f"wrote {path}")
    for line in lines(result):
        typer.echo(line)
    return result
