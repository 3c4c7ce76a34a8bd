"""The embedding model and engine in process (no worker process): padding never changes a vector,
a decoder (the embedded Llama) is pooled at its last real token, and the engine answers in input
order across requests and messages, refusing what the router should have caught."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from launcher.models import resolve_model
from worker.contract.embed_spec import read_spec
from worker.contract.protocol import Embed, Embedded, Failed
from worker.embed import engine as engine_mod
from worker.embed.batcher import Batcher
from worker.embed.engine import EmbedEngine
from worker.embed.model import Embedder

TEXTS = ["Hello world", "The river flows past the old mill at dawn.", "a", "Three short words"]


def load(name: str, task_spec_len: int = 2048, packed: bool = True):
    path = resolve_model(name, quantization="none")
    spec = read_spec(path, task_spec_len)
    embedder = Embedder.load(path, spec, torch.device("cpu"), torch.float32, packed=packed)
    return embedder, AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def minilm():
    return load("all-minilm-l6-v2")


@pytest.fixture(scope="module")
def llama():
    return load("smollm2-135m-instruct")


@pytest.mark.parametrize("which", ["minilm", "llama"])
def test_a_vector_is_the_same_alone_and_padded_in_a_batch(which, request):
    embedder, tok = request.getfixturevalue(which)
    ids = [tok(t)["input_ids"] for t in TEXTS]
    batched = embedder.embed(ids)
    alone = np.concatenate([embedder.embed([x]) for x in ids])
    assert batched.dtype == np.float32 and batched.shape == (4, embedder.spec.dim)
    assert np.abs(batched - alone).max() < 1e-4


def test_the_packed_encoder_gives_transformers_vectors_and_its_kernel_table(minilm):
    embedder, tok = minilm
    reference, _ = load("all-minilm-l6-v2", packed=False)
    assert embedder.packed is not None and reference.packed is None
    ids = [tok(t)["input_ids"] for t in TEXTS]
    for batch in (ids, ids[:1], [ids[0], ids[0]], [ids[1][:300]] * 3):  # ragged, one, same lengths
        assert np.abs(embedder.embed(batch) - reference.embed(batch)).max() < 1e-5
    table = embedder.linears.report()  # fused q/k/v, out, up, down: each shape once for the six layers
    assert sorted((c.n, c.k, c.count) for c in table) == [(384, 384, 6), (384, 1536, 6), (1152, 384, 6), (1536, 384, 6)]
    assert all(p.kernel for c in table for p in c.picks)
    assert embedder.weight_bytes < reference.weight_bytes * 1.5  # a second form of a weight only where it pays


def test_a_decoder_is_pooled_at_its_last_token_and_normalised(llama):
    embedder, tok = llama
    assert embedder.spec.pooling == "lasttoken" and embedder.spec.normalize and not embedder.spec.encoder
    ids = tok("The river flows.")["input_ids"]
    with torch.inference_mode():
        hidden = embedder.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
    expected = torch.nn.functional.normalize(hidden, dim=0).numpy()
    assert np.abs(embedder.embed([ids])[0] - expected).max() < 1e-5


def run(engine: EmbedEngine, sent: list) -> None:
    while engine.has_work:
        sent += engine.step()


def test_the_engine_answers_each_request_in_input_order_across_messages(minilm, monkeypatch):
    embedder, tok = minilm
    sent = []
    engine = EmbedEngine(embedder, Batcher(64, 10))
    monkeypatch.setattr(engine_mod, "MESSAGE_BYTES", 3 * embedder.spec.dim * 4)  # three vectors per message
    ids = [tok(t)["input_ids"] for t in TEXTS * 2]
    sent += engine.submit(Embed(request_id="a", inputs=ids))
    sent += engine.submit(Embed(request_id="b", inputs=ids[:1]))
    run(engine, sent)
    a = [m for m in sent if m.request_id == "a"]
    assert [m.start for m in a] == [0, 3, 6] and [m.last for m in a] == [False, False, True]
    assert a[-1].prompt_tokens == sum(map(len, ids))
    vectors = np.array([np.frombuffer(v, "<f4") for m in a for v in m.vectors])
    assert np.abs(vectors - embedder.embed(ids)).max() < 1e-4
    assert [type(m) for m in sent if m.request_id == "b"] == [Embedded]


def test_the_engine_refuses_what_the_router_should_have_caught(minilm):
    embedder, _ = minilm
    sent = []
    engine = EmbedEngine(embedder, Batcher(4096, 1))
    sent += engine.submit(Embed(request_id="empty", inputs=[]))
    sent += engine.submit(Embed(request_id="oov", inputs=[[101, embedder.vocab_size]]))
    sent += engine.submit(Embed(request_id="long", inputs=[[101] * (embedder.spec.max_tokens + 1)]))
    sent += engine.submit(Embed(request_id="ok", inputs=[[101, 102]]))
    sent += engine.submit(Embed(request_id="full", inputs=[[101, 102]]))  # the queue holds one request
    engine.cancel("nothing")
    failed = {m.request_id: m for m in sent if isinstance(m, Failed)}
    assert {k: m.code for k, m in failed.items()} == {"empty": 400, "oov": 400, "long": 400, "full": 429}
    assert failed["full"].retry_after_s
    run(engine, sent)
    assert [m.request_id for m in sent if isinstance(m, Embedded)] == ["ok"]


def test_the_measured_thread_plan_runs_the_forward_and_sees_each_batch(minilm):
    from worker.embed.load import plan_threads
    from worker.embed.threads import ThreadPick, ThreadPlan

    embedder, tok = minilm
    before, plan = torch.get_num_threads(), embedder.threads
    ids = [tok(t)["input_ids"] for t in TEXTS]
    reference = embedder.embed(ids)
    try:
        plan_threads(embedder)  # measured here (what it picks depends on the machine's load)
        assert torch.get_num_threads() == plan.cores  # left at the worker's cores
        assert all(p.single_ms > 0 and p.parallel_ms > 0 for p in embedder.threads.picks)
        embedder.threads = ThreadPlan(2, [ThreadPick(64, 2, single_ms=1e3, parallel_ms=1.0)])
        vectors = embedder.embed(ids)  # 4 x 11 padded tokens: on 2 threads
        assert torch.get_num_threads() == 2
        assert np.abs(vectors - reference).max() < 1e-5  # the thread count never changes a vector
        assert embedder.threads.watches[64].average_s is not None  # the served batch was timed
    finally:
        embedder.threads = plan
        torch.set_num_threads(before)
