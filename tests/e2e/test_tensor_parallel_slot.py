"""A tensor-parallel deployment end to end: 2 replicas × 2 ranks on CPU (gloo), one tiny
random-initialised Llama (4 heads, 2 KV heads) with SmolLM2's tokenizer, so four processes start
quickly on two cores. A chat answers; ``kill -9`` of one replica's rank 1 takes that whole slot
down and the supervisor restarts it as one, while its requests in flight move to the other
replica and complete, and the other replica keeps serving throughout."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers.deployment import MODEL, Deployment, alive, wait_for
from tests.helpers.tiny_models import write_tiny_llama


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from launcher.models import resolve_model

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), resolve_model(MODEL, progress=False))


@pytest.fixture(scope="module")
def tp(tiny_model, tmp_path_factory):
    d = Deployment(
        tmp_path_factory.mktemp("tp"),
        {
            "model": {"name": str(tiny_model), "served_name": MODEL, "random_init": True, "max_model_len": 512},
            "workers": {"replicas": 2, "tensor_parallel_size": 2, "kv_cache_gib": 0.05, "startup_timeout_s": 120},
            "router": {"max_migrations": 3},
        },
    )
    try:
        d.start(timeout=120)
        yield d
    finally:
        d.stop()


def rank_pids(d: Deployment, worker_id: int) -> dict[int, int]:
    """``{rank: pid}`` of worker ``worker_id``'s processes, from the launcher's children's command lines."""
    ranks = {}
    for pid in d.child_pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except FileNotFoundError:
            continue
        if "worker.main" in argv and argv[argv.index("--worker-id") + 1] == str(worker_id) and "--rank" in argv:
            ranks[int(argv[argv.index("--rank") + 1])] = pid
    return ranks


def test_a_tp_slot_answers_and_shows_its_ranks(tp):
    r = tp.chat("Hello there", max_tokens=8, ignore_eos=True)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8
    devices = sorted(w["device"] for w in tp.workers())
    assert devices == ["cpu[0] (TP 2)", "cpu[1] (TP 2)"]  # one core per replica, its two ranks share it
    assert sorted(rank_pids(tp, 0)) == [0, 1] and rank_pids(tp, 0)[0] == tp.worker(0)["pid"]


def test_kill_9_of_a_rank_restarts_the_slot_and_its_requests_complete_elsewhere(tp):
    before0, before1 = tp.worker(0), tp.worker(1)
    ranks = rank_pids(tp, 0)
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(tp.chat, f"Story {i}", max_tokens=120, ignore_eos=True, timeout=120) for i in range(6)]
        wait_for(lambda: tp.worker(0)["running"] >= 1, 30, what="worker 0 to be decoding")
        os.kill(ranks[1], signal.SIGKILL)
        results = [f.result() for f in futures]
    assert [r.status_code for r in results] == [200] * 6, [r.text for r in results if r.status_code != 200]
    assert all(r.json()["usage"]["completion_tokens"] == 120 for r in results)  # retried or migrated, complete
    assert not alive(ranks[0])  # the surviving rank went down with its slot
    w0 = wait_for(
        lambda: (w := tp.worker(0))["state"] == "ready" and w["pid"] != before0["pid"] and w,
        60,
        what="worker 0 to come back as a whole slot",
    )
    assert w0["restarts"] == 1 and w0["device"] == before0["device"]
    # the supervisor saw rank 1's SIGKILL first, or rank 0 leaving when its peer was lost (exit 4)
    assert w0["exit_reason"] in ("rank 1 killed by SIGKILL", "rank 0 exit code 4"), w0["exit_reason"]
    assert set(rank_pids(tp, 0).values()).isdisjoint(ranks.values())  # both ranks are new processes
    w1 = tp.worker(1)
    assert (w1["pid"], w1["restarts"], w1["state"]) == (before1["pid"], 0, "ready")  # served throughout
    assert w1["served"] > before1["served"]
    r = tp.chat("Still there?", max_tokens=4, ignore_eos=True)
    assert r.status_code == 200, r.text


def test_restart_worker_with_drain_restarts_both_ranks_of_the_slot(tp):
    wait_for(lambda: all(w["state"] == "ready" for w in tp.workers()), 60, what="both slots ready")
    before, ranks = tp.worker(1), rank_pids(tp, 1)
    with ThreadPoolExecutor(2) as pool:
        busy = pool.submit(tp.chat, "One more story", max_tokens=60, ignore_eos=True, timeout=120)
        wait_for(lambda: tp.worker(1)["in_flight"] + tp.worker(0)["in_flight"] >= 1, 30, what="a request in flight")
        out = tp.admin("POST", "/admin/workers/1/restart?drain=1&timeout=60")
        assert out.status_code == 200 and out.json()["drained"], out.text
        assert busy.result().status_code == 200
    w1 = wait_for(
        lambda: (w := tp.worker(1))["state"] == "ready" and w["pid"] != before["pid"] and w, 60, what="slot 1 back"
    )
    assert w1["restarts"] == before["restarts"] + 1 and w1["exit_reason"] == "rank 0 exit code 0"  # asked, not crashed
    assert set(rank_pids(tp, 1).values()).isdisjoint(ranks.values()) and not any(alive(p) for p in ranks.values())
