"""Prometheus metrics of one router and its workers (``GET /metrics``, text format).

Everything lives in a per-router :class:`~prometheus_client.CollectorRegistry` (never the global
one), so several apps in one test process do not collide. Names follow vLLM's style: a
``llamadeploy_`` prefix, the unit in the name, ``_total`` on counters, ``worker_id`` and ``model`` (its served name) labels.

* Router side, updated as requests run: HTTP requests by endpoint and status, end-to-end latency,
  TTFT and inter-token latency (timed here as token events arrive), prompt and generation tokens,
  requests waiting for their first token and requests streaming tokens.
* Worker side, read from the :class:`~router.workers.WorkerPool` at scrape time (the workers'
  heartbeats and Ready messages): running/waiting sequences, KV-cache usage, device memory,
  restarts, model load time, state; requests held for a replica now (:mod:`router.hold`), and
  the time each was held, by outcome.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from router.activity import Activity
from router.workers import State, WorkerPool
from worker.contract.protocol import EngineLoad, Tokens

log = logging.getLogger(__name__)

PREFIX = "llamadeploy"
GENERATION_ENDPOINTS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
QUIET_PATHS = frozenset(
    {"/health", "/health/live", "/health/ready", "/metrics", "/workers", "/admin/workers", "/activity"}
)  # polled

# Buckets as vLLM's (seconds).
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


# The heartbeat's figures exported per worker: EngineLoad field -> (kind, name, help). Counters
# run since the worker process started; a worker without a heartbeat reports EngineLoad()'s defaults.
LOAD_METRICS = {
    "running": ("gauge", "worker_num_requests_running", "Sequences in the worker's running batch (heartbeat)"),
    "waiting": ("gauge", "worker_num_requests_waiting", "Sequences queued in the worker (heartbeat)"),
    "prefix_hit_tokens": ("counter", "prefix_cache_hit_tokens", "Prompt tokens found in the worker's prefix cache"),
    "prefix_queried_tokens": (
        "counter",
        "prefix_cache_queried_tokens",
        "Prompt tokens looked up in the worker's prefix cache",
    ),
    "preemptions": ("counter", "num_preemptions", "Sequences preempted (KV blocks freed, recomputed later)"),
    "captured_steps": ("counter", "captured_steps", "Engine steps run by the captured decode step"),
    "eager_decode_steps": (
        "counter",
        "eager_decode_steps",
        "Decode-only steps the capture could not serve, run eagerly (capture off, more rows than its buckets)",
    ),
    "compute_threads": (
        "gauge",
        "worker_compute_threads",
        "Threads a CPU worker's steps compute on now: fewer than its cores while others compute there "
        "(0: not governed: a GPU, one core, workers.adapt_threads off)",
    ),
    "thread_changes": ("counter", "compute_thread_changes", "Changes of a CPU worker's compute threads"),
    "kv_blocks_free": ("gauge", "kv_cache_free_blocks", "KV-cache blocks no sequence holds (cached prefixes included)"),
}


def _family(kind: str, name: str, doc: str, labels: tuple[str, ...] = ("worker_id", "model")):
    family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
    return family(f"{PREFIX}_{name}", doc, labels=list(labels))


class WorkerCollector:
    """Per-worker gauges and counters, read from the pool at scrape time."""

    def __init__(self, pool: WorkerPool):
        self.pool = pool

    def collect(self):
        state = _family("gauge", "worker_state", "1 for the worker's current state", ("worker_id", "model", "state"))
        in_flight = _family("gauge", "worker_requests_in_flight", "Requests the router has dispatched to the worker")
        kv_ratio = _family("gauge", "kv_cache_usage_ratio", "Reserved KV-cache tokens / KV budget (0..1)")
        kv_budget = _family("gauge", "kv_cache_budget_tokens", "KV-cache budget of the worker in tokens")
        memory = _family(
            "gauge",
            "worker_memory_used_bytes",
            "Device memory in use: torch allocated on GPU, RSS on CPU",
            ("worker_id", "model", "device"),
        )
        load_time = _family("gauge", "model_load_time_seconds", "Seconds from worker start to ready (load + warm-up)")
        restarts = _family("counter", "worker_restarts", "Times the worker process was replaced")
        held = _family(
            "gauge",
            "num_requests_held",
            "Requests waiting for a ready replica of their model (router.hold)",
            ("model",),
        )
        counts = {w.model: 0 for w in self.pool.workers.values()}
        for model, count in self.pool.hold.by_model().items():
            named = served_name(self.pool, model)
            counts[named] = counts.get(named, 0) + count
        for model, count in sorted(counts.items()):
            held.add_metric([model], count)
        figures = {name: _family(*spec) for name, spec in LOAD_METRICS.items()}
        for w in sorted(self.pool.workers.values(), key=lambda w: w.worker_id):
            wid = [str(w.worker_id), w.model]
            load = w.load or EngineLoad()
            for s in State:
                state.add_metric([*wid, s.value], 1.0 if w.state == s else 0.0)
            for name, family in figures.items():
                family.add_metric(wid, getattr(load, name))
            in_flight.add_metric(wid, w.in_flight)
            kv_ratio.add_metric(wid, load.kv_used_tokens / w.kv_budget_tokens if w.kv_budget_tokens else 0.0)
            kv_budget.add_metric(wid, w.kv_budget_tokens)
            memory.add_metric([*wid, w.device], load.mem_bytes)
            load_time.add_metric(wid, w.load_seconds)
            restarts.add_metric(wid, w.restarts)
        yield from (state, in_flight, kv_ratio, kv_budget, memory, load_time, restarts, held, *figures.values())


def _hold_histogram(pool: WorkerPool, registry: CollectorRegistry) -> Histogram:
    """Seconds each request was held for a replica (:mod:`router.hold`), by model and how its hold
    ended; fed by the pool's hold queue as each request leaves it."""
    hist = Histogram(
        f"{PREFIX}_request_hold_seconds",
        "Requests held for a ready replica of their model: seconds held, by how the hold ended "
        "(dispatched, timeout, unexpected, shutdown, cancelled)",
        ["model", "outcome"],
        buckets=E2E_BUCKETS,
        registry=registry,
    )
    pool.hold.on_leave = lambda model, outcome, s: hist.labels(served_name(pool, model), outcome).observe(s)
    return hist


