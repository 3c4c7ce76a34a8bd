"""Metrics exposition, constant-time bearer auth, request-id logging, wire-frame hygiene."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import time

import msgspec
import pytest
from aiohttp.test_utils import make_mocked_request
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from launcher.supervise.progress import describe
from router.admin_protocol import WorkerInfo, WorkerState
from router.auth import bearer_token, token_matches
from router.metrics import Metrics, RequestTimer
from router.workers import State, Worker, WorkerPool
from worker.contract.logs import REQUEST_ID, JsonFormatter, RequestIdFilter, TextFormatter
from worker.contract.protocol import (
    Cancel,
    EngineLoad,
    Generate,
    Hello,
    ProtocolError,
    SamplingParams,
    Tokens,
    Usage,
    decode_for_router,
    decode_for_worker,
    encode,
)


@pytest.fixture
def pool():
    p = WorkerPool("ipc:///nonexistent", "least_loaded", 10.0)  # never started: no socket is bound
    yield p
    p.ctx.term()


def samples(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    text = metrics.exposition().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_worker_gauges_come_from_the_pool_at_scrape_time(pool):
    w = pool.workers[0] = Worker(
        0, state=State.READY, model="m", device="cpu[0,1]", kv_budget_tokens=1000, load_seconds=4.5, restarts=2
    )
    for k in range(3):
        pool.register(w, f"req-{k}")
    w.load = EngineLoad(running=2, waiting=1, kv_used_tokens=250, mem_bytes=123456)
    pool.workers[1] = Worker(1, state=State.STARTING, model="m")
    m = Metrics(pool)
    s = samples(m)
    wid0 = (("model", "m"), ("worker_id", "0"))  # every worker figure names the worker's model
    assert s[("llamadeploy_worker_num_requests_running", wid0)] == 2
    assert s[("llamadeploy_worker_num_requests_waiting", wid0)] == 1
    assert s[("llamadeploy_worker_requests_in_flight", wid0)] == 3
    assert s[("llamadeploy_kv_cache_usage_ratio", wid0)] == 0.25
    assert (
        s[("llamadeploy_worker_memory_used_bytes", (("device", "cpu[0,1]"), ("model", "m"), ("worker_id", "0")))]
        == 123456
    )
    assert s[("llamadeploy_model_load_time_seconds", wid0)] == 4.5
    assert s[("llamadeploy_worker_restarts_total", wid0)] == 2
    assert s[("llamadeploy_worker_state", (("model", "m"), ("state", "ready"), ("worker_id", "0")))] == 1
    assert s[("llamadeploy_worker_state", (("model", "m"), ("state", "starting"), ("worker_id", "1")))] == 1
    assert s[("llamadeploy_kv_cache_usage_ratio", (("model", "m"), ("worker_id", "1")))] == 0  # no heartbeat yet
    w.load = EngineLoad(running=0, waiting=0, kv_used_tokens=0, mem_bytes=1)
    assert samples(m)[("llamadeploy_worker_num_requests_running", wid0)] == 0


def test_registries_are_per_router(pool):
    a, b = Metrics(pool), Metrics(pool)  # would raise "Duplicated timeseries" on a shared registry
    a.http_requests.labels("/x", "GET", "200").inc()
    assert ("llamadeploy_http_requests_total", (("endpoint", "/x"), ("method", "GET"), ("status", "200"))) in samples(a)
    assert not any(name == "llamadeploy_http_requests_total" for name, _ in samples(b))


def test_request_timer_counts_ttft_itl_tokens_and_gauges(pool):
    pool.workers[1] = Worker(1, model="chat")
    m = Metrics(pool)
    timer = RequestTimer(m, time.monotonic())
    gauges: list[tuple[float, float]] = []

    def now() -> tuple[float, float]:
        return m.waiting._value.get(), m.running._value.get()

    async def events():
        gauges.append(now())
        for i, finish in enumerate([None, None, "length"]):
            tok = Tokens(
                request_id="req-a",
                text_delta="x",
                token_ids=[i],
                finish_reason=finish,
                usage=Usage(prompt_tokens=7, completion_tokens=3, total_tokens=10) if finish else None,
            )
            timer.on_tokens(1, tok)  # as router.generation.stream_tokens does on arrival
            gauges.append(now())
            yield tok

    async def main():
        async for _ in timer.wrap(events()):
            pass

    asyncio.run(main())
    assert gauges[0] == (1, 0) and gauges[1] == (0, 1) and now() == (0, 0)
    s = samples(m)
    wid = (("model", "chat"), ("worker_id", "1"))
    assert s[("llamadeploy_time_to_first_token_seconds_count", wid)] == 1
    assert s[("llamadeploy_inter_token_latency_seconds_count", wid)] == 2
    assert s[("llamadeploy_prompt_tokens_total", wid)] == 7
    assert s[("llamadeploy_generation_tokens_total", wid)] == 3
    assert (
        s[("llamadeploy_request_success_total", (("finished_reason", "length"), ("model", "chat"), ("worker_id", "1")))]
        == 1
    )


def test_request_timer_releases_a_request_that_never_got_a_token(pool):
    m = Metrics(pool)

    async def failing():
        raise RuntimeError("no worker")
        yield  # pragma: no cover

    async def main():
        with pytest.raises(RuntimeError):
            async for _ in RequestTimer(m, 0.0).wrap(failing()):
                pass

    asyncio.run(main())
    assert (m.waiting._value.get(), m.running._value.get()) == (0, 0)


def test_token_matches_is_exact():
    keys = ["sk-one", "sk-two"]
    assert token_matches("sk-two", keys) and token_matches("sk-one", keys)
    for wrong in ("", "sk-on", "sk-one ", "SK-ONE", "sk-three", "x" * 10_000, "\udcff"):
        assert not token_matches(wrong, keys)
    assert not token_matches("", [""]) and not token_matches("a", [])


@pytest.mark.parametrize(
    "header,token",
    [
        ("Bearer abc", "abc"),
        ("bearer abc ", "abc"),
        ("BEARER  abc", "abc"),
        ("Basic abc", ""),
        ("abc", ""),
        ("", ""),
    ],
)
def test_bearer_token_parsing(header, token):
    req = make_mocked_request("GET", "/v1/models", headers={"Authorization": header} if header else {})
    assert bearer_token(req) == token


def _record(msg: str, exc: bool = False, **extra) -> logging.LogRecord:
    try:
        if exc:
            raise ValueError("boom\nsecond line")
    except ValueError:
        import sys

        info = sys.exc_info()
    else:
        info = None
    rec = logging.LogRecord("router.test", logging.WARNING, __file__, 1, msg, (), info)
    rec.__dict__.update(extra)
    return rec


def test_json_lines_carry_the_request_id_from_the_context():
    fmt, filt = JsonFormatter("router"), RequestIdFilter()
    token = REQUEST_ID.set("rid-42")
    try:
        rec = _record("hello\nworld", exc=True)
        filt.filter(rec)
        line = fmt.format(rec)
    finally:
        REQUEST_ID.reset(token)
    assert "\n" not in line
    entry = json.loads(line)
    assert entry["request_id"] == "rid-42" and entry["role"] == "router" and entry["msg"] == "hello\nworld"
    assert "boom" in entry["exc"] and entry["level"] == "WARNING" and entry["ts"].endswith("Z")
    rec = _record("x", request_id="explicit")
    filt.filter(rec)
    assert json.loads(fmt.format(rec))["request_id"] == "explicit"
    rec = _record("no request")
    filt.filter(rec)
    assert "request_id" not in json.loads(fmt.format(rec))


def test_text_lines_name_the_request_id():
    rec = _record("served", request_id="abc")
    assert TextFormatter("worker-0").format(rec).endswith("router.test: served request_id=abc")


def test_setup_logging_json_is_one_object_per_line(monkeypatch):
    from worker.contract import logs

    stream = io.StringIO()
    monkeypatch.setattr(logs.sys, "stderr", stream)
    for var in ("HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_NO_ADVISORY_WARNINGS", "TRANSFORMERS_VERBOSITY"):
        monkeypatch.delenv(var, raising=False)  # setup_logging sets them; undone after the test
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        logs.setup_logging("router", "json", "info")
        logging.getLogger("x").info("one")
        import warnings

        warnings.warn("a python warning")
    finally:
        root.handlers[:], _ = saved[0], root.setLevel(saved[1])
        logging.captureWarnings(False)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and all(json.loads(line)["role"] == "router" for line in lines)


def test_generate_without_http_request_id_still_decodes():
    old = msgspec.msgpack.encode(
        {"type": "Generate", "request_id": "r", "prompt_token_ids": [1], "params": {"max_tokens": 2}}
    )
    msg = decode_for_worker(old)
    assert isinstance(msg, Generate) and msg.http_request_id == ""
    new = Generate(request_id="r", prompt_token_ids=[1], params=SamplingParams(max_tokens=2), http_request_id="abc")
    assert decode_for_worker(encode(new)) == new


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\x00",
        b"\xff" * 64,
        b"garbage bytes",
        encode(Cancel(request_id="x"))[:-1],
        msgspec.msgpack.encode({"type": "Generate", "request_id": "r"}),
        msgspec.msgpack.encode({"type": "Exec", "code": "import os"}),
        msgspec.msgpack.encode({"type": "Cancel", "request_id": "r", "extra": 1}),
        msgspec.msgpack.encode([[[[[]]]]] * 10),
        b"\x91" * 100_000,
    ],
)
def test_invalid_frames_raise_only_protocol_errors(frame):
    for decode in (decode_for_worker, decode_for_router):
        with pytest.raises(ProtocolError):
            decode(frame)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=256))
def test_random_bytes_never_decode_to_anything_but_protocol_error(frame):
    for decode in (decode_for_worker, decode_for_router):
        try:
            decode(frame)
        except ProtocolError:
            pass


def test_router_direction_does_not_accept_worker_commands():
    with pytest.raises(ProtocolError):
        decode_for_router(encode(Cancel(request_id="x")))
    with pytest.raises(ProtocolError):
        decode_for_worker(
            encode(Hello(protocol=1, worker_id=0, pid=1, device="cpu", model="m", max_num_seqs=1, max_waiting=0))
        )


def test_progress_description():
    rows = [WorkerInfo(id=1, state=WorkerState.STARTING), WorkerInfo(id=0, state=WorkerState.READY)]
    assert describe(rows) == (1, "0 ready, 1 starting")
