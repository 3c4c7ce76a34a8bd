"""Request migration end to end: real model, 2 CPU workers, ``kill -9`` mid-generation, and the batch
invariance that makes it exact (``workers.deterministic``, on by default).

Each migration test compares a disturbed run with the same requests on the same deployment left
alone: the streams must finish with exactly the undisturbed text, token count and finish reason.
The tests on ``mig`` share one deployment at the default precision (the GGUF file's Q4_1 weights as
stored, ``model.dtype: auto``: bfloat16 activations on a CPU with avx512_bf16) with the default
``workers.deterministic`` (true), default ``router.max_migrations``, each starting with both workers ready and idle; ``off`` is that
deployment with migration and retries then turned off live (``llamadeploy apply``).
"""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers.deployment import MODEL, Deployment, all_ready_and_idle, assert_openai_error, wait_for

MAX_TOKENS = 96
# The suite runs the default precision; another is one run of this module away, e.g.
# LLAMADEPLOY_TEST_MIG_MODEL='{"quantization": "int8"}' or '{"dtype": "float32", "quantization": "none"}'
PRECISION: dict = json.loads(os.environ.get("LLAMADEPLOY_TEST_MIG_MODEL", "{}"))
STREAM_TOKENS = 128  # the 16 streams of the kill -9 test


class Stream:
    """One streamed chat completion read on a thread: its text chunks, finish reasons, usage, errors."""

    def __init__(self, d: Deployment, body: dict):
        self.d, self.body = d, body
        self.chunks: list[str] = []
        self.finish: list[str] = []
        self.errors: list[dict] = []
        self.usage: dict | None = None
        self.done = False

    @property
    def text(self) -> str:
        return "".join(self.chunks)

    def run(self) -> Stream:
        body = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True}, **self.body}
        with httpx.stream("POST", f"{self.d.base_url}/chat/completions", json=body, timeout=300) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    self.done = True
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    self.errors.append(event)
                    continue
                if event.get("usage"):
                    self.usage = event["usage"]
                for choice in event["choices"]:
                    if choice["delta"].get("content"):
                        self.chunks.append(choice["delta"]["content"])
                    if choice["finish_reason"]:
                        self.finish.append(choice["finish_reason"])
        return self


def bodies(sampling: Callable[[int], dict], tokens: int = MAX_TOKENS) -> list[dict]:
    """The 8 concurrent requests of the stream tests, with ``sampling(i)`` for request ``i``."""
    return [
        {
            "messages": [{"role": "user", "content": f"Write a long story about city number {i}."}],
            "max_tokens": tokens,
            "ignore_eos": True,
            **sampling(i),
        }
        for i in range(8)
    ]


def run_streams(d: Deployment, requests: list[dict], kill_after_chunks: int | None = None) -> tuple[list[Stream], dict]:
    """Run the streams concurrently; with ``kill_after_chunks``, once every stream has shown that
    many text chunks (each at least one token), SIGKILL the worker serving the most of them.
    Returns the streams and the killed worker's table row at the kill (``{}`` if none)."""
    streams = [Stream(d, b) for b in requests]
    victim: dict = {}
    with ThreadPoolExecutor(len(streams)) as pool:
        futures = [pool.submit(s.run) for s in streams]
        if kill_after_chunks is not None:
            wait_for(
                lambda: all(len(s.chunks) >= kill_after_chunks for s in streams) or any(f.done() for f in futures),
                180,
                what=f"every stream to show {kill_after_chunks} chunks",
            )
            assert not any(f.done() for f in futures), "a stream ended before the kill"
            victim = max(d.workers(), key=lambda w: w["in_flight"])
            assert victim["in_flight"] >= 1
            os.kill(victim["pid"], signal.SIGKILL)
        for f in futures:
            f.result()
    return streams, victim


def migrations(d: Deployment) -> float:
    text = httpx.get(f"{d.url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r"^llamadeploy_request_migrations_total\{[^}]*\} (\S+)$", text, re.M))


def token_events(d: Deployment, wid: int) -> float:
    """Token events the router has received from worker ``wid`` (its inter-token latency samples)."""
    text = httpx.get(f"{d.url}/metrics", timeout=10).text
    found = re.search(
        rf'^llamadeploy_inter_token_latency_seconds_count\{{[^}}]*worker_id="{wid}"[^}}]*\}} (\S+)$', text, re.M
    )
    return float(found.group(1)) if found else 0.0


@pytest.fixture(scope="module")
def mig(tmp_path_factory):
    d = Deployment(
        tmp_path_factory.mktemp("migration"),
        {
            # 16 streams of 128 tokens: after a kill the moved half waits for rows on the other worker
            "router": {"policy": "least_loaded", "request_timeout_s": 600},
            "model": {"dtype": "auto", "quantization": "auto", **PRECISION},
            # the probe beside a 1,500-token prefill queues behind it on a loaded box
            "workers": {"max_queue_wait_s": 600},
        },
    )
    d.start()
    yield d
    assert d.stop() == 0, d.log()[-3000:]


