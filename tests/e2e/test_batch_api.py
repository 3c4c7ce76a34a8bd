"""The Batch API and request priority end to end, with the official ``openai`` SDK: ``service_tier``
and ``priority`` accepted and echoed; ``files.create``, ``batches.create``, polling and
``files.content`` on the shared deployment (every endpoint a batch runs); malformed and oversized
files refused with nothing changed; files and batches visible to their own key only (the keyed
deployment); and a batch that survives a router ``kill -9``, a worker ``kill -9`` and a full
``down`` / ``up`` with every line answered once (``durable``, this module's own deployment)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import openai
import pytest
from openai import OpenAI

from tests.helpers.deployment import MODEL, STANDBY, Deployment, assert_openai_error, cli, wait_for
from tests.helpers.keyed import ENV_KEYS

FINISHED = ("completed", "failed", "expired", "cancelled")


def chat_line(cid: str, content: str, **extra) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0}
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": {**body, **extra}}


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


def run_batch(client: OpenAI, lines: list[dict], endpoint: str, timeout: float = 300):
    """Upload ``lines``, run them as one batch and wait for it to end; returns (batch, output lines, error lines)."""
    f = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    assert (f.object, f.purpose, f.bytes) == ("file", "batch", len(jsonl(lines)))
    batch = client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h", metadata={"t": "e2e"})
    assert batch.status in ("validating", "in_progress") and batch.request_counts.total == len(lines)
    batch = wait_for(lambda: finished(client, batch.id), timeout, f"batch {batch.id} to finish", interval=0.5)
    return batch, read_lines(client, batch.output_file_id), read_lines(client, batch.error_file_id)


def finished(client: OpenAI, bid: str):
    batch = client.batches.retrieve(bid)
    return batch if batch.status in FINISHED else None


def read_lines(client: OpenAI, fid: str | None) -> list[dict]:
    return [] if fid is None else [json.loads(x) for x in client.files.content(fid).text.splitlines()]


# ---- service_tier and priority (the shared deployment) ---------------------------------------


def test_service_tier_is_echoed_as_openai_does_and_priority_is_accepted(client):
    ask = [{"role": "user", "content": "Say hi."}]
    greedy = {"model": MODEL, "messages": ask, "max_tokens": 4, "temperature": 0}
    flex = client.chat.completions.create(**greedy, service_tier="flex")
    auto = client.chat.completions.create(**greedy, service_tier="auto")
    plain = client.chat.completions.create(**greedy, extra_body={"priority": -5})
    assert (flex.service_tier, auto.service_tier, plain.service_tier) == ("flex", "default", None)
    assert flex.choices[0].message.content == plain.choices[0].message.content  # the tier changes when, not what
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=ask, max_tokens=4, service_tier="priority", stream=True)
    )
    assert chunks and all(c.service_tier == "priority" for c in chunks)
    done = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, extra_body={"service_tier": "flex"})
    assert done.model_dump()["service_tier"] == "flex"
    resp = client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=16, service_tier="flex")
    assert resp.service_tier == "flex" and resp.output_text


def test_a_bad_service_tier_or_priority_is_a_400_naming_it(deployment):
    for field, value in (("service_tier", "scale"), ("priority", "high"), ("priority", 2**40)):
        got = deployment.chat("Hi", max_tokens=2, **{field: value})
        assert assert_openai_error(got, "invalid_value", 400)["param"] == field


# ---- the Batch API on the shared deployment ---------------------------------------------------


def test_a_chat_batch_through_the_sdk_answers_each_line_once_as_the_endpoint_does(client):
    lines = [chat_line(f"doc-{i}", f"Name a colour, number {i}.") for i in range(3)]
    lines.append(chat_line("bad", "Hi", temperature=5))  # the endpoint refuses it: an error line
    batch, out, errors = run_batch(client, lines, "/v1/chat/completions")
    assert batch.status == "completed" and batch.metadata == {"t": "e2e"}
    assert batch.request_counts.model_dump() == {"total": 4, "completed": 3, "failed": 1}
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    assert [x["custom_id"] for x in out] == ["doc-0", "doc-1", "doc-2"]
    direct = client.chat.completions.create(**lines[0]["body"])
    first = out[0]["response"]
    assert first["status_code"] == 200 and first["body"]["object"] == "chat.completion" and out[0]["error"] is None
    assert first["body"]["choices"][0]["message"]["content"] == direct.choices[0].message.content
    assert [x["custom_id"] for x in errors] == ["bad"] and errors[0]["response"]["status_code"] == 400
    assert errors[0]["response"]["body"]["error"]["param"] == "temperature"
    assert batch.id in [b.id for b in client.batches.list(limit=100)]
    assert batch.input_file_id in [f.id for f in client.files.list(purpose="batch")]
    assert client.files.delete(batch.input_file_id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(batch.input_file_id)
    assert client.batches.retrieve(batch.id).status == "completed"  # its lines were copied: the file can go


@pytest.mark.parametrize(
    ("endpoint", "body", "shape"),
    [
        ("/v1/completions", {"model": MODEL, "prompt": "Once upon", "max_tokens": 4}, "text_completion"),
        ("/v1/responses", {"model": MODEL, "input": "Say hi.", "max_output_tokens": 16}, "response"),
    ],
)
def test_completions_and_responses_batches(client, endpoint, body, shape):
    batch, out, errors = run_batch(
        client, [{"custom_id": "x", "method": "POST", "url": endpoint, "body": body}], endpoint
    )
    assert batch.status == "completed" and not errors
    assert out[0]["response"]["body"]["object"] == shape


def test_an_embeddings_batch_on_a_chat_model_answers_each_line_with_the_endpoints_400(client):
    line = {"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": {"model": MODEL, "input": "hi"}}
    batch, out, errors = run_batch(client, [line], "/v1/embeddings")
    assert batch.status == "completed" and batch.request_counts.failed == 1 and not out
    assert errors[0]["response"]["body"]["error"]["code"] == "wrong_endpoint"


def test_a_batch_whose_lines_ask_another_endpoint_is_refused(client):
    f = client.files.create(file=("in.jsonl", jsonl([chat_line("a", "Hi")])), purpose="batch")
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    assert e.value.body["code"] == "invalid_url"


def test_bench_mixed_suite_measures_every_figure_here_and_for_a_compare_url(deployment, tmp_path):
    """`llamadeploy bench --suite mixed` end to end, tiny counts, ``--compare`` naming the same
    server's URL (the peer path): every figure is measured for both (the numbers are not checked)."""
    out = tmp_path / "mixed"
    args = ["--suite", "mixed", "--documents", "1", "--pipelines", "1", "--chat-clients", "1", "--requests", "2"]
    args += ["--output-tokens", "8", "--answer-tokens", "24", "--compare", deployment.base_url, "--output", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "bench", deployment.base_url, *args],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = json.loads(out.with_suffix(".json").read_text())["runs"]
    assert [r["base_url"] for r in runs] == [deployment.base_url] * 2
    for run in runs:
        assert run["chat_alone"]["requests"] == 2 and run["chat_alone"]["ttft_p95_s"] > 0
        assert run["documents"]["answers"] == 2 and run["documents"]["failed"] == 0, run["documents"]
        assert run["documents"]["documents_per_min"] > 0 and run["documents"]["parsed_share"] is not None
    assert "chat TTFT p95, beside the documents" in proc.stdout and "documents per minute" in proc.stdout


