"""The service shrugs off anything a client (or a stray ZeroMQ peer) sends.

* Hand-made bad inputs on the shared deployment: each gets its 4xx in OpenAI's shape, naming the
  limit it broke, quickly, and the service keeps serving.
* On a deployment of its own (one replica, tight limits so that valid requests finish fast):
  garbage frames on the router's ZeroMQ endpoint, then a schemathesis run of >= 500 requests
  generated from ``/openapi.json`` (valid and schema-violating): no 5xx, no hung request, no worker
  restart.
"""

from __future__ import annotations

import collections
import json
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
import requests
import schemathesis
import zmq
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from tests.helpers.deployment import Deployment, wait_for

CHAT = "/chat/completions"
HI = [{"role": "user", "content": "hi"}]


def chunks(total: int, size: int = 1 << 20):
    """A body without Content-Length (chunked): the server cannot refuse it up front."""
    sent = 0
    while sent < total:
        yield b"x" * min(size, total - sent)
        sent += size


BAD_INPUTS = [
    # name, path, httpx kwargs, status, words the error message must contain
    ("invalid utf-8", CHAT, {"content": b'{"messages": [{"role": "user", "content": "\xff\xfe\xfa"}]}'}, 400, "UTF-8"),
    ("10 MB body", CHAT, {"content": b"x" * 10_000_000}, 413, "limits.max_body_bytes"),
    ("10 MB chunked body", CHAT, {"content": chunks(10_000_000)}, 413, "limits.max_body_bytes"),
    ("deeply nested arrays", CHAT, {"content": b"[" * 100_000}, 400, "JSON"),
    ("deeply nested objects", CHAT, {"content": b'{"a":' * 100_000 + b"1" + b"}" * 100_000}, 400, "JSON"),
    ("unknown role", CHAT, {"json": {"messages": [{"role": "robot", "content": "hi"}]}}, 400, "messages.0.role"),
    ("max_tokens as a string", CHAT, {"json": {"messages": HI, "max_tokens": "10"}}, 400, "max_tokens"),
    ("max_tokens over the ceiling", CHAT, {"json": {"messages": HI, "max_tokens": 5000}}, 400, "limits.max_tokens"),
    ("1,000 stop strings", CHAT, {"json": {"messages": HI, "stop": ["s"] * 1000}}, 400, "limits.max_stop_strings"),
    ("a long stop string", CHAT, {"json": {"messages": HI, "stop": ["s" * 300]}}, 400, "limits.max_stop_length"),
    (
        "100k-character prompt",
        CHAT,
        {"json": {"messages": [{"role": "user", "content": "x" * 100_000}]}},
        400,
        "limits.max_prompt_tokens",
    ),
    (
        "100k-character completion prompt",
        "/completions",
        {"json": {"prompt": "word " * 20_000}},
        400,
        "limits.max_prompt_tokens",
    ),
    (
        "1M-character prompt",
        CHAT,
        {"json": {"messages": [{"role": "user", "content": "ab " * 600_000}]}},
        400,
        "limits.max_prompt_tokens",
    ),
    ("too many prompt token ids", "/completions", {"json": {"prompt": [1] * 5000}}, 400, "limits.max_prompt_tokens"),
    ("lone surrogate", CHAT, {"content": b'{"messages": [{"role": "user", "content": "a\\ud800"}]}'}, 400, "surrogate"),
    (
        "NaN temperature",
        CHAT,
        {"content": b'{"messages": [{"role": "user", "content": "a"}], "temperature": NaN}'},
        400,
        "NaN",
    ),
    ("5,000-digit integer", CHAT, {"content": b'{"messages": [], "max_tokens": ' + b"9" * 5000 + b"}"}, 400, "JSON"),
    ("seed beyond int64", CHAT, {"json": {"messages": HI, "seed": 2**64}}, 400, "seed"),
    ("top-level array", CHAT, {"json": [1, 2]}, 400, "JSON object"),
    ("empty body", CHAT, {"content": b""}, 400, "JSON"),
    ("token id out of vocabulary", "/completions", {"json": {"prompt": [10**12]}}, 400, "prompt"),
]


@pytest.fixture(scope="module")
def shared_baseline(deployment):
    """The shared deployment's worker pids and restart counts before any bad input."""
    return {w["id"]: (w["pid"], w["restarts"]) for w in deployment.workers()}


# OpenAI refuses a tool message that does not say which call it answers.
TOOL_WITHOUT_CALL_ID = pytest.param(
    "tool message without tool_call_id",
    CHAT,
    {"json": {"messages": [{"role": "tool", "content": "hi"}], "max_tokens": 2}},
    400,
    "tool_call_id",
    id="tool message without tool_call_id",
)