def settled(d: Deployment) -> None:
    wait_for(lambda: all_ready_and_idle(d), 120, what="both workers ready and idle")


def assert_same_as_undisturbed(d: Deployment, requests: list[dict], tokens: int) -> None:
    settled(d)
    reference, _ = run_streams(d, requests)
    assert all(s.finish == ["length"] and not s.errors for s in reference), [(s.finish, s.errors) for s in reference]
    settled(d)
    moved_before = migrations(d)
    streams, victim = run_streams(d, requests, kill_after_chunks=16)
    for got, want in zip(streams, reference, strict=True):
        assert got.errors == [] and got.done, got.errors
        assert got.finish == ["length"], got.finish
        assert got.usage["completion_tokens"] == tokens == want.usage["completion_tokens"], got.usage
        assert got.usage["prompt_tokens"] == want.usage["prompt_tokens"]
    assert [s.text for s in streams] == [s.text for s in reference]
    assert migrations(d) - moved_before >= victim["in_flight"]
    assert re.search(rf"migrating from worker {victim['id']} to worker \d after \d+ tokens", d.log())


@pytest.mark.timeout(900)  # 32 streams of 128 tokens, the deployment's start included, on 2 shared cores
def test_greedy_and_seeded_streams_survive_a_kill9_with_the_undisturbed_text(mig):
    """8 greedy and 8 seeded streams of 128 tokens at once, a busy worker killed mid-stream: all 16
    continue on the other replica exactly as undisturbed (the default precision, batch-invariant)."""
    greedy = bodies(lambda i: {"temperature": 0}, STREAM_TOKENS)
    seeded = bodies(lambda i: {"temperature": 0.8, "seed": 1000 + i}, STREAM_TOKENS)
    assert_same_as_undisturbed(mig, greedy + seeded, STREAM_TOKENS)


