"""End to end: KV budget under load, backpressure (429), and memory stability of a worker.

Two one-worker deployments: ``tight`` has a KV budget of 8 blocks of 16 tokens, which admits only
two short requests at once (and a context length to match, or ``up`` refuses to start); ``busy``
has room for 8 running + 8 waiting requests (the session's ``curve_busy``, shared with
test_zmq_curve). Timing claims belong to ``llamadeploy bench``; these tests assert behaviour only.
"""

from __future__ import annotations

import itertools
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers.deployment import MODEL, Deployment, wait_for

SHORT = "Say hi."  # 33 prompt tokens once templated


@pytest.fixture(scope="module")
def tight(tmp_path_factory):
    d = Deployment(
        tmp_path_factory.mktemp("tight"),
        {
            "model": {"max_model_len": 128},
            # the last of the requests through a few rows, preempted and recomputed, waits long on a
            # loaded box: the router and the queue wait as long as the test's clients (no test here
            # is about those limits)
            "workers": {
                "replicas": 1,
                "kv_cache_gib": 0.006,
                "max_num_seqs": 4,
                "max_waiting": 8,
                "max_queue_wait_s": 300,
            },
            "router": {"request_timeout_s": 300},
        },
    )
    d.start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def busy(curve_busy):
    """The session's small-queue deployment (``curve_busy`` in fixtures.py; test_zmq_curve uses it too)."""
    return curve_busy


def wait_idle(d: Deployment, timeout: float = 120) -> dict:
    """Until the router and the worker report nothing in flight; returns the worker's info."""
    return wait_for(
        lambda: (w := d.worker(0))["in_flight"] == 0 and w["running"] == 0 and w["waiting"] == 0 and w,
        timeout,
        interval=0.2,
        what="worker 0 idle",
    )


# Each request outgrows its admission by two blocks: a 38-token prompt holds 3 blocks of 16 when
# admitted, its 40 tokens take it into a 5th. Admission keeps one spare block per running sequence,
# so two running side by side run out of blocks while decoding and the newer is preempted
# (recomputed later), even when the second started several steps after the first.
GROWING_TOKENS = 40
CONCURRENT = 6  # more than max_num_seqs (4): the cache, not the batch limit, must hold them back


def test_concurrent_requests_under_a_tiny_kv_budget_go_through_preemption(tight):
    """Test 3: all complete under a KV cache that holds only two of them at once: the cache, not
    ``max_num_seqs``, is what binds (admission by need, preemption when it runs out)."""
    blocks = tight.worker(0)["kv_budget_tokens"] // 16
    with ThreadPoolExecutor(CONCURRENT) as pool:  # distinct prompts: only the template's head is shared
        results = list(
            pool.map(
                lambda i: tight.chat(
                    f"Say hi to guest number {i}.", max_tokens=GROWING_TOKENS, ignore_eos=True, timeout=300
                ),
                range(CONCURRENT),
            )
        )
    assert [r.status_code for r in results] == [200] * CONCURRENT, {r.status_code: r.text for r in results}
    assert all(r.json()["usage"]["completion_tokens"] == GROWING_TOKENS for r in results)
    prompts = [r.json()["usage"]["prompt_tokens"] for r in results]
    assert -(-(max(prompts) + GROWING_TOKENS) // 16) * 3 > blocks  # three such requests alone would not fit
    assert all(-(-p // 16) < -(-(p + GROWING_TOKENS) // 16) - 1 for p in prompts)  # each grows by 2+ blocks
    wait_idle(tight)
    w = tight.next_heartbeat(0)  # reported after the last request
    assert 2 <= w["peak_running"] < tight.config["workers"]["max_num_seqs"], w
    assert w["preemptions"] >= 1, w  # the cache ran out while decoding: the newest was preempted
    assert w["kv_used_tokens"] == 0 and w["served"] >= CONCURRENT


def test_full_queue_answers_429_with_retry_after_then_recovers(busy):
    """Test 4: with every slot and queue place taken, the next request gets 429 + Retry-After."""
    wait_idle(busy)
    capacity = busy.worker(0)["max_num_seqs"] + busy.worker(0)["max_waiting"]
    codes: list[int] = []

    def long_request():
        codes.append(busy.chat("Tell me a long story.", max_tokens=60, ignore_eos=True, timeout=300).status_code)

    threads = [threading.Thread(target=long_request) for _ in range(capacity)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: busy.worker(0)["in_flight"] >= capacity, 30, interval=0.05, what="every slot taken")
        r = busy.chat(SHORT, max_tokens=4)
        assert r.status_code == 429, r.text
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error"
    finally:
        for t in threads:
            t.join()
    assert codes == [200] * capacity
    wait_idle(busy)
    assert busy.chat(SHORT, max_tokens=4).status_code == 200


def mixed_request(d: Deployment, i: int) -> str:
    """One request of a rotating mix; returns its kind. Never raises on an HTTP error status."""
    rng = random.Random(i)
    kind = ["plain", "stream", "cancel", "too_long", "invalid", "seeded", "stream", "plain"][i % 8]
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Count from 1 to {rng.randint(5, 30)}."}],
        "max_tokens": rng.randint(2, 16),
        "temperature": 0,
    }
    url = f"{d.base_url}/chat/completions"
    if kind == "plain":
        httpx.post(url, json=body, timeout=120)
    elif kind == "seeded":
        httpx.post(url, json={**body, "temperature": 0.8, "seed": i, "top_p": 0.9}, timeout=120)
    elif kind == "too_long":
        r = httpx.post(url, json={**body, "max_tokens": 2040}, timeout=120)
        assert r.status_code == 400, r.text
    elif kind == "invalid":
        assert httpx.post(url, json={**body, "temperature": 7}, timeout=120).status_code == 400
    else:
        with httpx.stream(
            "POST",
            url,
            json={**body, "stream": True, "max_tokens": 40 if kind == "cancel" else 16, "ignore_eos": kind == "cancel"},
            timeout=120,
        ) as r:
            for n, _ in enumerate(r.iter_lines()):
                if kind == "cancel" and n >= 4:
                    break  # the client goes away mid-stream: the worker must cancel and free the row
    return kind


def memory_after_settling(d: Deployment) -> int:
    wait_idle(d)
    return d.next_heartbeat(0)["mem_bytes"]  # read after the last request


def test_memory_stable_over_200_mixed_requests(busy):
    """Test 6: after a warm-up, 200 mixed requests leave the worker's RSS within 5%."""
    counter = itertools.count()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: mixed_request(busy, next(counter)), range(48)))  # warm-up
    before = memory_after_settling(busy)
    served_before = busy.worker(0)["served"]
    with ThreadPoolExecutor(8) as pool:
        kinds = list(pool.map(lambda _: mixed_request(busy, next(counter)), range(200)))
    after = memory_after_settling(busy)
    w = busy.worker(0)
    print(
        f"\nworker RSS after warm-up {before / 2**20:.1f} MiB, after 200 mixed requests {after / 2**20:.1f} MiB "
        f"({(after - before) / before:+.2%}); peak running {w['peak_running']}, kinds "
        f"{ {k: kinds.count(k) for k in set(kinds)} }"
    )
    assert abs(after - before) <= 0.05 * before, (before, after)
    assert w["served"] - served_before >= 100 and w["kv_used_tokens"] == 0
    assert w["peak_running"] >= 4  # the mix really was batched
    assert "memory" in busy.log() and "bytes" in busy.log()  # per-request memory at debug level


