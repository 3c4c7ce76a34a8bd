"""Logprobs, penalties, logit_bias, min_tokens and n > 1 end to end: real model, real HTTP, the
``openai`` SDK as the client (its types check the shapes)."""

from __future__ import annotations

import math
import re

import msgspec

from tests.helpers.deployment import MODEL
from worker.contract.fingerprint import kernel_choices
from worker.contract.protocol import KernelChoice

Q = [{"role": "user", "content": "Name three colours."}]


def test_chat_logprobs_top1_is_the_emitted_token_at_temperature_0(client):
    for stream in (False, True):
        kw = {"model": MODEL, "messages": Q, "temperature": 0, "max_tokens": 20, "logprobs": True, "top_logprobs": 3}
        if stream:
            entries, text = [], ""
            for ch in client.chat.completions.create(stream=True, **kw):
                if ch.choices and ch.choices[0].logprobs is not None:
                    entries += ch.choices[0].logprobs.content
                if ch.choices:
                    text += ch.choices[0].delta.content or ""
        else:
            r = client.chat.completions.create(**kw)
            entries, text = r.choices[0].logprobs.content, r.choices[0].message.content
        assert entries
        for e in entries:
            assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token
            assert e.top_logprobs[0].logprob == e.logprob and math.isfinite(e.logprob) and e.logprob <= 0
            assert bytes(e.bytes).decode("utf-8", errors="replace") == e.token
        assert b"".join(bytes(e.bytes) for e in entries).decode("utf-8", errors="replace").startswith(text[:10])


def test_completion_logprobs_shape(client):
    r = client.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=8, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and all(len(t) <= 2 for t in lp.top_logprobs)
    assert all(max(t.values()) == v for t, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True))


def test_frequency_penalty_lowers_repeats(client):
    msgs = [{"role": "user", "content": "Say 'la' 30 times."}]

    def count(penalty: float) -> int:
        r = client.chat.completions.create(
            model=MODEL, messages=msgs, temperature=0, max_tokens=60, frequency_penalty=penalty
        )
        return r.choices[0].message.content.lower().count("la")

    plain, penalised = count(0.0), count(2.0)
    assert penalised < plain, (plain, penalised)


def test_logit_bias_minus_100_removes_a_token(client, tokenizer):
    kw = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0,
        "max_tokens": 30,
        "logprobs": True,
    }
    r = client.chat.completions.create(**kw)
    first = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(r.choices[0].logprobs.content[0].token))[0]
    banned = client.chat.completions.create(logit_bias={str(first): -100}, **kw)
    tokens = [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(e.token)) for e in banned.choices[0].logprobs.content]
    assert all(first not in t for t in tokens)


def test_min_tokens_and_repetition_penalty_are_honoured(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say yes."}],
        temperature=0,
        max_tokens=40,
        extra_body={"min_tokens": 25, "repetition_penalty": 1.2},
    )
    assert r.usage.completion_tokens >= 25


def test_n_choices_plain_streamed_and_seeded(client):
    kw = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Invent a name for a cat."}],
        "temperature": 1.0,
        "max_tokens": 12,
        "n": 3,
        "seed": 5,
    }
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len({c.message.content for c in a.choices}) > 1
    assert all(c.finish_reason in ("stop", "length") for c in a.choices)
    one = client.chat.completions.create(**{**kw, "n": 1})
    assert one.choices[0].message.content == a.choices[0].message.content
    assert a.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    assert a.usage.completion_tokens > one.usage.completion_tokens
    texts, finishes = {0: "", 1: "", 2: ""}, {}
    for ch in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
        if not ch.choices:
            assert ch.usage.completion_tokens == a.usage.completion_tokens
    assert [texts[i] for i in range(3)] == [c.message.content for c in a.choices]
    assert set(finishes) == {0, 1, 2}


def test_top_p_zero_keeps_only_the_most_likely_token(client):
    """OpenAI's range is 0 <= top_p <= 1: 0 is accepted and, at any temperature, is the greedy answer."""
    kw = {"model": MODEL, "messages": Q, "max_tokens": 12}
    greedy = client.chat.completions.create(temperature=0, **kw).choices[0].message.content
    for seed in (1, 2):
        hot = client.chat.completions.create(temperature=1.5, top_p=0, seed=seed, **kw)
        assert hot.choices[0].message.content == greedy
    text = client.completions.create(model=MODEL, prompt="Colours:", max_tokens=6, temperature=1.2, top_p=0.0)
    assert (
        text.choices[0].text
        == client.completions.create(model=MODEL, prompt="Colours:", max_tokens=6, temperature=0).choices[0].text
    )


def test_system_fingerprint_is_the_serving_revisions_in_every_answer(deployment, client):
    """A string (OpenAI's type) in every chat completion, chunk and completion: the value
    ``GET /workers`` shows for the worker that served it. The two replicas of the one revision
    share it exactly when their kernel tables chose the same kernels (the only input that may
    differ between them: each measures its own at start)."""
    workers = deployment.workers()
    fingerprints = {w["system_fingerprint"] for w in workers}
    assert len(workers) == 2 and all(re.fullmatch(r"fp_[0-9a-f]{12}", f) for f in fingerprints)
    tables = [kernel_choices([msgspec.convert(c, KernelChoice) for c in w["kernels"]]) for w in workers]
    assert (len(fingerprints) == 1) == (tables[0] == tables[1]), tables
    seen = set()
    for _ in range(2):
        seen.add(client.chat.completions.create(model=MODEL, messages=Q, max_tokens=2).system_fingerprint)
        chunks = client.chat.completions.create(
            model=MODEL, messages=Q, max_tokens=2, stream=True, stream_options={"include_usage": True}
        )
        seen |= {c.system_fingerprint for c in chunks}
        seen.add(client.completions.create(model=MODEL, prompt="Colours:", max_tokens=2).system_fingerprint)
        streamed = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, stream=True)
        seen |= {c.system_fingerprint for c in streamed}
    assert seen and seen <= fingerprints