def test_a_non_streaming_request_killed_halfway_returns_the_whole_answer(mig):
    body = {
        "messages": [{"role": "user", "content": "Tell me about the history of bread."}],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
    }
    settled(mig)
    want = httpx.post(f"{mig.base_url}/chat/completions", json={"model": MODEL, **body}, timeout=300).json()
    settled(mig)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(httpx.post, f"{mig.base_url}/chat/completions", json={"model": MODEL, **body}, timeout=300)
        busy = wait_for(lambda: next((w for w in mig.workers() if w["in_flight"]), None), 30, what="a busy worker")
        start = token_events(mig, busy["id"])
        wait_for(lambda: token_events(mig, busy["id"]) - start >= MAX_TOKENS // 2, 120, what="half the answer")
        os.kill(busy["pid"], signal.SIGKILL)
        got = future.result()
    assert got.status_code == 200, got.text
    answer = got.json()
    assert answer["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    assert answer["choices"][0]["finish_reason"] == "length"
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # the cache hits depend on the workers
    assert {k: answer["usage"][k] for k in counts} == {k: want["usage"][k] for k in counts}
    assert re.search(rf"migrating from worker {busy['id']} to worker \d after \d+ tokens", mig.log())


def test_a_stop_string_straddling_the_cut_is_caught(mig):
    """The stop string is long (many tokens): while the worker generates it the router sees no
    text (it is held back), and the kill lands inside it."""
    base = {
        "messages": [{"role": "user", "content": "Describe a walk through a forest."}],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
    }
    settled(mig)
    (full,), _ = run_streams(mig, [base])
    words = full.text.split(" ")
    head = " ".join(words[: len(words) // 3])  # well past 16 tokens in
    stop = full.text[len(head) : len(head) + 100]  # some 20 tokens, all held back until they match
    assert len(stop) == 100 and full.text.find(stop) == len(head), "pick a stop string that occurs once"
    settled(mig)
    moved_before = migrations(mig)
    stream = Stream(mig, {**base, "stop": [stop]})
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(stream.run)
        wait_for(
            lambda: stream.text == head or future.done(), 120, what="the text before the stop string", interval=0.005
        )
        busy = next(w for w in mig.workers() if w["in_flight"])
        os.kill(busy["pid"], signal.SIGKILL)
        future.result()
    assert stream.errors == [] and stream.done
    assert stream.text == head and stream.finish == ["stop"], (stream.text[-80:], stream.finish)
    assert migrations(mig) - moved_before == 1  # the cut was inside the stop string, not after it


PROBE = {
    "messages": [{"role": "user", "content": "What are three uses of copper?"}],
    "max_tokens": 32,
    "ignore_eos": True,
    "temperature": 0,
    "logprobs": True,
    "top_logprobs": 3,
}
DOCUMENT = "Summarise this report. " + " ".join(
    f"Section {i}: the plant in region {i % 7} shipped {100 + i} units, costs rose {i % 5} percent." for i in range(75)
)  # about 1,500 tokens


def answer(d: Deployment, body: dict) -> tuple[str, list]:
    """The text and the per-token logprobs (token, logprob, top alternatives) of a chat completion."""
    r = httpx.post(f"{d.base_url}/chat/completions", json={"model": MODEL, **body}, timeout=300)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["message"]["content"], choice["logprobs"]["content"]


@pytest.mark.timeout(600)
def test_a_prompt_gets_the_same_tokens_and_logprobs_alone_batched_and_beside_a_document(mig):
    """The probe alone; beside 7 other chats; then while both workers prefill a 1,500-token document
    (the probe's rows share steps with its chunks): the same text and logprobs, bit for bit,
    whichever replica serves it and from the prefix cache or not."""
    settled(mig)
    alone = answer(mig, PROBE)
    others = [{**b, "max_tokens": 32, "logprobs": True} for b in bodies(lambda i: {"temperature": 0})[:7]]
    with ThreadPoolExecutor(8) as pool:
        batched = [f.result() for f in [pool.submit(answer, mig, b) for b in [PROBE, *others]]]
    assert batched[0] == alone
    settled(mig)
    doc = {"messages": [{"role": "user", "content": DOCUMENT}], "max_tokens": 4, "temperature": 0, "logprobs": True}
    with ThreadPoolExecutor(9) as pool:
        docs = [pool.submit(answer, mig, doc) for _ in range(2)]
        wait_for(lambda: all(w["in_flight"] for w in mig.workers()), 60, what="both workers prefilling", interval=0.05)
        beside = [pool.submit(answer, mig, b) for b in [PROBE, *others]]
        assert not any(f.done() for f in docs), "the documents finished before the probe came"
        assert beside[0].result() == alone
        assert [f.result() for f in beside[1:]] == batched[1:]
        for f in docs:
            f.result()


def test_both_replicas_report_the_same_kernel_table(mig):
    """Replicas of one revision run the same kernel per weight and row count (their Ready's table,
    ``GET /workers``): a sequence's numbers do not depend on which one serves it."""
    settled(mig)
    tables = [
        [
            (c["n"], c["k"], c["weight"], c["count"], [(p["rows"], p["kernel"]) for p in c["picks"]])
            for c in w["kernels"]
        ]
        for w in mig.workers()
    ]
    assert len(tables) == 2 and tables[0], tables
    assert tables[0] == tables[1]
    # deterministic: one kernel per weight, or ggml's vec_dot and llamafile's tinyBLAS, which compute the
    # same Q8_0 / Q4_0 values (checked bit for bit at start: worker.quant.invariance.per_bucket)
    for *_, picks in tables[0]:
        kinds = {kernel for _, kernel in picks}
        assert len(kinds) == 1 or kinds == {"ggml", "tinyblas"}, picks


@pytest.fixture(scope="module")
def off(mig):
    """``mig`` with migration and retries turned off: both are live settings, so ``apply`` changes
    them in the router without restarting a process (a deployment of its own would start two more
    workers). The module's last test uses it."""
    done = mig.apply({"router": {"max_migrations": 0, "max_retries": 0}})
    assert done.returncode == 0 and "live (no restart)" in done.stdout, done.stdout
    return mig


def test_with_max_migrations_0_a_started_stream_ends_with_an_error_and_a_request_with_502(off):
    body = {
        "messages": [{"role": "user", "content": "Write a long story."}],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
    }
    settled(off)
    moved_before = migrations(off)  # the tests before moved streams on this deployment
    stream = Stream(off, body)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(stream.run)
        wait_for(lambda: len(stream.chunks) >= 16, 120, what="the stream to show text")
        busy = next(w for w in off.workers() if w["in_flight"])
        os.kill(busy["pid"], signal.SIGKILL)
        future.result()
    assert stream.finish == [] and stream.done and len(stream.errors) == 1
    assert_openai_error(stream.errors[0], "worker_lost")
    settled(off)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(httpx.post, f"{off.base_url}/chat/completions", json={"model": MODEL, **body}, timeout=300)
        busy = wait_for(lambda: next((w for w in off.workers() if w["in_flight"]), None), 30, what="a busy worker")
        start = token_events(off, busy["id"])
        wait_for(lambda: token_events(off, busy["id"]) - start >= 16, 120, what="tokens flowing")
        os.kill(busy["pid"], signal.SIGKILL)
        got = future.result()
    assert got.status_code == 502, got.text
    assert_openai_error(got.json(), "worker_lost")
    assert migrations(off) == moved_before
