"""``llamadeploy bench --perplexity FILE``: perplexity over a text through the completions API.

The text is tokenized with the served model's tokenizer (as the server would), cut into windows
(:mod:`launcher.bench.perplexity`, llama-perplexity's method), and each window is sent as a
token-id prompt with ``echo: true, max_tokens: 0, logprobs: 0``: the answer scores every token of
the window. Windows go out ``parallel`` at a time and are summed in order. Prints llama.cpp's
running figure per window (``[1]12.3456,[2]...``), then ``PPL = … +/- …`` with the token counts,
and writes ``OUTPUT.json``.

The HF tokenizer and llama.cpp's may split the same text differently (SmolLM2's: llama.cpp keeps
``"\\n\\n  "`` one token where the HF pre-tokenizer makes two), and different windows give a
different figure. ``--tokenize-url`` takes the ids from a llama.cpp server's ``POST /tokenize``
on the same model file instead, so both runtimes score exactly the same tokens.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import httpx
import typer

from launcher.bench.client import auth_headers, served_model
from launcher.bench.perplexity import Estimate, TooShort, estimate, scored, windows


def bos_token(tokenizer) -> int | None:
    """The BOS id when the tokenizer adds one to a text (Llama's), else None (SmolLM2's)."""
    with_special = tokenizer("a")["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    return bos if bos is not None and len(with_special) > len(plain) and with_special[0] == bos else None


class WindowFailed(RuntimeError):
    """The server did not score a window (an HTTP error, or an answer without logprobs)."""


async def score_window(http: httpx.AsyncClient, url: str, body: dict, window: list[int]) -> list[float]:
    """One window's echo: its ``token_logprobs`` (first null), one per token."""
    r = await http.post(url, json={**body, "prompt": window})
    if r.status_code != 200:
        raise WindowFailed(f"HTTP {r.status_code}: {r.text[:300]}")
    try:
        return r.json()["choices"][0]["logprobs"]["token_logprobs"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise WindowFailed(f"no logprobs in the answer: {r.text[:300]}") from None


async def score_all(url: str, body: dict, wins: list[list[int]], parallel: int, headers: dict, timeout: float):
    """Yields each window's token logprobs, in window order, with ``parallel`` in flight."""
    gate = asyncio.Semaphore(parallel)
    async with httpx.AsyncClient(timeout=timeout, headers=headers) as http:

        async def one(w: list[int]) -> list[float]:
            async with gate:
                return await score_window(http, url, body, w)

        tasks = [asyncio.create_task(one(w)) for w in wins]
        try:
            for t in tasks:
                yield await t
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def measure(url: str, body: dict, wins: list[list[int]], ctx: int, parallel: int, headers: dict, timeout: float):
    """Every window's scored NLLs; prints the running perplexity after each window, as llama.cpp does."""
    nlls: list[float] = []
    per_window: list[float] = []
    async for lps in score_all(url, body, wins, parallel, headers, timeout):
        got = scored(lps, ctx)
        nlls += got
        per_window.append(math.exp(sum(got) / len(got)))
        typer.echo(f"[{len(per_window)}]{math.exp(sum(nlls) / len(nlls)):.4f},", nl=False)
    typer.echo("")
    return nlls, per_window


def read_text(file: Path) -> str:
    """The text to score; exit 2 when it cannot be read as UTF-8."""
    try:
        return file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        typer.echo(f"--perplexity {file}: {exc}", err=True)
        raise typer.Exit(2) from None


def peer_token_ids(root: str, text: str, timeout: float) -> list[int]:
    """``text`` as llama.cpp tokenizes it: ``POST {root}/tokenize`` of a llama-server (its root URL,
    a trailing ``/v1`` ignored), with ``add_special`` as llama-perplexity tokenizes. Exit 2 when
    the server does not answer with a list of token ids."""
    url = root.rstrip("/").removesuffix("/v1") + "/tokenize"
    try:
        r = httpx.post(url, json={"content": text, "add_special": True}, timeout=timeout)
        ids = r.raise_for_status().json()["tokens"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        typer.echo(f"--tokenize-url {url}: {exc}", err=True)
        raise typer.Exit(2) from None
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        typer.echo(f"--tokenize-url {url}: the answer's tokens are not a list of ids", err=True)
        raise typer.Exit(2)
    return ids


def text_windows(
    text: str, file: Path, ctx: int, chunks: int | None, tokenizer_name: str, ids: list[int] | None = None
) -> tuple[list[int], list]:
    """``text`` (from ``file``) as token ids (``ids`` when given, else the model's tokenizer) and its
    scoring windows; exit 2 when it is too short."""
    from launcher.bench.runner import load_tokenizer

    _, tok = load_tokenizer(tokenizer_name)
    if ids is None:
        ids = tok(text)["input_ids"]
    try:
        return ids, windows(ids, ctx, bos_token(tok), chunks)
    except TooShort as exc:
        typer.echo(f"--perplexity {file}: {exc}", err=True)
        raise typer.Exit(2) from None


def run_perplexity(
    base_url: str,
    file: Path,
    ctx: int,
    chunks: int | None,
    model: str | None,
    tokenizer_name: str | None,
    api_key: str | None,
    timeout: float,
    parallel: int,
    extra: dict,
    output: Path,
    tokenize_url: str | None = None,
) -> Estimate:
    """Measure, print and write the perplexity of ``file``'s text (see the module docstring), its
    token ids from ``tokenize_url``'s llama-server when given. Exits 2 for a text too short or
    unreadable (or a tokenize URL that fails), 1 when the server fails a window."""
    text = read_text(file)
    model = model or served_model(base_url, api_key)
    given = peer_token_ids(tokenize_url, text, timeout) if tokenize_url else None
    ids, wins = text_windows(text, file, ctx, chunks, tokenizer_name or model or "smollm2-135m-instruct", given)
    body = {"echo": True, "max_tokens": 0, "logprobs": 0, "temperature": 0, **extra}
    if model:
        body["model"] = model
    url = base_url.rstrip("/") + "/completions"
    by = f"llama.cpp's tokenizer at {tokenize_url}" if tokenize_url else "the model's tokenizer"
    typer.echo(f"perplexity: {len(ids)} tokens ({by}), {len(wins)} windows of {ctx}, scoring the second half of each")
    try:
        nlls, per_window = asyncio.run(measure(url, body, wins, ctx, parallel, auth_headers(api_key), timeout))
    except (WindowFailed, httpx.HTTPError) as exc:
        typer.echo(f"\nperplexity: the server failed a window: {exc}", err=True)
        raise typer.Exit(1) from None
    est = estimate(nlls)
    typer.echo(
        f"Final estimate: PPL = {est.ppl:.4f} +/- {est.error:.5f} "
        f"({est.count} tokens scored in {len(wins)} windows of {ctx}; {len(ids)} tokens in {file.name})"
    )
    result = {
        "suite": "perplexity",
        "base_url": base_url,
        "model": model,
        "file": str(file),
        "ctx": ctx,
        "tokens": len(ids),
        "tokenized_by": tokenize_url or "model",
        "windows": len(wins),
        "scored_tokens": est.count,
        "ppl": est.ppl,
        "ppl_error": est.error,
        "mean_nll": est.mean_nll,
        "window_ppl": per_window,
    }
    output.with_suffix(".json").parent.mkdir(parents=True, exist_ok=True)
    output.with_suffix(".json").write_text(json.dumps(result, indent=2))
    return est
