"""The hold suite's traffic: streaming clients and a request loop, each request recorded.

:class:`Traffic` runs ``streams`` clients that each stream chat completions one after another, one
client that sends non-streaming ones one after another, and open-loop arrivals (a non-streaming
request every ``1 / arrivals_per_s`` seconds, whether or not the earlier ones were answered: the
requests that arrive while no replica is ready, which the router holds), all against one
OpenAI-compatible ``/v1`` URL, until stopped. Each request becomes a :class:`Call` with its times, so a driver can
count what was answered 5xx and which streams were cut among the requests in flight during an event.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

import httpx

from launcher.bench.client import auth_headers


@dataclass
class Call:
    """One request: whether it streamed, its start, first byte and end
    (monotonic seconds), its HTTP status (None: no answer) and ``cut`` (a 200 stream that ended
    without ``data: [DONE]`` or carried an error event) with what went wrong (``error``)."""

    stream: bool
    start: float
    first: float | None = None
    end: float = 0.0
    status: int | None = None
    cut: bool = False
    error: str = ""

    @property
    def server_error(self) -> bool:
        """Answered 5xx."""
        return self.status is not None and self.status >= 500

    @property
    def failed(self) -> bool:
        """Anything but a complete 200: 5xx, another status, no answer, or a cut stream."""
        return self.status != 200 or self.cut


class Traffic:
    """``streams`` streaming clients plus one request loop plus open-loop arrivals against
    ``base_url`` (``model``, bearer ``api_key``); the only writer of :attr:`calls`. ``max_tokens``:
    each streamed answer's length (the loop and the arrivals ask for half); ``timeout``: seconds per
    request, long enough for a hold; ``arrivals_per_s``: the open-loop rate (0: none)."""

    def __init__(self, base_url: str, model: str | None, api_key: str | None, streams: int = 4, **kw):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.headers = model, auth_headers(api_key)
        self.max_tokens, self.timeout = kw.get("max_tokens", 8), kw.get("timeout", 600.0)
        self.arrivals_per_s = kw.get("arrivals_per_s", 1.0)
        self.calls: list[Call] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(n < streams,), daemon=True) for n in range(streams + 1)
        ]
        if self.arrivals_per_s > 0:
            self._threads.append(threading.Thread(target=self._arrive, daemon=True))
        self._arrived: list[threading.Thread] = []
        self._open: dict[int, float] = {}  # arrivals in flight: number -> start

    def __enter__(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads + self._arrived:
            t.join(timeout=self.timeout)

    def arrivals_in_flight(self, before: float) -> int:
        """Open-loop arrivals sent before ``before`` and not yet ended."""
        return sum(1 for start in list(self._open.values()) if start < before)

    def completed_since(self, t: float) -> int:
        """Requests answered 200 and complete that ended after ``t``."""
        return sum(1 for c in list(self.calls) if c.end > t and not c.failed)

    def _run(self, stream: bool) -> None:
        with httpx.Client(timeout=self.timeout, headers=self.headers) as http:
            n = 0
            while not self._stop.is_set():
                n += 1
                if self._call(http, stream, n).failed:
                    time.sleep(0.5)  # as a client that backs off after an error

    def _arrive(self) -> None:
        """Start one request every ``1 / arrivals_per_s`` seconds, each in its own thread (and its own
        connection: an ``httpx.Client`` is not shared across threads)."""
        n = 0
        while not self._stop.wait(1.0 / self.arrivals_per_s):
            n += 1
            self._open[n] = time.monotonic()
            t = threading.Thread(target=self._arrival, args=(n,), daemon=True)
            self._arrived.append(t)
            t.start()

    def _arrival(self, n: int) -> None:
        with httpx.Client(timeout=self.timeout, headers=self.headers) as http:
            self._call(http, False, 1000 + n)
        self._open.pop(n, None)

    def _call(self, http: httpx.Client, stream: bool, n: int) -> Call:
        """One request, recorded in :attr:`calls` once it ended."""
        call = Call(stream, time.monotonic())
        body = {
            "messages": [{"role": "user", "content": f"Count from {n} to {n + 20}."}],
            "max_tokens": self.max_tokens if stream else max(1, self.max_tokens // 2),
            "stream": stream,
            **({"model": self.model} if self.model else {}),
        }
        try:
            (self._stream if stream else self._once)(http, body, call)
        except httpx.HTTPError as exc:
            call.error, call.cut = f"{type(exc).__name__}: {exc}", call.status == 200
        call.end = time.monotonic()
        self.calls.append(call)
        return call

    def _once(self, http: httpx.Client, body: dict, call: Call) -> None:
        r = http.post(self.url, json=body)
        call.first, call.status = time.monotonic(), r.status_code
        if r.status_code != 200:
            call.error = r.text[:200]

    def _stream(self, http: httpx.Client, body: dict, call: Call) -> None:
        with http.stream("POST", self.url, json=body) as r:
            call.status = r.status_code
            if r.status_code != 200:
                call.first, call.error = time.monotonic(), r.read().decode(errors="replace")[:200]
                return
            done = False
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                call.first = call.first or time.monotonic()
                if line == "data: [DONE]":
                    done = True
                elif '"error"' in line and _is_error(line[6:]):
                    call.error = line[6:200]
            call.cut = not done or bool(call.error)
            if not done and not call.error:
                call.error = "the stream ended without data: [DONE]"


def _is_error(data: str) -> bool:
    """An SSE event's data is an error object (OpenAI's ``{"error": {...}}``), not a chunk."""
    try:
        return "error" in json.loads(data)
    except ValueError:
        return True  # not JSON: not a chunk either