def test_bench_load_suite_writes_table_json_and_plot(busy, tmp_path):
    """`llamadeploy bench --suite load` end to end against our router (a tiny run: the numbers are not checked)."""
    import json
    import subprocess
    import sys

    out = tmp_path / "bench"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher.cli",
            "bench",
            busy.base_url,
            "--suite",
            "load",
            "--scenario",
            "chat",
            "--output-tokens",
            "4",
            "--concurrency",
            "1,2",
            "--requests",
            "2",
            "--warmup",
            "1",
            "--output",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.with_suffix(".json").read_text())
    levels = result["scenarios"][0]["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 2]
    assert all(lv["failures"] == 0 and lv["output_tokens_per_s"] > 0 and lv["ttft_p50_s"] > 0 for lv in levels)
    assert all(lv["mean_output_tokens"] == 4 and lv["peak_worker_mem_bytes"] > 0 for lv in levels)
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert "out tok/s" in proc.stdout and "TTFT p50" in proc.stdout


def test_bench_engine_suite_measures_every_figure(busy, tmp_path):
    """`llamadeploy bench` (the engine suite) end to end, tiny counts: every figure is measured, every
    request answered with the asked length, the document's prompt is the asked length, both
    streams ran through its prefill, and the worker's kernel table is printed beside the figures."""
    import json
    import subprocess
    import sys

    out = tmp_path / "engine"
    args = [
        "--prompts",
        "2",
        "--clients",
        "2",
        "--requests",
        "2",
        "--warmup",
        "1",
        "--doc-tokens",
        "200",
        "--streams",
        "2",
        "--output-tokens",
        "4",
        "--doc-output-tokens",
        "2",
        "--output",
        str(out),
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "bench", busy.base_url, *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["suite"] == "engine"
    assert all(v is not None for v in result["figures"].values()), result["figures"]
    d = result["details"]
    assert all(d[k]["failures"] == 0 and d[k]["mean_output_tokens"] == 4 for k in ("c1", "closed_loop", "burst"))
    assert d["doc"]["mean_prompt_tokens"] == 200 and d["stall"]["doc_prompt_tokens"] == 200
    assert d["stall"]["spanning"] == 2
    assert "doc again / doc TTFT" in proc.stdout and "stall: longest / median gap" in proc.stdout
    # the serving worker's kernel table (GET /workers), recorded and printed beside the figures
    assert result["kernels"] and all(c["picks"] and c["count"] >= 1 for c in result["kernels"])
    first = result["kernels"][0]
    assert "kernel table of the serving worker" in proc.stdout
    assert (
        f"{first['n']}×{first['k']} {first['weight']} ×{first['count']}: ≤{first['picks'][0]['rows']} " in proc.stdout
    )