def served_name(pool: WorkerPool, model: str | None) -> str:
    """The ``model`` label of a held request: its model, or for the one-model queue (``None`` or
    ``""``: a deployment of one model) that model's served name, as its workers' series say."""
    if model:
        return model
    names = {w.model for w in pool.workers.values()}
    return names.pop() if len(names) == 1 else ""


class Metrics:
    """The metric objects of one router; shared by its public and admin apps."""

    def __init__(self, pool: WorkerPool):
        self.pool = pool
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.http_requests = Counter(
            f"{PREFIX}_http_requests",
            "HTTP requests by endpoint, method and status",
            ["endpoint", "method", "status"],
            registry=r,
        )
        self.e2e_latency = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds",
            "Generation requests: arrival to last byte (streamed or not)",
            ["endpoint"],
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.running = Gauge(f"{PREFIX}_num_requests_running", "Generation requests receiving tokens", registry=r)
        self.waiting = Gauge(
            f"{PREFIX}_num_requests_waiting",
            "Generation requests accepted but without their first token yet",
            registry=r,
        )
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Request arrival to first token event",
            ["worker_id", "model"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            f"{PREFIX}_inter_token_latency_seconds",
            "Time between consecutive token events",
            ["worker_id", "model"],
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "Prompt tokens of finished requests", ["worker_id", "model"], registry=r
        )
        self.generation_tokens = Counter(
            f"{PREFIX}_generation_tokens", "Generated tokens of finished requests", ["worker_id", "model"], registry=r
        )
        self.request_success = Counter(
            f"{PREFIX}_request_success",
            "Requests finished by a worker",
            ["worker_id", "model", "finished_reason"],
            registry=r,
        )
        self.migrations = Counter(
            f"{PREFIX}_request_migrations",
            "Requests moved to another worker mid-generation, by why the first was lost",
            ["reason"],
            registry=r,
        )
        self.hold_time = _hold_histogram(pool, r)
        self.activity = Activity()  # recent throughput and TTFT for the status page (router.activity)
        ProcessCollector(registry=r)  # the router process: process_resident_memory_bytes, cpu seconds, fds
        r.register(WorkerCollector(pool))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Times one generation request: TTFT from its arrival, ITL between the worker's token
    events (fed by :func:`router.generation.stream_tokens` as they arrive, before any buffering),
    token counts at the finish, and the waiting/running gauges over the request's life."""

    def __init__(self, metrics: Metrics | None, started: float):
        self.metrics = metrics
        self.started = started
        self.first_at: float | None = None
        self.last: tuple[str, float] | None = None  # (attempt's request id, time of its last event)

    def on_tokens(self, worker_id: int, tok: Tokens) -> None:
        m = self.metrics
        if m is None:
            return
        now = time.monotonic()
        w = m.pool.workers.get(worker_id)
        wid = (str(worker_id), w.model if w is not None else "")  # labels: worker_id, model
        if self.first_at is None:
            self.first_at = now
            m.waiting.dec()
            m.running.inc()
            m.ttft.labels(*wid).observe(now - self.started)
            m.activity.first_token(now - self.started)
        elif self.last is not None and self.last[0] == tok.request_id:  # not across a retry
            m.itl.labels(*wid).observe(now - self.last[1])
        self.last = (tok.request_id, now)
        m.activity.tokens(len(tok.token_ids))
        if tok.finish_reason is not None:
            m.activity.finished()
            m.request_success.labels(*wid, tok.finish_reason).inc()
            if tok.usage is not None:
                m.prompt_tokens.labels(*wid).inc(tok.usage.prompt_tokens)
                m.generation_tokens.labels(*wid).inc(tok.usage.completion_tokens)

    def on_migration(self, reason: str) -> None:
        """The request moved to another worker (``reason``: why the last one was lost)."""
        if self.metrics is not None:
            self.metrics.migrations.labels(reason).inc()

    async def wrap(self, events: AsyncIterator[Tokens]) -> AsyncIterator[Tokens]:
        """Relay ``events``, counting the request as waiting, then running, until it ends."""
        m = self.metrics
        if m is not None:
            m.waiting.inc()
        try:
            async with aclosing(events) as stream:
                async for tok in stream:
                    yield tok
        finally:
            if m is not None:
                (m.waiting if self.first_at is None else m.running).dec()


