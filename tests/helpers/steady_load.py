"""A steady load for rollout tests: N streaming clients in a closed loop, counting every outcome.

Each client sends one streaming chat completion after another until :meth:`SteadyLoad.stop`; a
stream counts as complete when it ends with a ``finish_reason`` and ``data: [DONE]``. Failures are
kept by kind (an HTTP status, an exception, a stream cut short), and every completion's time, so
a test can print the throughput of a window against the steady rate (a benchmark figure, never
asserted).
"""

from __future__ import annotations

import collections
import json
import threading
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class LoadCounts:
    """What the clients saw: completed streams, failures by kind, statuses, completion times."""

    completed: int = 0
    failures: collections.Counter = field(default_factory=collections.Counter)
    statuses: collections.Counter = field(default_factory=collections.Counter)
    done_at: list[float] = field(default_factory=list)

    @property
    def failed(self) -> int:
        """Requests that did not end in a complete stream."""
        return sum(self.failures.values())

    @property
    def server_errors(self) -> int:
        """Responses with a 5xx status."""
        return sum(n for status, n in self.statuses.items() if status >= 500)

    def rate(self, start: float, end: float) -> float:
        """Completed streams per second between two ``time.monotonic()`` readings."""
        return sum(start <= t < end for t in self.done_at) / max(1e-9, end - start)


class SteadyLoad:
    """``clients`` threads streaming ``max_tokens``-token chats from ``base_url`` (``/v1``)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        clients: int = 8,
        max_tokens: int = 8,
        headers: dict | None = None,
        timeout: float = 120.0,
    ):
        self.base_url, self.model, self.clients, self.max_tokens = base_url, model, clients, max_tokens
        self.timeout = timeout  # each client's read timeout (seconds between bytes)
        self.headers = headers or {}
        self.counts = LoadCounts()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> SteadyLoad:
        self._threads = [threading.Thread(target=self._client, args=(n,), daemon=True) for n in range(self.clients)]
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> LoadCounts:
        """Stop after each client's current request; the counts."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)
        return self.counts

    def wait_completed(self, n: int, timeout: float = 120.0) -> None:
        """Until ``n`` more streams have completed (the load is flowing)."""
        want, deadline = self.counts.completed + n, time.monotonic() + timeout
        while self.counts.completed < want:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {n} streams completed in {timeout}s: {self.counts}")
            time.sleep(0.1)

    def _client(self, n: int) -> None:
        with httpx.Client(timeout=self.timeout, headers=self.headers) as http:
            while not self._stop.is_set():
                outcome = self._one(http, f"client {n}: count to ten")
                with self._lock:
                    if outcome == "complete":
                        self.counts.completed += 1
                        self.counts.done_at.append(time.monotonic())
                    else:
                        self.counts.failures[outcome] += 1

    def _one(self, http: httpx.Client, prompt: str) -> str:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": self.max_tokens,
            "stream": True,
        }
        try:
            with http.stream("POST", f"{self.base_url}/chat/completions", json=body) as r:
                with self._lock:
                    self.counts.statuses[r.status_code] += 1
                if r.status_code != 200:
                    r.read()
                    return f"HTTP {r.status_code}: {r.text[:200]}"
                return _read_stream(r.iter_lines())
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"


def _read_stream(lines) -> str:
    """``complete`` when the events end with a finish_reason and ``[DONE]``, else what went wrong."""
    finish, done = None, False
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            done = True
            continue
        event = json.loads(data)
        if "error" in event:
            return f"error event: {event['error'].get('message', '')[:200]}"
        for choice in event.get("choices", []):
            finish = choice.get("finish_reason") or finish
    return "complete" if finish and done else f"incomplete stream (finish {finish}, done {done})"
