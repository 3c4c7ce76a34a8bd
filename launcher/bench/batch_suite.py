"""A document batch through the official ``openai`` SDK beside chat clients (issue 32's batch target).

:func:`batch_input` writes ``lines`` summary requests (the mixed suite's title-and-summary
``json_schema`` question, :mod:`launcher.bench.mixed_docs`, of distinct documents of real text) as a
Batch API input file. :func:`run_batch` uploads it (``files.create``), starts the batch
(``batches.create``), polls it (``batches.retrieve``) until it ends, calling ``on_progress`` with the
share of lines done at each poll (where a driver injects faults), and reads the output and error
files (``files.content``). :func:`check_output` counts what came back: every ``custom_id`` must be
answered exactly once. Connection errors while polling (a router failing over) are waited out.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import openai

from launcher.bench.mixed_docs import descriptions, parses, question_body

TERMINAL = {"completed", "failed", "expired", "cancelled"}


def batch_input(model: str | None, lines: int, chars: int, answer_tokens: int) -> bytes:
    """The JSONL input file: ``lines`` chat-completion requests ``doc-000``, ``doc-001``, … each
    asking a title and summary of a distinct ``chars``-character document: the installed packages'
    descriptions (:func:`~launcher.bench.mixed_docs.descriptions`), in turn, each one's ``k``-th
    window of ``chars`` characters for its ``k``-th use (its first when it is shorter), headed by the
    line's number so that no two prompts share a prefix past the question."""
    found = descriptions(chars)
    out = []
    for i in range(lines):
        _, full = found[i % len(found)]
        k = i // len(found)
        text = full[k * chars : (k + 1) * chars] if len(full) >= (k + 1) * chars else full[:chars]
        body = question_body(model, f"[document {i}]\n{text}", 0, answer_tokens)
        out.append({"custom_id": f"doc-{i:03d}", "method": "POST", "url": "/v1/chat/completions", "body": body})
    return "".join(json.dumps(line) + "\n" for line in out).encode()


@dataclass
class BatchRun:
    """What :func:`run_batch` saw: the batch's last state, its timings (seconds since it was
    created), the output and error files' lines and the polls that found no server."""

    batch: dict = field(default_factory=dict)
    started: float = 0.0
    ended: float = 0.0
    output: list[dict] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)
    unreachable_polls: int = 0


async def run_batch(
    client: openai.AsyncOpenAI, data: bytes, on_progress: Callable[[float], None] | None = None, poll_s: float = 2.0
) -> BatchRun:
    """Upload ``data``, run it as a batch to its end, read its files (module docstring)."""
    run = BatchRun(started=time.perf_counter())
    upload = await client.files.create(file=("documents.jsonl", data), purpose="batch")
    batch = await client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    while batch.status not in TERMINAL:
        await asyncio.sleep(poll_s)
        try:
            batch = await client.batches.retrieve(batch.id)
        except (openai.APIConnectionError, openai.InternalServerError):
            run.unreachable_polls += 1  # the router failing over: ask again
            continue
        counts = batch.request_counts
        if on_progress and counts and counts.total:
            on_progress((counts.completed + counts.failed) / counts.total)
    run.ended = time.perf_counter()
    run.batch = batch.model_dump()
    run.output = await _lines(client, batch.output_file_id)
    run.errors = await _lines(client, batch.error_file_id)
    return run


async def _lines(client: openai.AsyncOpenAI, file_id: str | None) -> list[dict]:
    if not file_id:
        return []
    content = await client.files.content(file_id)
    return [json.loads(line) for line in content.text.splitlines() if line.strip()]


def check_output(run: BatchRun, lines: int) -> dict:
    """The batch's figures: lines back (output + error files), ``custom_id``\\ s missing or answered
    more than once, answers with status 200 and the share of those that parse."""
    seen = collections.Counter(line.get("custom_id") for line in [*run.output, *run.errors])
    expected = {f"doc-{i:03d}" for i in range(lines)}
    ok = [line for line in run.output if (line.get("response") or {}).get("status_code") == 200]
    parsed = sum(parses(_content(line), 0) for line in ok)
    return {
        "status": run.batch.get("status"),
        "request_counts": run.batch.get("request_counts"),
        "seconds": round(run.ended - run.started, 1),
        "lines_back": sum(seen.values()),
        "missing": sorted(expected - set(seen)),
        "more_than_once": sorted(k for k, n in seen.items() if n > 1),
        "unexpected": sorted(str(k) for k in set(seen) - expected),
        "answered_200": len(ok),
        "parsed_share": parsed / len(ok) if ok else None,
        "unreachable_polls": run.unreachable_polls,
        "every_custom_id_once": sum(seen.values()) == lines and set(seen) == expected,
    }


def _content(line: dict) -> str | None:
    try:
        return line["response"]["body"]["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        return None
