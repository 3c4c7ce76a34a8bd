"""The main job end to end on the shared 2-replica CPU deployment."""

from __future__ import annotations

import json

import httpx
import pytest
from openai import OpenAI

from tests.helpers.deployment import MODEL, all_ready_and_idle, wait_for

CHINESE = "《三国演义》的主要人物有"
# a stream far longer than any test waits for: the tests close it, and the router cancels it
LONG_STREAM = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Tell me a very long story."}],
    "max_tokens": 1500,
    "ignore_eos": True,
    "stream": True,
}


def sse_events(d, body: dict) -> list[bytes]:
    """Raw ``data:`` payloads of one streamed request, as bytes (to check UTF-8 per chunk)."""
    events = []
    with httpx.stream("POST", f"{d.base_url}/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        buf = b""
        for part in r.iter_bytes():
            buf += part
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                assert event.startswith(b"data: ")
                events.append(event[6:])
    return events


def test_capital_of_france(deployment):
    r = deployment.chat("What is the capital of France?", max_tokens=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert "Paris" in body["choices"][0]["message"]["content"]
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    u = body["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] and u["completion_tokens"] > 0
    assert r.headers.get("X-Request-ID")


@pytest.mark.parametrize("prompt", ["Write two sentences about the sea.", CHINESE])
def test_stream_equals_non_stream_and_is_valid_utf8(deployment, prompt):
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": 40}
    whole = deployment.chat(prompt, max_tokens=40).json()["choices"][0]["message"]["content"]
    events = sse_events(deployment, {**body, "stream": True})
    assert events[-1] == b"[DONE]"
    text = ""
    for raw in events[:-1]:
        chunk = json.loads(raw.decode("utf-8"))  # strict: raises on a split multi-byte character
        delta = chunk["choices"][0]["delta"].get("content") or ""
        assert "\ufffd" not in delta
        text += delta
    assert json.loads(events[-2])["choices"][0]["finish_reason"] in ("stop", "length")
    assert text == whole
    if prompt == CHINESE:
        assert any("\u4e00" <= ch <= "\u9fff" for ch in text)


def test_stop_string_across_tokens(deployment):
    full = deployment.chat("What is the capital of France?", max_tokens=30).json()["choices"][0]["message"]["content"]
    assert "Paris" in full
    stop = "of Fr"  # spans token boundaries ("of", " France")
    r = deployment.chat("What is the capital of France?", max_tokens=30, stop=[stop]).json()
    assert r["choices"][0]["message"]["content"] == full[: full.index(stop)]
    assert r["choices"][0]["finish_reason"] == "stop"


def test_length_finish_reason(deployment):
    r = deployment.chat("Write a long story about a dragon.", max_tokens=5).json()
    assert r["choices"][0]["finish_reason"] == "length"
    assert r["usage"]["completion_tokens"] == 5


def served(d) -> dict[int, int]:
    return {w["id"]: w["served"] for w in d.workers()}


def test_round_robin_alternates(deployment):
    assert deployment.admin("POST", "/admin/policy", {"policy": "round_robin"}).status_code == 200
    try:
        order = []
        for _ in range(6):
            before = served(deployment)
            assert deployment.chat("Say hi.", max_tokens=3).status_code == 200
            after = served(deployment)
            changed = [w for w in after if after[w] != before[w]]
            assert len(changed) == 1
            order.append(changed[0])
        assert all(a != b for a, b in zip(order, order[1:])), order
        assert sorted(set(order)) == [0, 1]
    finally:
        deployment.admin("POST", "/admin/policy", {"policy": "least_loaded"})


def test_least_loaded_prefers_idle_worker(deployment):
    assert deployment.workers()[0]["state"] == "ready"
    # A long stream holds one worker; leaving the block closes it, and the router cancels it there
    # (no need to wait for its end).
    with httpx.stream("POST", f"{deployment.base_url}/chat/completions", json=LONG_STREAM, timeout=300) as long:
        assert long.status_code == 200
        busy = wait_for(
            lambda: next((w for w in deployment.workers() if w["in_flight"] == 1), None),
            30,
            what="the long request in flight on a worker",
        )["id"]
        for _ in range(3):
            before = served(deployment)
            assert deployment.chat("Say hi.", max_tokens=3).status_code == 200
            after = served(deployment)
            assert deployment.worker(busy)["in_flight"] == 1  # the long one still runs there
            assert after[1 - busy] == before[1 - busy] + 1 and after[busy] == before[busy]
    wait_for(lambda: all_ready_and_idle(deployment), 60, what="the long stream cancelled")


def test_openai_sdk(deployment):
    client = OpenAI(base_url=deployment.base_url, api_key="unused")
    models = [m.id for m in client.models.list()]
    assert models == [MODEL]
    chat = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=20,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    assert "Paris" in chat.choices[0].message.content
    stream = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    comp = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert comp.choices[0].text and comp.usage.prompt_tokens > 0
    assert comp.choices[0].finish_reason in ("stop", "length")


LONG = "word " * 3000

BAD = [
    ("malformed json", b'{"model": "x", "messages": [', 400),
    ("missing messages", {"model": MODEL}, 400),
    ("empty messages", {"model": MODEL, "messages": []}, 400),
    ("negative max_tokens", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400),
    ("float max_tokens", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1.5}, 400),
    ("temperature too high", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 5}, 400),
    ("unknown model", {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404),
    (
        "too long for context",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2040},
        400,
    ),
    ("prompt too long", {"model": MODEL, "messages": [{"role": "user", "content": LONG}], "max_tokens": 10}, 400),
]


@pytest.mark.parametrize("name,body,status", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_openai_error(deployment, name, body, status):
    kw = (
        {"content": body, "headers": {"Content-Type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    r = httpx.post(f"{deployment.base_url}/chat/completions", timeout=60, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if name == "too long for context":
        assert "2048" in err["message"] and "2040" in err["message"]
    ok = deployment.chat("What is the capital of France?", max_tokens=10)
    assert ok.status_code == 200


def test_bad_completion_prompt(deployment):
    r = httpx.post(f"{deployment.base_url}/completions", json={"model": MODEL, "prompt": ""}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_client_disconnect_cancels_generation(deployment):
    with httpx.stream("POST", f"{deployment.base_url}/chat/completions", json=LONG_STREAM, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 5:
                break
    wait_for(
        lambda: all(w["in_flight"] == 0 and w["running"] == 0 for w in deployment.workers()),
        20,
        what="the cancelled generation gone from the router and the worker",
    )


def test_health_and_workers(deployment):
    assert httpx.get(f"{deployment.url}/health").status_code == 200
    ws = deployment.workers()
    assert [w["id"] for w in ws] == [0, 1]
    assert all(w["state"] == "ready" and w["device"].startswith("cpu") and w["pid"] > 0 for w in ws)
    assert ws[0]["device"] != ws[1]["device"]  # disjoint core sets
