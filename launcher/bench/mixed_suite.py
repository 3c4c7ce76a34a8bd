"""``llamadeploy bench URL --suite mixed``: documents beside chat, the deployment's daily job.

``pipelines`` document pipelines work through ``documents`` documents of real text
(:mod:`launcher.bench.mixed_docs`), asking each document two structured questions one after the
other (a title and summary, then keywords: ``json_schema``, greedy, ``answer_tokens`` at most (160),
not streamed), while ``chat_clients`` colleagues chat in a closed loop (short questions,
``output_tokens`` streamed, default 48). First the chat clients alone (``requests`` requests,
default 4 per client), then beside the documents until the last document is answered. Printed:
chat TTFT p50/p95 alone and beside, the longest pause inside a running stream and the median gap,
chat tokens/s, documents per minute and the share of answers that parse; and the targets' ratios.

``--compare URL`` (a ``/v1`` base URL) runs the same workload against that server after this one,
one server at a time, and prints it beside; ``--compare FILE`` adds an earlier mixed run's JSON.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import httpx
import typer

from launcher.bench.client import Client, auth_headers, served_model
from launcher.bench.load import closed_loop
from launcher.bench.mixed_docs import QUESTIONS, documents, parses, question_body
from launcher.bench.mixed_figures import DocAnswer, chat_figures, doc_figures, ratios, table_lines
from launcher.bench.options import BenchOptions
from launcher.bench.prompts import short_messages
from launcher.bench.summary import Sample

DOC_CHARS = 5000
URL = re.compile(r"^(https?):/+")  # a URL given as --compare (a Path collapses its "//")


async def document_pipelines(opts: BenchOptions, model: str | None, docs: list[tuple[str, str]]) -> list[DocAnswer]:
    """``opts.pipelines`` pipelines taking documents from one queue, each asking every question of
    its document in turn; returns every answer."""
    queue: asyncio.Queue = asyncio.Queue()
    for _, text in docs:
        queue.put_nowait(text)
    answers: list[DocAnswer] = []
    url = opts.base_url.rstrip("/") + "/chat/completions"
    async with httpx.AsyncClient(timeout=opts.timeout, headers=auth_headers(opts.api_key)) as http:

        async def pipeline() -> None:
            while not queue.empty():
                text = queue.get_nowait()
                for kind in range(len(QUESTIONS)):
                    body = {**question_body(model, text, kind, opts.answer_tokens), **opts.extra_body}
                    answers.append(await ask(http, url, body, kind))

        await asyncio.gather(*(pipeline() for _ in range(opts.pipelines)))
    return answers


async def ask(http: httpx.AsyncClient, url: str, body: dict, kind: int) -> DocAnswer:
    start = time.perf_counter()
    try:
        r = await http.post(url, json=body)
        if r.status_code != 200:
            return DocAnswer(start, time.perf_counter(), False, f"HTTP {r.status_code}: {r.text[:200]}")
        content = r.json()["choices"][0]["message"].get("content")
        return DocAnswer(start, time.perf_counter(), parses(content, kind))
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        return DocAnswer(start, time.perf_counter(), False, f"{type(exc).__name__}: {exc}")


async def chat_until(client: Client, clients: int, done: asyncio.Event, **overrides) -> list[Sample]:
    """``clients`` closed-loop chat clients sending short questions until ``done``; the request in
    flight then is cut (and left out of the figures)."""
    samples: list[Sample] = []

    async def one(k: int) -> None:
        i = k
        while not done.is_set():
            sample = Sample("beside", time.perf_counter())
            samples.append(sample)
            await client.send(short_messages("mixed", i), sample, **overrides)
            i += clients

    tasks = [asyncio.create_task(one(k)) for k in range(clients)]
    await done.wait()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return samples


async def run_one(opts: BenchOptions, base_url: str, label: str, model: str | None) -> dict:
    """The whole workload against the server at ``base_url``, asking for ``model``; returns its JSON-able run."""
    opts = BenchOptions(**{**opts.__dict__, "base_url": base_url})
    chat = Client(base_url, model, opts.ignore_eos, opts.extra_body, opts.api_key, opts.timeout)
    overrides = {"max_tokens": opts.output_tokens or 48}
    docs = documents(opts.documents, DOC_CHARS)
    try:
        typer.echo(f"{label}: {opts.chat_clients} chat clients alone ...", err=True)
        prompts = [short_messages("alone", i) for i in range(64)]
        n = opts.requests or 4 * opts.chat_clients
        alone, a0, a1 = await closed_loop(chat, prompts, opts.chat_clients, n, opts.chat_clients, **overrides)
        typer.echo(f"{label}: {len(docs)} documents by {opts.pipelines} pipelines beside the chat ...", err=True)
        done = asyncio.Event()
        chatting = asyncio.create_task(chat_until(chat, opts.chat_clients, done, **overrides))
        b0 = time.perf_counter()
        answers = await document_pipelines(opts, model, docs)
        b1 = time.perf_counter()
        done.set()
        beside = await chatting
    finally:
        await chat.close()
    run = {
        "label": label,
        "base_url": base_url,
        "model": model,
        "documents_used": sorted({name for name, _ in docs}),
        "wall_minus_perf_s": time.time() - time.perf_counter(),  # dates the timelines' perf_counter times
        "chat_alone": chat_figures([s for s in alone if s.kind == "measured"], a0, a1),
        "chat_beside": chat_figures(beside, b0, b1),
        "documents": doc_figures(answers, len(QUESTIONS), b0, b1),
    }
    run["ratios"] = ratios(run)
    return run


def run_mixed_bench(opts: BenchOptions) -> dict:
    """Ours (or the run of ``--from``), then each ``--compare`` URL (or earlier JSON); writes
    ``OUTPUT.json``, prints the table."""
    if opts.replay is not None:
        runs = [read_mixed(opts.replay)]
    else:
        model = opts.model or served_model(opts.base_url, opts.api_key)
        runs = [asyncio.run(run_one(opts, opts.base_url, opts.label, model))]
    for entry in opts.compare:
        text = str(entry)
        if URL.match(text):
            url = URL.sub(r"\1://", text)
            runs.append(asyncio.run(run_one(opts, url, url, served_model(url, opts.api_key))))
        else:
            runs.append(read_mixed(Path(text)))
    result = {"suite": "mixed", "options": opts.public(), "runs": runs}
    opts.output.parent.mkdir(parents=True, exist_ok=True)
    path = opts.output.with_suffix(".json")
    path.write_text(json.dumps(result, indent=2))
    for line in table_lines(runs):
        typer.echo(line)
    typer.echo(f"documents: the descriptions of {', '.join(runs[0]['documents_used'])}")
    typer.echo(f"wrote {path}")
    return result


def read_mixed(path: Path) -> dict:
    """The first run of an earlier mixed run's JSON (``--compare FILE``)."""
    other = json.loads(path.read_text())
    if other.get("suite") != "mixed":
        raise typer.BadParameter(f"--compare {path}: a run of the {other.get('suite', 'load')} suite, not mixed")
    return other["runs"][0]