@pytest.mark.parametrize(
    "name,path,kwargs,status,words", [*(pytest.param(*b, id=b[0]) for b in BAD_INPUTS), TOOL_WITHOUT_CALL_ID]
)
def test_bad_input_gets_its_4xx(deployment, shared_baseline, name, path, kwargs, status, words):
    started = time.monotonic()
    r = httpx.post(f"{deployment.base_url}{path}", timeout=60, headers={"Content-Type": "application/json"}, **kwargs)
    elapsed = time.monotonic() - started
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert words in err["message"], err
    assert r.headers["X-Request-ID"]
    assert elapsed < 10, f"{name} took {elapsed:.1f}s"
    assert httpx.get(f"{deployment.url}/health", timeout=10).status_code == 200
    assert {w["id"]: (w["pid"], w["restarts"]) for w in deployment.workers()} == shared_baseline


@pytest.mark.parametrize(
    "method,path,status",
    [
        ("GET", "/v1/chat/completions", 405),
        ("DELETE", "/v1/models", 405),
        ("GET", "/v1/nope", 404),
        ("POST", "/" + "a" * 2000, 404),
    ],
)
def test_wrong_route_or_method_is_an_openai_error(deployment, method, path, status):
    r = httpx.request(method, f"{deployment.url}{path}", timeout=10)
    assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_denormal_temperature_is_greedy_not_a_crash(deployment, shared_baseline):
    """Temperature 5e-324 would make logits / T infinite: it must sample greedily (as any below 1e-5)."""
    first = deployment.chat("What is the capital of France?", max_tokens=8)
    assert first.status_code == 200, first.text
    greedy = first.json()["choices"][0]["message"]["content"]
    r = deployment.chat("What is the capital of France?", max_tokens=8, temperature=5e-324, seed=1)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == greedy
    assert {w["id"]: (w["pid"], w["restarts"]) for w in deployment.workers()} == shared_baseline


def test_still_serving_after_bad_inputs(deployment, shared_baseline):
    r = deployment.chat("What is the capital of France?", max_tokens=10)
    assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"]
    assert {w["id"]: (w["pid"], w["restarts"]) for w in deployment.workers()} == shared_baseline


# ---- a deployment of its own: ZeroMQ garbage, then the schemathesis run -----------------------

FUZZ_REQUESTS = 520
FUZZ_THREADS = 4
REQUEST_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    d = Deployment(
        tmp_path_factory.mktemp("fuzzed"),
        {
            "model": {"max_model_len": 256},
            "workers": {"replicas": 1, "max_num_seqs": 8},
            "limits": {"max_tokens": 2, "max_prompt_tokens": 64, "max_body_bytes": 65536},
            "router": {"request_timeout_s": REQUEST_TIMEOUT_S},
        },
    )
    d.start()
    yield d
    d.stop()


def processes(d: Deployment) -> dict[str, int]:
    """Role -> pid of the deployment's router and workers."""
    out = {}
    for pid in d.child_pids():
        cmd = psutil.Process(pid).cmdline()
        if "router.main" in cmd and "--standby" not in cmd:  # the serving router, not its loaded standby
            out["router"] = pid
        elif "worker.main" in cmd:
            out[f"worker-{cmd[cmd.index('--worker-id') + 1]}"] = pid
    return out


def zmq_address(d: Deployment) -> str:
    cmd = psutil.Process(processes(d)["router"]).cmdline()
    return cmd[cmd.index("--address") + 1]


FORGED_REFUSED = "dropped Heartbeat claiming worker 0 from identity b'worker-99'"
UNKNOWN_PEER = "dropped a frame from unknown peer"


def test_garbage_on_the_zeromq_endpoint_is_dropped(fuzzed):
    import msgspec

    from worker.contract.protocol import Heartbeat, Tokens, encode

    before = processes(fuzzed)
    address = zmq_address(fuzzed)
    ctx = zmq.Context()
    try:
        socks = []
        for identity in (None, b"worker-99", b"worker-0x", b"\x00\xff", b"worker-\xd9\xa3"):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            if identity:
                s.setsockopt(zmq.IDENTITY, identity)
            s.connect(address)
            socks.append(s)
        frames = [
            b"",
            b"\x00",
            os.urandom(4096),
            b"\x91" * 50_000,
            b"garbage",
            msgspec.msgpack.encode({"type": "Generate", "request_id": "x"}),
            msgspec.msgpack.encode({"type": "Exec", "code": "import os; os._exit(1)"}),
            encode(Tokens(request_id="req-nobody", text_delta="injected", token_ids=[1])),
            encode(Heartbeat(worker_id=0, running=99, waiting=99, kv_used_tokens=0, mem_bytes=0)),
        ]
        for s in socks:
            for f in frames:
                s.send(f)
            s.send_multipart([b"two", b"frames", b"three"])
        socks[0].send(b"\x00" * (20 * 2**20))  # over the router's MAXMSGSIZE: that peer is disconnected
        # Not even ZMTP: raw bytes on the ipc (or tcp) socket.
        if address.startswith("ipc://"):
            raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            raw.connect(address.removeprefix("ipc://"))
        else:
            host, port = address.removeprefix("tcp://").rsplit(":", 1)
            raw = socket.create_connection((host, int(port)))
        with raw:
            raw.sendall(os.urandom(65536))
        # The forged heartbeat (worker-99 claiming worker 0's id) and the frames of peers with no
        # worker identity are refused by the router, each with a log line naming why.
        wait_for(
            lambda: FORGED_REFUSED in fuzzed.log() and UNKNOWN_PEER in fuzzed.log(),
            30,
            what="the router logs its refusal of the forged heartbeat and of unknown peers",
        )
    finally:
        ctx.destroy(linger=0)
    assert fuzzed.chat("What is the capital of France?", max_tokens=2).status_code == 200
    workers = fuzzed.workers()
    assert [w["id"] for w in workers] == [0] and workers[0]["restarts"] == 0
    assert processes(fuzzed) == before


