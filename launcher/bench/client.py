"""The HTTP side of the bench: streamed chat completions recorded as :class:`Sample` timelines,
and what the bench asks a server besides (``GET /models``, our ``GET /workers``)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from launcher.bench.summary import Sample


def auth_headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class Client:
    """Sends streamed, greedy chat completions to ``base_url`` over one connection pool.

    ``body`` holds the fields every request carries (``max_tokens``, ``ignore_eos``, peer-specific
    extras); :meth:`send` adds the messages and any per-request overrides.
    """

    def __init__(
        self, base_url: str, model: str | None, ignore_eos: bool, extra: dict, api_key: str | None, timeout: float
    ):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.body = {"stream": True, "temperature": 0, "stream_options": {"include_usage": True}, **extra}
        if model:
            self.body["model"] = model
        if ignore_eos:
            self.body["ignore_eos"] = True
        self.http = httpx.AsyncClient(
            timeout=timeout,
            headers=auth_headers(api_key),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )

    async def send(self, messages: list[dict], sample: Sample, **overrides) -> Sample:
        """Stream one completion into ``sample`` (chunk times, usage, error); returns ``sample``.

        An override of None removes that field from the body (e.g. ``ignore_eos=None``). A pooled
        connection the server closed just before the request (cpp-httplib, under llama-server,
        closes a keep-alive connection after a few requests) is retried once on a new one, since
        the server never saw the request.
        """
        body = {k: v for k, v in {**self.body, **overrides, "messages": messages}.items() if v is not None}
        try:
            for attempt in (1, 2):
                try:
                    await self._stream(body, sample)
                    break
                except httpx.RemoteProtocolError as exc:
                    if attempt == 2 or sample.chunks or "without sending a response" not in str(exc):
                        raise
        except httpx.HTTPError as exc:
            sample.error = f"{type(exc).__name__}: {exc}"
        except asyncio.CancelledError:
            sample.cut = True  # cancelled by the bench while streaming (the server sees a disconnect)
            raise
        finally:
            sample.end = time.perf_counter()
        return sample

    async def _stream(self, body: dict, sample: Sample) -> None:
        async with self.http.stream("POST", self.url, json=body) as r:
            if r.status_code != 200:
                sample.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return
            async for line in r.aiter_lines():
                on_line(line, sample)

    async def close(self) -> None:
        await self.http.aclose()


def on_line(line: str, sample: Sample) -> None:
    """Record one SSE line: a content delta is a chunk (role-only or empty deltas are not)."""
    if not line.startswith("data:"):
        return
    data = line[5:].strip()
    if data == "[DONE]":
        return
    event = json.loads(data)
    if "error" in event:
        sample.error = str(event["error"])[:200]
        return
    usage = event.get("usage")
    if usage:
        sample.completion_tokens = usage.get("completion_tokens", sample.completion_tokens)
        sample.prompt_tokens = usage.get("prompt_tokens", sample.prompt_tokens)
    for choice in event.get("choices") or []:
        if (choice.get("delta") or {}).get("content"):
            sample.chunks.append(time.perf_counter())


def server_root(base_url: str) -> str:
    return base_url.rstrip("/").removesuffix("/v1")


def served_model(base_url: str, api_key: str | None) -> str | None:
    """The first model of ``GET /models`` that generates (:func:`first_generative`; None when the
    server has no such list)."""
    try:
        r = httpx.get(base_url.rstrip("/") + "/models", timeout=10, headers=auth_headers(api_key))
        return first_generative(r.json()) if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None


def first_generative(models: dict) -> str | None:
    """The id of the first model in a ``GET /models`` answer that is not an embedding model (ours
    says ``task: embed``; a peer without ``task`` serves its first model), None for an empty list."""
    return next((m["id"] for m in models["data"] if m.get("task") != "embed"), None)


async def watch_memory(root: str, peak: dict, stop: asyncio.Event, api_key: str | None) -> None:
    """Poll ``GET /workers`` twice a second and keep in ``peak["bytes"]`` the largest ``mem_bytes``
    of any worker (stays unset on servers without that endpoint)."""
    async with httpx.AsyncClient(timeout=5, headers=auth_headers(api_key)) as http:
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