# ---- per-key visibility (the keyed deployment) ------------------------------------------------


@pytest.mark.timeout(600)  # this module may be the first to start the session's keyed deployment
def test_files_and_batches_are_visible_only_to_the_key_that_made_them(secured):
    mine = OpenAI(base_url=secured.base_url, api_key=ENV_KEYS[0], max_retries=0, timeout=60)
    other = OpenAI(base_url=secured.base_url, api_key=ENV_KEYS[1], max_retries=0, timeout=60)
    f = mine.files.create(file=("in.jsonl", jsonl([chat_line("a", "Hi", max_tokens=2)])), purpose="batch")
    batch = mine.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    for call in (
        lambda: other.files.retrieve(f.id),
        lambda: other.files.content(f.id),
        lambda: other.files.delete(f.id),
        lambda: other.batches.retrieve(batch.id),
        lambda: other.batches.cancel(batch.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert f.id not in [x.id for x in other.files.list()] and batch.id not in [b.id for b in other.batches.list()]
    assert mine.files.retrieve(f.id).id == f.id
    wait_for(lambda: finished(mine, batch.id), 120, "the keyed batch to finish", interval=0.5)


# ---- bounds and durability (this module's deployment) -----------------------------------------

MAX_FILE_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def durable(tmp_path_factory):
    """One replica; small batch bounds (a 64 KiB file, 20 lines); one line in flight at a time, so
    a batch is still running when its router or worker is killed."""
    d = Deployment(
        tmp_path_factory.mktemp("durable"),
        {
            "workers": {"replicas": 1},
            "router": {"batch": {"max_file_bytes": MAX_FILE_BYTES, "max_lines": 20, "running": 1}},
            **STANDBY,  # its router is killed: the standby takes over
        },
    )
    try:
        d.start(timeout=420)
        yield d
    finally:
        d.stop()


def test_a_malformed_or_oversized_file_is_a_4xx_and_changes_nothing(durable):
    client = OpenAI(base_url=durable.base_url, api_key="unused", max_retries=0, timeout=60)
    before = client.files.list().model_dump()["data"]
    cases = [
        (b'{"custom_id": "a", "method": "POST"\n', 400, "invalid_json_line"),
        (jsonl([chat_line(str(i), "Hi") for i in range(21)]), 400, "too_many_requests"),
        (jsonl([chat_line("a", "x" * 1000)]) * 100, 413, "file_too_large"),
    ]
    for content, status, code in cases:
        got = httpx.post(f"{durable.base_url}/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"})
        assert assert_openai_error(got, code, status)["message"], got.text
    assert client.files.list().model_dump()["data"] == before
    assert client.batches.list().data == []


def pids(d: Deployment) -> tuple[int, int]:
    table = d.admin("GET", "/admin/workers").json()
    return table["router"]["pid"], table["workers"][0]["pid"]


@pytest.mark.timeout(900)  # two restarts of the deployment's processes and a full down/up on a loaded 2-core box
def test_a_batch_survives_router_and_worker_kill9_and_down_up_answering_each_line_once(durable):
    client = OpenAI(base_url=durable.base_url, api_key="unused", max_retries=0, timeout=60)
    lines = [chat_line(f"doc-{i}", f"Tell me about the number {i}.", max_tokens=8, ignore_eos=True) for i in range(6)]
    f = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    bid = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id

    def done_at_least(n: int) -> None:
        counts = lambda: client.batches.retrieve(bid).request_counts  # noqa: E731
        wait_for(lambda: counts().completed >= n, 300, f"{n} lines done", interval=0.5)

    done_at_least(1)
    router = pids(durable)[0]
    os.kill(router, signal.SIGKILL)
    wait_for(lambda: httpx.get(f"{durable.url}/health/ready", timeout=2).status_code == 200, 120, "a new router")
    done_at_least(2)
    os.kill(pids(durable)[1], signal.SIGKILL)
    status = cli("status", str(durable.path))
    assert f"batch {bid} in_progress" in status.stdout, status.stdout
    durable.stop()
    durable.start(timeout=420)
    batch = wait_for(lambda: finished(client, bid), 300, "the batch to finish after up", interval=0.5)
    out = read_lines(client, batch.output_file_id)
    assert batch.status == "completed" and batch.request_counts.model_dump() == {
        "total": 6,
        "completed": 6,
        "failed": 0,
    }
    assert sorted(x["custom_id"] for x in out) == sorted(x["custom_id"] for x in lines)  # each once
    assert all(x["response"]["body"]["usage"]["completion_tokens"] == 8 for x in out)
    assert batch.error_file_id is None and pids(durable)[0] != router