def generated_cases(schema, count: int) -> list:
    """``count`` requests from the OpenAPI document: valid (positive) and schema-violating
    (negative) bodies for both generation endpoints, plus the GET endpoints."""
    posts = [
        schema[path]["POST"].as_strategy(generation_mode=mode)
        for path in ("/v1/chat/completions", "/v1/completions")
        for mode in GenerationMode
    ]
    gets = [
        schema[path]["GET"].as_strategy(generation_mode=mode)
        for path in ("/v1/models", "/health", "/workers", "/metrics", "/openapi.json")
        for mode in GenerationMode
    ]
    cases: list = []

    @given(case=st.one_of(*posts, st.one_of(gets)))
    @settings(
        max_examples=count,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def collect(case):
        cases.append(case)

    collect()
    return cases


def check_response(case, r: schemathesis.Response) -> str | None:
    """None when the response is acceptable, else why not (headers: lowercase keys, list values)."""
    if r.status_code >= 500:
        return f"{r.status_code}: {r.text[:300]}"
    if r.status_code >= 400:
        try:
            err = r.json()["error"]
        except (ValueError, KeyError, TypeError):
            return f"{r.status_code} not in OpenAI's error shape: {r.text[:300]}"
        if set(err) != {"message", "type", "param", "code"}:
            return f"error object {err}"
    elif (
        r.headers.get("content-type", [""])[0].startswith("text/event-stream")
        and not r.stream_cut_short
        and not r.text.rstrip().endswith("data: [DONE]")
    ):
        return f"stream did not end with [DONE]: {r.text[-300:]}"
    if not r.headers.get("x-request-id"):
        return "no X-Request-ID"
    return None


@pytest.mark.timeout(600)
def test_schemathesis_run_no_5xx_no_hang_no_restart(fuzzed):
    before = processes(fuzzed)
    schema = schemathesis.openapi.from_url(f"{fuzzed.url}/openapi.json")
    cases = generated_cases(schema, FUZZ_REQUESTS)
    assert len(cases) >= 500
    statuses: collections.Counter = collections.Counter()
    problems: list[str] = []
    slowest = 0.0

    def call(case) -> None:
        nonlocal slowest
        started = time.monotonic()
        with requests.Session() as session:
            try:
                r = case.call(base_url=fuzzed.url, session=session, timeout=REQUEST_TIMEOUT_S + 30)
            except requests.RequestException as exc:  # a hung or dropped request
                problems.append(f"{exc!r}\n{case.as_curl_command()}")
                return
        slowest = max(slowest, time.monotonic() - started)
        statuses[(case.operation.path, r.status_code)] += 1
        if (why := check_response(case, r)) is not None:
            problems.append(f"{why}\n{case.as_curl_command()[:2000]}")

    started = time.monotonic()
    with ThreadPoolExecutor(FUZZ_THREADS) as pool:
        list(pool.map(call, cases))
    elapsed = time.monotonic() - started
    print(
        f"{sum(statuses.values())} requests in {elapsed:.0f}s (slowest {slowest:.1f}s):",
        json.dumps({f"{p} {s}": n for (p, s), n in sorted(statuses.items())}, indent=1),
    )
    assert not problems, "\n\n".join(problems[:10])
    assert sum(statuses.values()) >= 500
    assert sum(n for (p, s), n in statuses.items() if p.startswith("/v1/") and s == 200) >= 50  # real generations ran
    wait_for(lambda: not any(w["in_flight"] for w in fuzzed.workers()), 30, what="no request left in flight")
    workers = fuzzed.workers()
    assert all(w["state"] == "ready" and w["restarts"] == 0 and w["in_flight"] == 0 for w in workers), workers
    assert processes(fuzzed) == before
    metrics = httpx.get(f"{fuzzed.url}/metrics", timeout=10).text
    served = sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("llamadeploy_http_requests_total{") and '"/v1/' in line
    )
    assert served >= sum(n for (p, _), n in statuses.items() if p.startswith("/v1/"))
    assert 'status="5' not in metrics  # nothing answered 5xx, not even outside this run
    assert fuzzed.chat("What is the capital of France?", max_tokens=2).status_code == 200