METRICS = web.AppKey("metrics", Metrics)
STARTED = web.RequestKey("started_at", float)  # time.monotonic() at arrival


def request_timer(request: web.Request) -> RequestTimer:
    """A :class:`RequestTimer` for this request (inert when the app keeps no metrics)."""
    return RequestTimer(request.app.get(METRICS), request.get(STARTED, time.monotonic()))


def endpoint_of(request: web.Request) -> str:
    """The matched route's pattern (bounded label values), or ``unmatched``."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def metrics_middleware(request: web.Request, handler):
    """Outermost: count every request by endpoint and status, time generations, log one access line."""
    request[STARTED] = started = time.monotonic()
    status = 500
    try:
        resp = await handler(request)
        status = resp.status
        return resp
    except web.HTTPException as exc:
        status = exc.status
        raise
    except asyncio.CancelledError:
        status = 499  # the client went away and the handler was cancelled
        raise
    except Exception:
        status = 500
        raise
    finally:
        elapsed = time.monotonic() - started
        endpoint = endpoint_of(request)
        metrics = request.app.get(METRICS)
        if metrics is not None:
            metrics.http_requests.labels(endpoint, request.method, str(status)).inc()
            if endpoint in GENERATION_ENDPOINTS and status < 400:
                metrics.e2e_latency.labels(endpoint).observe(elapsed)
        level = logging.DEBUG if request.path in QUIET_PATHS and status < 400 else logging.INFO
        log.log(level, "%s %s %d %.3fs", request.method, request.path, status, elapsed)


async def metrics_handler(request: web.Request) -> web.Response:
    body = request.app[METRICS].exposition()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
