"""Load patterns: a closed loop, requests one after another, all at once, and long streams with a
document arriving among them. Each returns the raw :class:`Sample` timelines; the figures are
computed by :mod:`launcher.bench.summary`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from launcher.bench.client import Client
from launcher.bench.summary import Sample


async def closed_loop(
    client: Client, prompts: list[list[dict]], concurrency: int, requests: int, warmup: int, **overrides
) -> tuple[list[Sample], float, float]:
    """``concurrency`` clients send back to back: ``warmup`` requests, then ``requests`` measured
    ones; clients keep sending fillers until the last measured one ends, and those are cancelled
    then, so the load stays at ``concurrency`` for the whole measured window.

    Returns every sample and the measured window (start of the first measured request, end of the
    last one).
    """
    samples: list[Sample] = []
    issued = 0
    window: dict[str, float] = {}
    measured_done = asyncio.Event()
    pending = requests

    async def one_client() -> None:
        nonlocal issued, pending
        while not measured_done.is_set():
            index = issued
            issued += 1
            kind = "warmup" if index < warmup else "measured" if index < warmup + requests else "filler"
            if kind == "measured":
                window.setdefault("start", time.perf_counter())
            sample = Sample(kind, time.perf_counter())
            samples.append(sample)
            await client.send(prompts[index % len(prompts)], sample, **overrides)
            if kind == "measured":
                pending -= 1
                if pending == 0:
                    window["end"] = time.perf_counter()
                    measured_done.set()

    tasks = [asyncio.create_task(one_client()) for _ in range(concurrency)]
    await measured_done.wait()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return samples, window["start"], window["end"]


async def one_after_another(client: Client, prompts: list[list[dict]], kind: str, **overrides) -> list[Sample]:
    """Each prompt in turn, the next sent when the previous one has ended."""
    return [await client.send(p, Sample(kind, time.perf_counter()), **overrides) for p in prompts]


async def all_at_once(client: Client, prompts: list[list[dict]], kind: str, **overrides) -> list[Sample]:
    """Every prompt sent at the same moment."""
    now = time.perf_counter()
    return list(await asyncio.gather(*(client.send(p, Sample(kind, now), **overrides) for p in prompts)))


async def wait_until(predicate: Callable[[], bool], timeout: float, poll: float = 0.005) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` seconds pass; returns whether it held."""
    deadline = time.perf_counter() + timeout
    while not predicate():
        if time.perf_counter() > deadline:
            return False
        await asyncio.sleep(poll)
    return True


async def document_among_streams(
    client: Client,
    stream_prompts: list[list[dict]],
    stream_body: dict,
    doc: list[dict],
    doc_tokens: int,
    timeout: float,
    settle_chunks: int = 8,
) -> tuple[list[Sample], Sample]:
    """Start one long stream per prompt (``stream_body``: the fields each stream sends, ``max_tokens``
    at least); once each has streamed ``settle_chunks`` chunks, send the document; once the document
    has answered and every live stream has streamed again after the document's first chunk, cancel
    the streams. Returns (streams, document)."""
    streams = [Sample("stream", time.perf_counter()) for _ in stream_prompts]
    tasks = [
        asyncio.create_task(client.send(p, s, **stream_body)) for p, s in zip(stream_prompts, streams, strict=True)
    ]
    alive = lambda s: s.end is None  # noqa: E731
    try:
        await wait_until(lambda: all(len(s.chunks) >= settle_chunks or not alive(s) for s in streams), timeout)
        doc_sample = await client.send(doc, Sample("doc", time.perf_counter()), max_tokens=doc_tokens)
        if doc_sample.chunks:
            first = doc_sample.chunks[0]
            await wait_until(lambda: all(not alive(s) or s.chunks[-1] > first for s in streams), timeout)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return streams, doc_sample
