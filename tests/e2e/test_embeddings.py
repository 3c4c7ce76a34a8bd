"""``POST /v1/embeddings`` end to end on one deployment of the embedded embedding model
(all-MiniLM-L6-v2) beside the chat model, one CPU worker each: vectors against sentence-transformers
in process, the answer's forms (float, base64, ``dimensions``), every malformed input refused while
the worker keeps serving, the bodies the clients send (openai SDK, Spring AI, LangChain4j),
batching across requests, chat beside embeddings (each endpoint refusing the other's model), the
JDK example, and last a ``kill -9`` of the embedding worker."""

from __future__ import annotations

import base64
import itertools
import os
import re
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from openai import OpenAI

from tests.helpers.deployment import MODEL as CHAT_MODEL
from tests.helpers.deployment import Deployment, cli, wait_for
from tests.helpers.java import run_example
from tests.helpers.steady_load import SteadyLoad

EMBED_MODEL = "all-minilm-l6-v2"
SUBJECTS = ["The cat", "A data centre", "My grandmother", "The river", "An old violin"]
VERBS = ["sleeps near", "hums beside", "remembers", "flows past", "waits for"]
VERBS += ["sings about", "ignores", "dreams of", "sits under", "looks at"]
SENTENCES = [f"{s} {v} the window." for s, v in itertools.product(SUBJECTS, VERBS)]
SENTENCES[7] = "émigré naïve café — 日本語のテキスト 🙂"  # non-ASCII and characters the vocabulary lacks
SENTENCES[11] = "word " * 200  # a long one (about 200 tokens, within the 256 limit)
assert len(SENTENCES) == 50


@pytest.fixture(scope="module")
def emb(tmp_path_factory) -> Deployment:
    """Chat beside embeddings: SmolLM2 (worker 0) and all-minilm-l6-v2 (worker 1), one CPU replica
    each; room for 100 concurrent embedding requests."""
    d = Deployment(
        tmp_path_factory.mktemp("embeddings"),
        {
            "models": [
                {"name": CHAT_MODEL, "workers": {"max_prefill_tokens": 256}},  # no calibration at start
                {"name": EMBED_MODEL},  # task: auto finds a sentence-transformers folder
            ],
            "workers": {"replicas": 1, "max_waiting": 160},
            "router": {"hold_s": 400},  # a chat worker reloading on a busy 2-core box: its requests wait
        },
    )
    try:
        yield d.start(timeout=400)
    finally:
        assert d.stop() == 0, d.log()[-3000:]


def embed_worker(d: Deployment) -> dict:
    (w,) = [w for w in d.workers() if w["model"] == EMBED_MODEL]
    return w


@pytest.fixture(scope="module")
def reference():
    """sentence-transformers' own ``encode`` of the same model folder, in this process (float32)."""
    from sentence_transformers import SentenceTransformer

    from launcher.models import resolve_model

    return SentenceTransformer(str(resolve_model(EMBED_MODEL)), device="cpu")


