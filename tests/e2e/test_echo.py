"""``echo`` with ``logprobs`` on completions, and ``bench --perplexity``, end to end: real model, real
HTTP, the shared deployment; the ``openai`` SDK and lm-evaluation-harness's request body as clients."""

from __future__ import annotations

import math
import re

import httpx
import pytest
from openai import BadRequestError

from tests.helpers.deployment import MODEL, cli

PROMPT = "The capital of France is Paris. The capital of Italy is"


def test_sdk_parses_echo_of_the_prompt_alone(client, tokenizer):
    r = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
    c, lp = r.choices[0], r.choices[0].logprobs
    n = len(tokenizer(PROMPT)["input_ids"])
    assert c.text == PROMPT and c.finish_reason == "length"
    assert r.usage.prompt_tokens == n and r.usage.completion_tokens == 0
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(math.isfinite(v) and v <= 0 for v in lp.token_logprobs[1:])
    assert all(
        len(t) == 1 and max(t.values()) >= v for t, v in zip(lp.top_logprobs[1:], lp.token_logprobs[1:], strict=True)
    )
    assert "".join(lp.tokens) == PROMPT
    assert lp.text_offset[0] == 0 and all(a < b for a, b in zip(lp.text_offset, lp.text_offset[1:], strict=False))
    # " Rome" is likely after this prompt, " Paris" scored in context: the scores mean something
    paris = lp.tokens.index(" Paris")
    assert lp.token_logprobs[paris] > math.log(0.05)


def test_echoed_logprobs_equal_the_greedy_generation_ones(client):
    gen = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=10, logprobs=0)
    out = gen.choices[0]
    echo = client.completions.create(
        model=MODEL, prompt=PROMPT + out.text, echo=True, logprobs=0, max_tokens=0, temperature=0
    )
    lp = echo.choices[0].logprobs
    k = len(out.logprobs.tokens)
    assert echo.choices[0].text == PROMPT + out.text
    assert lp.tokens[-k:] == out.logprobs.tokens  # the continuation tokenizes as it was generated
    assert lp.token_logprobs[-k:] == pytest.approx(out.logprobs.token_logprobs, abs=1e-3)


def test_echo_with_a_completion_token_ids_and_stream(client, tokenizer):
    ids = tokenizer(PROMPT)["input_ids"]
    r = client.completions.create(
        model=MODEL, prompt=ids, echo=True, logprobs=2, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    c = r.choices[0]
    assert c.text.startswith(tokenizer.decode(ids)) and len(c.text) > len(PROMPT)
    assert len(c.logprobs.tokens) == len(ids) + 4 == r.usage.total_tokens
    assert c.logprobs.token_logprobs[0] is None and all(len(t) == 2 for t in c.logprobs.top_logprobs[1:])
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=4, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.text
    entries = [v for ch in chunks if ch.choices and ch.choices[0].logprobs for v in ch.choices[0].logprobs.tokens]
    assert entries == c.logprobs.tokens


def test_a_long_prompt_over_several_prefill_chunks_is_scored_whole(client, deployment):
    text = " ".join(f"Paragraph {i} notes that the river rose {i} metres in week {i * 3}." for i in range(60))
    r = client.completions.create(model=MODEL, prompt=text, echo=True, logprobs=0, max_tokens=0)
    lp = r.choices[0].logprobs
    assert r.usage.prompt_tokens > 1000  # the CPU workers prefill at most a few hundred tokens per step
    assert len(lp.token_logprobs) == r.usage.prompt_tokens and lp.token_logprobs[0] is None
    assert all(math.isfinite(v) for v in lp.token_logprobs[1:])
    again = client.completions.create(model=MODEL, prompt=text, echo=True, logprobs=0, max_tokens=0)
    assert again.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs, abs=1e-4)


def test_lm_evaluation_harness_loglikelihood_body(deployment, tokenizer):
    """local-completions' loglikelihood request (lm_eval/models/openai_completions.py), batch of 2."""
    ctx = tokenizer("Question: What is the capital of France?\nAnswer:")["input_ids"]
    conts = [tokenizer(" Paris")["input_ids"], tokenizer(" Berlin")["input_ids"]]
    body = {
        "model": MODEL,
        "prompt": [ctx + c for c in conts],
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    r = httpx.post(deployment.base_url + "/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1]
    scores = []
    for choice, cont in zip(choices, conts, strict=True):
        lps = choice["logprobs"]
        assert len(lps["token_logprobs"]) == len(ctx) + len(cont) + 1  # the one generated token last
        scores.append(sum(lps["token_logprobs"][len(ctx) : -1]))  # what lm-eval sums
    assert scores[0] > scores[1]  # Paris is the likelier answer


def test_bad_combinations_are_400s_and_the_workers_keep_serving(client, deployment):
    for kw, param in (
        ({"echo": True, "logprobs": 6, "max_tokens": 0}, "logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"echo": "yes", "max_tokens": 1}, "echo"),
    ):
        with pytest.raises(BadRequestError) as err:
            client.completions.create(model=MODEL, prompt=PROMPT, extra_body=kw)
        assert err.value.status_code == 400 and err.value.body["param"] == param
        assert set(err.value.body) == {"message", "type", "param", "code"}
    chat = deployment.chat("Say hi.", max_tokens=3, echo=True)  # not a chat field: ignored, as before
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant"
    ok = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")
    assert all(w["state"] == "ready" and w["restarts"] == 0 for w in deployment.workers())


def test_bench_perplexity_prints_a_finite_figure(deployment, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(
        " ".join(f"On day {i} the committee met and agreed to fund {i * 3} new projects." for i in range(30))
    )
    out = cli(
        *("bench", deployment.base_url, "--perplexity", str(text), "--ctx", "64", "--output", str(tmp_path / "ppl")),
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    m = re.search(r"PPL = ([0-9.]+) \+/- ([0-9.]+) \((\d+) tokens scored in (\d+) windows of 64", out.stdout)
    assert m, out.stdout
    ppl, err, scored, wins = float(m[1]), float(m[2]), int(m[3]), int(m[4])
    assert 1 < ppl < 1000 and 0 < err < ppl and wins >= 2 and scored == wins * 31
    assert (tmp_path / "ppl.json").exists()
