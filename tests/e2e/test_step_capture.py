"""The captured decode step in the shared deployment (on by default): a ``json_schema`` request's
decode steps run captured (the grammar mask is applied to the logits after the forward pass) and
answer valid JSON; ``echo`` + ``logprobs`` scores the prompt in the eager prefill and answers; both
are counted in ``/metrics``."""

from __future__ import annotations

import json
import math

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.deployment import MODEL

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
    "required": ["city", "country"],
    "additionalProperties": False,
}


def steps(d) -> dict[str, float]:
    """Every worker's captured and eager decode steps, summed, from ``/metrics``."""
    r = httpx.get(f"{d.url}/metrics", timeout=10)
    assert r.status_code == 200
    out = {"captured": 0.0, "eager": 0.0}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            if s.name == "llamadeploy_captured_steps_total":
                out["captured"] += s.value
            elif s.name == "llamadeploy_eager_decode_steps_total":
                out["eager"] += s.value
    return out


def test_json_schema_answers_through_the_captured_step(deployment):
    before = steps(deployment)
    r = deployment.chat(
        "Which city is the capital of France? Answer as JSON.",
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}},
    )
    assert r.status_code == 200, r.text
    answer = json.loads(r.json()["choices"][0]["message"]["content"])
    assert set(answer) == {"city", "country"} and "Paris" in answer["city"]
    deployment.next_heartbeat(0)
    deployment.next_heartbeat(1)
    after = steps(deployment)
    assert after["captured"] > before["captured"]
    assert after["eager"] == before["eager"]  # one sequence: always within the buckets


def test_echo_with_logprobs_scores_the_prompt_and_generates(client):
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=4, temperature=0)
    c = r.choices[0]
    assert c.text.startswith(prompt) and "Paris" in c.text
    lp = c.logprobs
    assert lp.token_logprobs[0] is None and all(math.isfinite(v) for v in lp.token_logprobs[1:])
    assert len(lp.tokens) == r.usage.prompt_tokens + r.usage.completion_tokens