def post(d: Deployment, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{d.base_url}/embeddings", json=body, timeout=timeout)


def vectors(answer: dict) -> np.ndarray:
    """The answer's vectors in index order, decoding base64 as OpenAI's SDKs do (little-endian float32)."""
    rows = sorted(answer["data"], key=lambda r: r["index"])
    return np.array(
        [
            np.frombuffer(base64.b64decode(r["embedding"]), "<f4")
            if isinstance(r["embedding"], str)
            else r["embedding"]
            for r in rows
        ],
        dtype=np.float32,
    )


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_vectors_equal_sentence_transformers(emb, reference):
    got = post(emb, {"model": EMBED_MODEL, "input": SENTENCES})
    assert got.status_code == 200, got.text
    answer = got.json()
    assert answer["object"] == "list" and answer["model"] == EMBED_MODEL
    assert [r["index"] for r in answer["data"]] == list(range(50))
    assert all(r["object"] == "embedding" for r in answer["data"])
    expected = reference.encode(SENTENCES, convert_to_numpy=True)
    ours = vectors(answer)
    assert ours.shape == expected.shape == (50, 384)
    worst = cosines(ours, expected).min()
    assert worst >= 0.9999, worst
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)  # its Normalize module
    tokens = sum(len(reference.tokenizer(s)["input_ids"]) for s in SENTENCES)
    assert answer["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_base64_and_float_decode_to_the_same_vectors(emb):
    body = {"input": SENTENCES[:5]}
    as_float = post(emb, {**body, "encoding_format": "float"}).json()
    as_b64 = post(emb, {**body, "encoding_format": "base64"}).json()
    assert all(isinstance(r["embedding"], str) for r in as_b64["data"])
    assert np.array_equal(vectors(as_float), vectors(as_b64))  # float32 both ways: bit for bit


def test_dimensions(emb):
    """MiniLM was not trained for shorter vectors (no truncate_dim in its config): any other width
    is a 400 naming dimensions; its own width is accepted. The truncation itself (cut, renormalise)
    is tests/unit/test_embed_request.py's, on a spec that allows it."""
    refused = post(emb, {"input": "hello", "dimensions": 128})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "dimensions", refused.text
    assert "384" in refused.json()["error"]["message"]
    same = post(emb, {"input": "hello", "dimensions": 384})
    assert same.status_code == 200 and len(same.json()["data"][0]["embedding"]) == 384


MALFORMED = {
    "no input": {},
    "empty list": {"input": []},
    "empty string": {"input": ""},
    "an empty string in a list": {"input": ["a", ""]},
    "2049 inputs": {"input": ["x"] * 2049},
    "mixed kinds": {"input": ["a", [1, 2]]},
    "nested too deep": {"input": [[[1, 2]]]},
    "a number": {"input": 3.5},
    "an object": {"input": {"text": "a"}},
    "booleans as ids": {"input": [True, False]},
    "floats as ids": {"input": [[1.5, 2]]},
    "an empty id array": {"input": [[101, 102], []]},
    "ids out of vocabulary": {"input": [[101, 30522]]},
    "negative id": {"input": [-1, 5]},
    "wrong encoding_format": {"input": "a", "encoding_format": "int8"},
    "dimensions zero": {"input": "a", "dimensions": 0},
    "dimensions a string": {"input": "a", "dimensions": "128"},
    "too long": {"input": ["short", "word " * 300]},
    "stream true (the answer is one body)": {"input": "a", "stream": True},
}


@pytest.mark.parametrize("body", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_input_is_a_400_and_the_worker_keeps_serving(emb, body):
    got = post(emb, body)
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"] and error["param"], error
    assert post(emb, {"input": "still serving"}).status_code == 200


def test_a_lone_surrogate_in_a_single_string_is_a_400(emb):
    # JSON's escape reaches the tokenizer as text that cannot be UTF-8 (was a 500); httpx's json= cannot send it
    raw = b'{"input": "\\ud800"}'
    got = httpx.post(
        f"{emb.base_url}/embeddings", content=raw, headers={"content-type": "application/json"}, timeout=60
    )
    assert got.status_code == 400 and got.json()["error"]["param"] == "input", got.text
    assert "surrogate" in got.json()["error"]["message"]


def test_too_long_names_the_input_and_both_lengths_unless_truncated(emb):
    long = "word " * 300  # 302 tokens with [CLS] and [SEP]
    got = post(emb, {"input": ["short", long]})
    message = got.json()["error"]["message"]
    assert got.status_code == 400 and "input[1]" in message and "302" in message and "256" in message, message
    cut = post(emb, {"input": ["short", long], "truncate": True})
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 3 + 256


def test_token_id_inputs(emb, reference):
    ids = reference.tokenizer(["Hello world", "The river flows."])["input_ids"]
    by_ids = post(emb, {"input": ids}).json()
    by_text = post(emb, {"input": ["Hello world", "The river flows."]}).json()
    assert cosines(vectors(by_ids), vectors(by_text)).min() >= 0.99999
    one = post(emb, {"input": ids[0]}).json()  # an array of ids is one input
    assert len(one["data"]) == 1 and one["usage"]["prompt_tokens"] == len(ids[0])


def test_openai_sdk_base64_default_and_float(emb, reference):
    client = OpenAI(base_url=emb.base_url, api_key="unused", max_retries=0)
    default = client.embeddings.create(model=EMBED_MODEL, input=["A cat sits.", "Rain falls."])  # asks for base64
    floats = client.embeddings.create(model=EMBED_MODEL, input=["A cat sits.", "Rain falls."], encoding_format="float")
    a = np.array([d.embedding for d in default.data], dtype=np.float32)
    b = np.array([d.embedding for d in floats.data], dtype=np.float32)
    assert a.shape == (2, 384) and np.array_equal(a, b)
    assert cosines(a, reference.encode(["A cat sits.", "Rain falls."])).min() >= 0.9999
    assert default.usage.prompt_tokens == default.usage.total_tokens > 0


def test_spring_ai_body(emb):
    """Spring AI's OpenAiEmbeddingModel (models/spring-ai-openai OpenAiEmbeddingModel.createRequest,
    OpenAiApi.EmbeddingRequest): a batch of document texts (its TokenCountBatchingStrategy fills a
    request up to the model's token budget), ``model``, ``encoding_format: float``; null fields left out."""
    docs = [f"Chunk {i} of the user manual: press the red button to stop." for i in range(40)]
    got = post(emb, {"input": docs, "model": EMBED_MODEL, "encoding_format": "float"})
    assert got.status_code == 200, got.text
    data = got.json()["data"]
    assert [d["index"] for d in data] == list(range(40)) and all(len(d["embedding"]) == 384 for d in data)


def test_langchain4j_body(emb):
    """LangChain4j's OpenAiEmbeddingModel (langchain4j-open-ai OpenAiEmbeddingModel.embedTexts): the
    texts of up to maxSegmentsPerBatch (2048) segments, ``model``, ``dimensions`` and ``user`` when set
    (here: its builder's dimensions(384) and user), read back as ``data[i].embedding`` floats."""
    got = post(emb, {"input": ["I love Java", "Spring is here"], "model": EMBED_MODEL, "dimensions": 384, "user": "u1"})
    assert got.status_code == 200, got.text
    assert [len(d["embedding"]) for d in got.json()["data"]] == [384, 384]


def test_chat_beside_embeddings_and_each_endpoint_refuses_the_other_model(emb):
    chat = emb.chat("What is the capital of France?", max_tokens=8)
    assert chat.status_code == 200 and chat.json()["model"] == CHAT_MODEL, chat.text
    body = {"model": EMBED_MODEL, "messages": [{"role": "user", "content": "hi"}]}
    wrong = [
        httpx.post(f"{emb.base_url}/chat/completions", json=body, timeout=60),
        httpx.post(f"{emb.base_url}/completions", json={"model": EMBED_MODEL, "prompt": "hi"}, timeout=60),
    ]
    for got in wrong:
        assert got.status_code == 400 and got.json()["error"]["code"] == "wrong_endpoint", got.text
        assert EMBED_MODEL in got.json()["error"]["message"] and "/v1/embeddings" in got.json()["error"]["message"]
    back = post(emb, {"input": "a", "model": CHAT_MODEL})
    assert back.status_code == 400 and back.json()["error"]["code"] == "wrong_endpoint", back.text
    assert "/v1/chat/completions" in back.json()["error"]["message"]
    unknown = post(emb, {"input": "a", "model": "nope"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    listed = httpx.get(f"{emb.base_url}/models", timeout=10).json()["data"]
    got = [(m["id"], m["task"]) for m in listed]
    assert got == [(CHAT_MODEL, "generate"), (EMBED_MODEL, "embed")]
    assert listed[1]["max_model_len"] == 256  # tokens per input


def test_the_chat_pages_picker_offers_the_chat_model_only_and_the_status_page_names_both(emb):
    from tests.helpers.browser import Browser, chromium_paths

    chromium_paths()  # skips without a browser
    browser = Browser()
    try:
        browser.open(f"{emb.url}/")
        browser.wait(lambda: browser.find("#model").get_attribute("value"), 30, "the model list")
        assert [o.get_attribute("value") for o in browser.find_all("#model option")] == [CHAT_MODEL]
        browser.open(f"{emb.url}/status")
        browser.wait(lambda: len(browser.find_all("#workers tbody tr")) == 2, 30, "a row per replica")
        shown = [r.find_element("css selector", "td[data-model]").text for r in browser.find_all("#workers tbody tr")]
        assert shown == [CHAT_MODEL, EMBED_MODEL]
        assert browser.find("#model-name").text == f"{CHAT_MODEL}, {EMBED_MODEL}"  # the header names both
    finally:
        browser.quit()


def test_100_one_line_requests_beside_a_2048_input_request(emb, reference):
    """Batching across requests: all of them answered, each vector as sentence-transformers'
    (batch composition changes nothing beyond float rounding), none refused."""
    lines = [f"line number {i} about {SUBJECTS[i % 5].lower()}" for i in range(100)]
    big = [f"item {i}" for i in range(2048)]
    with ThreadPoolExecutor(101) as pool:
        large = pool.submit(post, emb, {"input": big}, 600)
        small = [pool.submit(post, emb, {"input": line}, 600) for line in lines]
        answers = [f.result() for f in small]
        large_answer = large.result()
    assert [a.status_code for a in answers] == [200] * 100, [a.text for a in answers if a.status_code != 200][:3]
    assert large_answer.status_code == 200, large_answer.text
    got = np.concatenate([vectors(a.json()) for a in answers])
    assert cosines(got, reference.encode(lines)).min() >= 0.9999
    sample = [0, 1, 1000, 2047]
    assert cosines(vectors(large_answer.json())[sample], reference.encode([big[i] for i in sample])).min() >= 0.9999
    assert emb.next_heartbeat(embed_worker(emb)["id"])["peak_running"] > 1  # requests shared steps


def test_java_embeddings_example(emb, reference):
    a, b = "A cat sits on the mat.", "A kitten is lying on the rug."
    out = run_example("Embeddings.java", a, b, env={"LLAMADEPLOY_URL": emb.base_url})
    lines = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    expected = float(cosines(*[v[None] for v in reference.encode([a, b])])[0])
    assert lines["dimensions"] == "384" and abs(float(lines["cosine"]) - expected) < 1e-4, lines


def held_for(d: Deployment, model: str) -> float:
    """Requests held for a replica of ``model`` and then dispatched (``/metrics``)."""
    text = httpx.get(f"{d.url}/metrics", timeout=10).text
    pattern = rf'request_hold_seconds_count\{{[^}}]*model="{re.escape(model)}"[^}}]*outcome="dispatched"[^}}]*\}} (\S+)'
    return sum(float(v) for v in re.findall(pattern, text))


def chat_worker(d: Deployment) -> dict:
    (w,) = [w for w in d.workers() if w["model"] == CHAT_MODEL]
    return w


def with_chat_seqs(d: Deployment, seqs: int) -> dict:
    """The deployment's ``models:`` list with the chat entry's ``workers.max_num_seqs`` set to ``seqs``."""
    chat, other = d.config["models"]
    return {"models": [{**chat, "workers": {**chat.get("workers", {}), "max_num_seqs": seqs}}, other]}


def test_apply_dry_run_plans_the_chat_model_only_and_a_new_model_is_refused(emb):
    """``apply --dry-run`` of the chat entry's ``max_num_seqs``: the plan replaces the chat worker
    only (surge); a file that adds a model is refused in one line, and nothing changes."""
    chat = chat_worker(emb)
    done = emb.apply(with_chat_seqs(emb, chat["max_num_seqs"] + 1), "--dry-run")
    assert done.returncode == 0, done.stdout
    assert f"replace worker {chat['id']} (surge" in done.stdout and done.stdout.count("replace worker") == 1
    assert f"workers.max_num_seqs ({CHAT_MODEL})" in done.stdout and "dry run: nothing changed" in done.stdout
    added = {"models": [*emb.config["models"], {"name": CHAT_MODEL, "served_name": "another"}]}
    done = emb.apply(added)
    assert done.returncode == 2 and "refused: models: apply changes the models a deployment serves" in done.stdout
    assert "needs `llamadeploy up` again" in done.stdout and "rolled back" not in done.stdout
    assert chat_worker(emb)["pid"] == chat["pid"] and embed_worker(emb)["restarts"] == 0


def test_rolling_apply_then_restart_of_the_chat_worker_hold_chat_and_leave_embeddings_unaffected(emb):
    """While 2 chat streams and an embedding loop run: a rolling ``apply`` of the chat model's
    ``max_num_seqs`` (its replacement loads beside it on its core, then it drains: no request
    waits), then ``restart-worker --drain`` of the new chat worker (drained first: chat requests
    are held until its replacement is ready). No chat 5xx, no stream cut; every embedding request
    answered 200 by its untouched worker (moved to the new revision without a restart), none held."""
    chat_before, embed_before = chat_worker(emb), embed_worker(emb)
    held0, embed_held0 = held_for(emb, CHAT_MODEL), held_for(emb, EMBED_MODEL)
    seqs = chat_before["max_num_seqs"] + 1
    statuses: dict[int, int] = {}
    stop = threading.Event()

    def embed_loop() -> None:
        while not stop.is_set():
            r = post(emb, {"input": "a steady sentence beside the chat"}, timeout=120)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1

    with SteadyLoad(emb.base_url, CHAT_MODEL, clients=2, max_tokens=8, timeout=400) as chats:
        with ThreadPoolExecutor(1) as pool:
            loop = pool.submit(embed_loop)
            chats.wait_completed(2, timeout=300)
            applied = emb.apply(with_chat_seqs(emb, seqs))
            assert applied.returncode == 0, applied.stdout
            chats.wait_completed(2, timeout=300)
            rolled = chat_worker(emb)
            restart = ["restart-worker", str(rolled["id"]), "--drain", "--config", str(emb.path)]
            done = cli(*restart, timeout=600)
            assert done.returncode == 0, done.stdout + done.stderr
            chats.wait_completed(2, timeout=300)
            stop.set()
            loop.result()
        counts = chats.stop()
    assert counts.failed == 0 and counts.server_errors == 0, (counts.failures, counts.statuses)
    assert set(statuses) == {200} and sum(statuses.values()) >= 10, statuses
    assert held_for(emb, CHAT_MODEL) > held0  # chat requests arrived while no chat replica was ready
    assert held_for(emb, EMBED_MODEL) == embed_held0
    assert f"replace worker {chat_before['id']} (surge" in applied.stdout and "applied: revision" in applied.stdout
    assert (rolled["pid"] != chat_before["pid"], rolled["max_num_seqs"], rolled["revision"]) == (True, seqs, 2)
    chat_after = chat_worker(emb)
    assert chat_after["pid"] != rolled["pid"] and chat_after["state"] == "ready"
    assert chat_after["max_num_seqs"] == seqs  # the restart keeps the applied revision
    embed_now = embed_worker(emb)
    assert (embed_now["pid"], embed_now["restarts"], embed_now["state"]) == (embed_before["pid"], 0, "ready")
    assert embed_now["revision"] == 2


def test_kill9_of_the_embedding_worker_retries_its_requests_it_restarts_chat_untouched(emb):
    """Last (it restarts the worker): requests in flight when the embedding worker dies are retried
    on the restarted worker (nothing reached their clients) or fail with a clean 502; it comes back,
    and the chat model's worker serves throughout."""
    victim = embed_worker(emb)
    chat_worker = next(w for w in emb.workers() if w["model"] == CHAT_MODEL)
    body = {"input": [f"sentence {i} " * 5 for i in range(256)]}
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(post, emb, body, 600) for _ in range(2)]
        wait_for(lambda: embed_worker(emb)["in_flight"] >= 2, 60, "the requests to reach the worker", interval=0.02)
        os.kill(victim["pid"], signal.SIGKILL)
        chat = pool.submit(emb.chat, "Say hi.", 120, max_tokens=4)
        results = [f.result() for f in futures]
        assert chat.result().status_code == 200, chat.result().text
    for r in results:
        assert r.status_code in (200, 502), r.text
        if r.status_code == 502:
            assert r.json()["error"]["code"] == "worker_lost"
    assert any(r.status_code == 200 for r in results)
    back = wait_for(
        lambda: (w := embed_worker(emb))["state"] == "ready" and w["pid"] != victim["pid"] and w, 120, "it is back"
    )
    assert back["restarts"] == 1 and "SIGKILL" in back["exit_reason"]
    assert post(emb, {"input": "after the restart"}).status_code == 200
    chat_now = next(w for w in emb.workers() if w["model"] == CHAT_MODEL)
    assert (chat_now["pid"], chat_now["restarts"], chat_now["state"]) == (
        chat_worker["pid"],
        chat_worker["restarts"],
        "ready",
    )
