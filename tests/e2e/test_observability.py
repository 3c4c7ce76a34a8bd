"""`GET /metrics` covers the router and every worker of the shared deployment."""

from __future__ import annotations

from itertools import pairwise

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.deployment import MODEL, wait_for

ROUTER_METRICS = {
    "llamadeploy_http_requests_total",
    "llamadeploy_e2e_request_latency_seconds",
    "llamadeploy_num_requests_running",
    "llamadeploy_num_requests_waiting",
    "llamadeploy_time_to_first_token_seconds",
    "llamadeploy_inter_token_latency_seconds",
    "llamadeploy_prompt_tokens_total",
    "llamadeploy_generation_tokens_total",
    "llamadeploy_request_success_total",
    "process_resident_memory_bytes",
}
WORKER_METRICS = {
    "llamadeploy_worker_state",
    "llamadeploy_worker_num_requests_running",
    "llamadeploy_worker_num_requests_waiting",
    "llamadeploy_worker_requests_in_flight",
    "llamadeploy_kv_cache_usage_ratio",
    "llamadeploy_kv_cache_budget_tokens",
    "llamadeploy_worker_memory_used_bytes",
    "llamadeploy_model_load_time_seconds",
    "llamadeploy_worker_restarts_total",
}


def scrape(d) -> dict[str, list]:
    r = httpx.get(f"{d.url}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/plain")
    assert r.headers["X-Request-ID"]
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def total(samples: dict[str, list], name: str, **labels) -> float:
    return sum(s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items()))


def test_metrics_cover_router_and_every_worker(deployment):
    before = scrape(deployment)
    assert deployment.chat("What is the capital of France?", max_tokens=6).status_code == 200
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count to five."}],
        "max_tokens": 6,
        "stream": True,
    }
    with httpx.stream("POST", f"{deployment.base_url}/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.read().rstrip().endswith(b"[DONE]")
    after = scrape(deployment)
    names = set(after) | {n.removesuffix("_count") for n in after}
    assert ROUTER_METRICS <= names, ROUTER_METRICS - names
    assert WORKER_METRICS <= names, WORKER_METRICS - names

    chat = {"endpoint": "/v1/chat/completions"}
    assert (
        total(after, "llamadeploy_http_requests_total", status="200", **chat)
        >= total(before, "llamadeploy_http_requests_total", status="200", **chat) + 2
    )
    assert total(after, "llamadeploy_e2e_request_latency_seconds_count", **chat) >= 2
    assert (
        total(after, "llamadeploy_time_to_first_token_seconds_count")
        >= total(before, "llamadeploy_time_to_first_token_seconds_count") + 2
    )
    assert total(after, "llamadeploy_inter_token_latency_seconds_count") > total(
        before, "llamadeploy_inter_token_latency_seconds_count"
    )
    assert (
        total(after, "llamadeploy_generation_tokens_total") >= total(before, "llamadeploy_generation_tokens_total") + 2
    )
    assert total(after, "llamadeploy_prompt_tokens_total") > total(before, "llamadeploy_prompt_tokens_total")
    assert total(after, "llamadeploy_num_requests_running") == total(after, "llamadeploy_num_requests_waiting") == 0

    for wid in ("0", "1"):
        assert total(after, "llamadeploy_worker_state", worker_id=wid, state="ready") == 1
        assert total(after, "llamadeploy_worker_memory_used_bytes", worker_id=wid) > 100 * 2**20  # RSS on CPU
        assert total(after, "llamadeploy_model_load_time_seconds", worker_id=wid) > 0
        assert total(after, "llamadeploy_kv_cache_budget_tokens", worker_id=wid) > 0
        assert 0 <= total(after, "llamadeploy_kv_cache_usage_ratio", worker_id=wid) <= 1
        assert total(after, "llamadeploy_worker_restarts_total", worker_id=wid) == next(
            w["restarts"] for w in deployment.workers() if w["id"] == int(wid)
        )


def test_unmatched_paths_share_one_label(deployment):
    for i in range(3):
        httpx.get(f"{deployment.url}/no/such/path/{i}", timeout=10)
    samples = scrape(deployment)
    endpoints = {s.labels["endpoint"] for s in samples["llamadeploy_http_requests_total"]}
    assert "unmatched" in endpoints and not any(e.startswith("/no/") for e in endpoints)


def test_repeated_document_goes_back_to_its_worker_and_is_a_prefix_cache_hit(deployment):
    """The second time the same document is sent, least_loaded (cache-aware among idle workers)
    sends it to the worker that prefilled it, which finds its prompt's blocks cached; ``/metrics``
    counts the hit tokens (heartbeat, so wait for the next one)."""
    document = " ".join(f"Clause {i}: the supplier delivers lot {i * 3} by week {i % 52}." for i in range(30))
    ask = f"Summarise in five words.\n\n{document}"

    def hits() -> float:
        return total(scrape(deployment), "llamadeploy_prefix_cache_hit_tokens_total")

    def served() -> dict[int, int]:
        return {w["id"]: w["served"] for w in deployment.workers()}

    before, counts = hits(), [served()]
    for _ in range(3):
        assert deployment.chat(ask, max_tokens=3).status_code == 200
        counts.append(served())
    took = [next(wid for wid in now if now[wid] > then[wid]) for then, now in pairwise(counts)]
    assert len(set(took)) == 1, f"the document went to workers {took}"
    wait_for(lambda: hits() >= before + 2 * 200, timeout=10, what="prefix-cache hits in /metrics")
    queried = total(scrape(deployment), "llamadeploy_prefix_cache_queried_tokens_total")
    assert queried >= hits()
