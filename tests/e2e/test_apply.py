"""``llamadeploy apply`` end to end: one deployment of 2 CPU replicas changed again and again.

The tests run in order on one deployment (small settings: 2 sequences per batch, 8-token answers,
a small KV budget), each leaving it serving: a dry run, live router changes (no process restarts),
a rolling change of ``max_num_seqs`` and of the dtype together under a steady load of 8 streaming
clients (0 failures, 0 5xx, every stream complete; a second apply meanwhile gets 409), a model that does
not exist (refused, nothing changed) and one whose worker crashes (rolled back, no request lost),
scale 2 → 1 → 2 under load, and ``--rollback``. The load's throughput during a rollout against
the steady rate is printed, never asserted (a benchmark figure).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from tests.helpers.deployment import MODEL, Deployment, cli, deep_merge, free_port, wait_for
from tests.helpers.refusals import ADMIT_REFUSALS, case_id
from tests.helpers.steady_load import SteadyLoad

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    dep = Deployment(
        tmp_path_factory.mktemp("apply"),
        {
            "model": {"max_model_len": 512},
            "workers": {"max_num_seqs": 2, "kv_cache_gib": 0.05},
            "limits": {"max_tokens": 16},
            "supervisor": {"drain_timeout_s": 60},
        },
    )
    dep.start()
    yield dep
    dep.stop()


def pids(d: Deployment) -> dict[int, int]:
    return {w["id"]: w["pid"] for w in d.workers()}


def revisions(d: Deployment) -> set[int]:
    return {w["revision"] for w in d.workers()}


def load(d: Deployment) -> SteadyLoad:
    return SteadyLoad(d.base_url, MODEL, clients=8, max_tokens=8, headers=d.auth_headers())


def rolled_under_load(d: Deployment, extra: dict, during=None) -> subprocess.CompletedProcess:
    """Apply ``extra`` while 8 clients stream; assert no request failed; print the throughput."""
    with load(d) as clients:
        clients.wait_completed(16)
        t0 = time.monotonic()
        steady = clients.counts.rate(t0 - 10, t0)
        proc = d.apply(extra, wait=False)
        if during is not None:
            during()
        out, _ = proc.communicate(timeout=600)
        t1 = time.monotonic()
        clients.wait_completed(8)
        counts = clients.stop()
    print(f"\n{out}\nthroughput during the rollout: {counts.rate(t0, t1) / max(steady, 1e-9):.0%} of steady")
    assert proc.returncode == 0, out
    if extra:
        d.config = deep_merge(d.config, extra)
    assert counts.failed == 0, counts.failures
    assert counts.server_errors == 0 and set(counts.statuses) == {200}, counts.statuses
    return subprocess.CompletedProcess([], 0, out)


def test_dry_run_prints_the_plan_and_changes_nothing(d):
    before, revs = pids(d), revisions(d)
    done = d.apply({"workers": {"max_num_seqs": 3}, "router": {"policy": "round_robin"}}, "--dry-run")
    assert done.returncode == 0, done.stdout
    assert "live (no restart): router.policy" in done.stdout
    assert "replace worker 0" in done.stdout and "dry run: nothing changed" in done.stdout
    assert pids(d) == before and revisions(d) == revs
    assert d.admin("GET", "/admin/workers").json()["policy"] == "least_loaded"


def test_live_changes_restart_no_process(d):
    before, router_pid = pids(d), d.admin("GET", "/admin/workers").json()["router"]["pid"]
    done = d.apply({"router": {"policy": "round_robin", "api_keys": ["key-one"]}})
    assert done.returncode == 0, done.stdout
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert d.chat("hi", max_tokens=2).status_code == 200  # the helper sends key-one now
    assert httpx.post(f"{d.base_url}/chat/completions", json=ask, timeout=60).status_code == 401
    done = d.apply({"router": {"api_keys": ["key-two"]}})
    assert done.returncode == 0, done.stdout
    old = httpx.post(
        f"{d.base_url}/chat/completions", json=ask, timeout=60, headers={"Authorization": "Bearer key-one"}
    )
    assert old.status_code == 401
    assert d.chat("hi", max_tokens=2).status_code == 200
    table = d.admin("GET", "/admin/workers").json()
    assert table["policy"] == "round_robin" and table["router"]["pid"] == router_pid
    assert pids(d) == before


def test_rolling_change_under_load_drops_nothing_and_a_second_apply_gets_409(d):
    """One rollout replaces both workers for two changes at once (``max_num_seqs`` and the dtype:
    each alone needs new processes); a second apply while it runs gets 409."""
    before, rev = pids(d), max(revisions(d))
    seen: list[str] = []

    def second_apply():
        wait_for(lambda: d.admin("GET", "/admin/rollout").json()["state"] == "running", 60, "the rollout runs")
        other = d.apply({"workers": {"max_num_seqs": 2}}, "--dry-run")
        seen.append(f"{other.returncode} {other.stdout}")

    done = rolled_under_load(d, {"workers": {"max_num_seqs": 3}, "model": {"dtype": "bfloat16"}}, during=second_apply)
    assert "replace worker 0" in done.stdout and "replace worker 1" in done.stdout, done.stdout
    assert "applied: revision" in done.stdout
    assert seen and seen[0].startswith("1 ") and "409" in seen[0] and "in progress" in seen[0], seen
    workers = d.workers()
    assert all(w["max_num_seqs"] == 3 and w["state"] == "ready" for w in workers), workers
    assert not set(pids(d).values()) & set(before.values())  # every process replaced (a surge's new slot has a new id)
    assert revisions(d) == {rev + 1}


def test_a_model_that_does_not_exist_is_refused_and_changes_nothing(d):
    before, revs = pids(d), revisions(d)
    done = d.apply({"model": {"name": str(d.tmp / "no-such-model")}})
    assert done.returncode == 2
    errors = [line for line in done.stdout.splitlines() if line.startswith("refused:")]
    assert len(errors) == 1 and "no-such-model" in errors[0], done.stdout
    assert "rolled back" not in done.stdout and "plan:" not in done.stdout
    assert pids(d) == before and revisions(d) == revs


def fix(lines: list[str]) -> str:
    """The fix a refusal names (its text after ``fix:``), else its first line."""
    said = " ".join(line.strip() for line in lines)
    return said.split("fix: ", 1)[1] if "fix: " in said else lines[0]


MACHINE_FREE = [(sections, says) for sections, says, anywhere in ADMIT_REFUSALS if anywhere]


@pytest.mark.parametrize("sections, says", MACHINE_FREE, ids=[case_id(c) for c in MACHINE_FREE])
def test_a_file_up_refuses_is_refused_by_apply_with_ups_message_and_changes_nothing(d, sections, says):
    """``up`` of the new file (on other ports: this deployment holds its own) and ``apply`` of it to
    the running deployment give the same first line; no process or revision changes."""
    before, revs = pids(d), revisions(d)
    new = deep_merge(d.config, sections)
    elsewhere = d.tmp / f"up-{case_id((sections,))}.yaml"
    elsewhere.write_text(yaml.safe_dump(deep_merge(new, {"router": {"port": free_port(), "admin_port": free_port()}})))
    up = cli("up", str(elsewhere), timeout=180)
    assert up.returncode == 2, up.stdout + up.stderr
    up_says = [line for line in up.stderr.split("error: ", 1)[-1].splitlines() if "--force" not in line]
    done = d.apply(sections)
    assert done.returncode == 2, done.stdout
    refused = [line.removeprefix("refused: ") for line in done.stdout.splitlines() if line.startswith("refused: ")]
    assert refused and refused[0] == up_says[0], (refused, up_says)
    # the figures may differ (up sees this deployment's RAM in use, apply counts it free); the fix is the same
    assert says in " ".join(refused) and says in " ".join(up_says), (refused, up_says)
    assert [fix(refused)] == [fix(up_says)], (refused, up_says)
    assert "(nothing changed)" in done.stdout and "plan:" not in done.stdout and "rolled back" not in done.stdout
    assert pids(d) == before and revisions(d) == revs


def test_a_crashing_replacement_is_rolled_back_without_losing_a_request(d):
    from launcher.models import resolve_model

    real = resolve_model(MODEL, quantization="none")
    broken = d.tmp / "weightless-model"  # its config and tokenizer, no weights: the worker's load fails
    broken.mkdir()
    for f in real.iterdir():
        if not f.name.endswith((".safetensors", ".bin", ".gguf")):
            (broken / f.name).symlink_to(f)
    revs = revisions(d)
    with load(d) as clients:
        clients.wait_completed(8)
        done = d.apply({"model": {"name": str(broken)}})
        clients.wait_completed(8)
        counts = clients.stop()
    assert done.returncode == 1, done.stdout
    errors = [line for line in done.stdout.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "rolled back" in errors[0], done.stdout
    assert counts.failed == 0 and counts.server_errors == 0, (counts.failures, counts.statuses)
    d.wait_ready()
    assert revisions(d) == revs


def test_scale_down_and_up_under_load(d):
    with load(d) as clients:
        clients.wait_completed(8)
        down = d.apply({"workers": {"replicas": 1}})
        assert down.returncode == 0, down.stdout
        assert [w["id"] for w in d.workers()] == [0]
        up = d.apply({"workers": {"replicas": 2}})
        assert up.returncode == 0, up.stdout
        clients.wait_completed(8)
        counts = clients.stop()
    assert counts.failed == 0 and counts.server_errors == 0, (counts.failures, counts.statuses)
    workers = d.workers()
    assert len(workers) == 2 and all(w["state"] == "ready" for w in workers), workers


def test_rollback_returns_to_the_previous_revision(d):
    rev = max(revisions(d))
    done = d.apply({}, "--rollback")
    assert done.returncode == 0, done.stdout
    workers = d.workers()
    assert [w["id"] for w in workers] == [0] and workers[0]["revision"] == rev - 1, workers
    status = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "status", str(d.path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "400"},
    )
    assert status.returncode == 0 and f"revision {rev - 1}: done" in status.stdout, status.stdout
