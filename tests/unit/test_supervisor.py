"""The supervisor's pure decisions: crash window, backoff, failed; exit descriptions; the fault hook;
the settings file each child is given."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from launcher.config import parse_config
from launcher.supervise.supervisor import MAX_BACKOFF_S, Supervisor, describe_exit, judge_crash
from router.settings import RouterSettings
from worker.contract.settings import WorkerSettings
from worker.main import fault_crash_at_start


def crash_loop(n: int, gap: float, window: float = 300.0, max_restarts: int = 5, backoff: float = 1.0):
    """Feed ``n`` crashes ``gap`` seconds apart; return every verdict."""
    crashes: tuple[float, ...] = ()
    verdicts = []
    for i in range(n):
        v = judge_crash(crashes, now=1000.0 + i * gap, window_s=window, max_restarts=max_restarts, backoff_s=backoff)
        crashes = v.recent
        verdicts.append(v)
    return verdicts


def test_backoff_doubles_then_fails_after_max_restarts():
    verdicts = crash_loop(4, gap=1.0, max_restarts=3, backoff=0.5)
    assert [v.failed for v in verdicts] == [False, False, False, True]
    assert [v.delay_s for v in verdicts[:3]] == [0.5, 1.0, 2.0]
    assert verdicts[-1].delay_s == 0.0


def test_always_crashing_worker_runs_max_restarts_plus_one_times():
    verdicts = crash_loop(10, gap=0.1, max_restarts=2)
    first_failed = next(i for i, v in enumerate(verdicts) if v.failed)
    assert first_failed == 2  # crashes 1 and 2 are restarted, crash 3 gives up


def test_old_crashes_leave_the_window():
    verdicts = crash_loop(20, gap=100.0, window=150.0, max_restarts=2, backoff=1.0)
    assert not any(v.failed for v in verdicts)  # never more than 2 crashes within 150 s
    assert all(len(v.recent) <= 2 for v in verdicts)
    assert verdicts[-1].delay_s == 2.0  # the second crash in the window


def test_backoff_is_capped():
    verdicts = crash_loop(12, gap=0.0, max_restarts=100, backoff=1.0)
    assert verdicts[-1].delay_s == MAX_BACKOFF_S


def test_zero_max_restarts_fails_at_once():
    (v,) = crash_loop(1, gap=0.0, max_restarts=0)
    assert v.failed


def test_zero_backoff_restarts_at_once():
    assert [v.delay_s for v in crash_loop(3, gap=1.0, backoff=0.0)] == [0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    "code,text",
    [
        (-signal.SIGKILL, "killed by SIGKILL"),
        (-signal.SIGSEGV, "killed by SIGSEGV"),
        (1, "exit code 1"),
        (0, "exit code 0"),
        (-200, "killed by signal 200"),
    ],
)
def test_describe_exit(code, text):
    assert describe_exit(code) == text


@pytest.mark.parametrize(
    "value,worker,expected",
    [
        ("", 0, False),
        ("1", 1, True),
        ("1", 0, False),
        ("0, 2", 2, True),
        ("all", 7, True),
        ("10", 1, False),
    ],
)
def test_fault_crash_at_start(value, worker, expected):
    assert fault_crash_at_start(worker, {"LLAMADEPLOY_FAULT_CRASH_AT_START": value}) is expected
    assert fault_crash_at_start(worker, {}) is False


def test_each_child_is_told_only_its_roles_settings(tmp_path):
    cfg = parse_config({"router": {"api_keys": ["sk-secret"], "admin_token": "admin-secret"}})
    sup = Supervisor(cfg, [], Path("/model"), tmp_path, "ipc:///unused")
    worker = json.loads(sup.worker_settings_path.read_text())
    assert set(worker) == {"model", "workers", "logging"}  # no router section: no API key, no admin token
    assert "sk-secret" not in sup.worker_settings_path.read_text()
    assert "admin-secret" not in sup.worker_settings_path.read_text()
    assert WorkerSettings.model_validate(worker) == cfg.worker_settings()
    router = RouterSettings.model_validate_json(sup.router_settings_path.read_text())
    assert (
        router.router.api_keys == ["sk-secret"] and router.supervisor.drain_timeout_s == cfg.supervisor.drain_timeout_s
    )
