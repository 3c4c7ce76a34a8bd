"""The engine suite: the engine's headline figures (docs/benchmarks/), measured in one run against one server.

In order: two warm-up requests (not measured); ``c1``: ``prompts`` short prompts one after another;
``closed_loop``: ``clients`` clients back to back; ``burst``: ``prompts`` short prompts sent at
once; ``doc``: a ``doc_tokens``-token document alone, short answer; ``doc_again``: the same
document right after (a prefix cache makes this fast); ``stall``: ``streams`` long chat streams,
and a second document of the same length (sharing no prefix with the first) arriving among them;
``json`` (only with ``response_format``): c1 again with that ``response_format`` and no
``ignore_eos`` (a schema decides where its output ends).

With ``ignore_eos`` the stall's streams also ban the tokenizer's special tokens
(:func:`~launcher.bench.prompts.special_token_bias`): a stream runs long past its answer, and
the stall is measured between chunks of text, so a token without text (``<|im_end|>`` sampled
past the end) would read as a pause of the engine.

Every prompt opens with a tag unique to the run and request, so nothing is a cache hit except the
repeated document (and the chat template's head, which every chat shares).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass

import typer

from launcher.bench import load
from launcher.bench.client import Client, server_root, watch_memory
from launcher.bench.figures import engine_figures
from launcher.bench.options import BenchOptions
from launcher.bench.prompts import document_messages, prompt_ids, short_messages, special_token_bias
from launcher.bench.summary import Sample, batch_summary, stall_summary, summarize

STREAM_TOKENS = 1024  # long enough to outlast any document prefill; the streams are cancelled after it


@dataclass(frozen=True)
class EnginePrompts:
    """The messages of every request of one engine-suite run (lists of chat ``messages``)."""

    warm: list
    c1: list
    closed: list
    burst: list
    streams: list
    json: list
    doc: list
    stall_doc: list
    stream_bias: dict  # the stall streams' logit_bias: the special tokens banned


def build_prompts(tokenizer, opts: BenchOptions, tag: str | None = None) -> EnginePrompts:
    """Prompts for one run; ``tag`` (default: random) makes them distinct from any earlier run's."""
    tag = tag or secrets.token_hex(3)
    short = lambda group, n: [short_messages(f"{tag}{group}", i) for i in range(n)]  # noqa: E731
    warmup, requests = opts.closed_loop_counts(opts.clients)
    return EnginePrompts(
        warm=short("w", 2),
        c1=short("a", opts.prompts),
        closed=short("l", warmup + requests + opts.clients),
        burst=short("b", opts.prompts),
        streams=short("s", opts.streams),
        json=short("j", opts.prompts),
        doc=document_messages(tokenizer, opts.doc_tokens, 1, f"{tag}d"),
        stall_doc=document_messages(tokenizer, opts.doc_tokens, 2, f"{tag}e"),
        stream_bias=special_token_bias(tokenizer),
    )


def step(name: str) -> None:
    typer.echo(f"engine suite: {name} ...", err=True)


async def run_engine_suite(opts: BenchOptions, model: str | None, prompts: EnginePrompts) -> dict:
    """Run every scenario against ``opts.base_url``; returns the run's JSON-able result."""
    client = Client(opts.base_url, model, opts.ignore_eos, opts.extra_body, opts.api_key, opts.timeout)
    short = {"max_tokens": opts.short_output_tokens}
    details: dict = {}
    peak: dict = {}
    stop = asyncio.Event()
    watcher = asyncio.create_task(watch_memory(server_root(opts.base_url), peak, stop, opts.api_key))
    try:
        step("warm-up")
        warm = await load.one_after_another(client, prompts.warm, "warmup", **short)
        if not any(s.ok for s in warm):
            raise typer.BadParameter(f"{opts.base_url} did not answer: {warm[-1].error or 'no content'}")
        step(f"c1 ({len(prompts.c1)} short prompts one after another)")
        details["c1"] = batch_summary(await load.one_after_another(client, prompts.c1, "c1", **short))
        warmup, requests = opts.closed_loop_counts(opts.clients)
        step(f"closed loop ({opts.clients} clients, {warmup} warm-up + {requests} measured)")
        samples, start, end = await load.closed_loop(client, prompts.closed, opts.clients, requests, warmup, **short)
        details["closed_loop"] = {"clients": opts.clients, **summarize(samples, start, end, opts.short_output_tokens)}
        step(f"burst ({len(prompts.burst)} short prompts at once)")
        details["burst"] = batch_summary(await load.all_at_once(client, prompts.burst, "burst", **short))
        doc = {"max_tokens": opts.doc_output_tokens}
        step(f"doc ({opts.doc_tokens} tokens alone), then the same again")
        details["doc"] = batch_summary([await client.send(prompts.doc, Sample("doc", time.perf_counter()), **doc)])
        details["doc_again"] = batch_summary(
            [await client.send(prompts.doc, Sample("doc", time.perf_counter()), **doc)]
        )
        step(f"stall ({opts.streams} streams, another {opts.doc_tokens}-token document among them)")
        streams, stall_doc = await load.document_among_streams(
            client,
            prompts.streams,
            {"max_tokens": STREAM_TOKENS, "logit_bias": prompts.stream_bias if opts.ignore_eos else None},
            prompts.stall_doc,
            opts.doc_output_tokens,
            opts.timeout,
        )
        details["stall"] = {**stall_summary(streams, stall_doc), "doc_prompt_tokens": stall_doc.prompt_tokens}
        if opts.response_format is not None:
            step("json (c1 with response_format)")
            details["json"] = batch_summary(
                await load.one_after_another(
                    client, prompts.json, "json", response_format=opts.response_format, ignore_eos=None, **short
                )
            )
    finally:
        stop.set()
        await watcher
        await client.close()
    return {
        "suite": "engine",
        "figures": engine_figures(details),
        "details": details,
        "peak_worker_mem_bytes": peak.get("bytes"),
        "timeline": timeline(streams, stall_doc),
    }


def timeline(streams: list[Sample], doc: Sample) -> dict:
    """The stall scenario's chunk times, seconds from the document's start (for the plot)."""
    rel = lambda ts: [round(t - doc.start, 4) for t in ts]  # noqa: E731
    return {
        "doc_first_chunk_s": round(doc.chunks[0] - doc.start, 4) if doc.chunks else None,
        "streams": [rel(s.chunks) for s in streams],
    }


def prompt_lengths(tokenizer, prompts: EnginePrompts) -> dict:
    """Templated prompt lengths by our tokenizer (the server's own count is in each summary)."""
    return {
        "short": len(prompt_ids(tokenizer, prompts.c1[0])),
        "doc": len(prompt_ids(tokenizer, prompts.doc)),
        "stall_doc": len(prompt_ids(tokenizer, prompts.stall_doc)),
    }
