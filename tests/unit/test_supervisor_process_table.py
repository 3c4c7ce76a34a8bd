"""The supervisor against a fake process table and a real router worker table, without processes.

``FakeProcs`` stands in for ``subprocess.Popen`` (the test decides when a process exits), a fake
clock for time, and the admin API goes to a real :class:`~router.workers.WorkerPool` through the
typed contract's JSON encoding (``router.admin_protocol``), so both sides' states must agree; the
router's events reach the supervisor as the msgpack frames of its event channel.
"""

from __future__ import annotations

import logging
import signal

import msgspec
import pytest

from launcher.supervise.slots import MAX_BACKOFF_S
from router import admin_protocol
from router.admin_protocol import Exited, Started, WorkerState, WorkerTable
from tests.helpers.supervisor_harness import Harness, PoolAdmin, started


def test_start_reports_every_process_to_the_router(tmp_path):
    sup = started(tmp_path)
    assert [(r.id, r.pid, r.state) for r in (sup.row(0), sup.row(1))] == [
        (0, sup.proc_of(0).pid, WorkerState.READY),
        (1, sup.proc_of(1).pid, WorkerState.READY),
    ]


def test_a_crash_is_reported_at_once_and_restarted_after_the_backoff(tmp_path):
    sup = started(tmp_path)
    first = sup.proc_of(0)
    first.exit(-signal.SIGKILL)
    sup.tick()
    assert (sup.row(0).state, sup.row(0).exit_reason) == (WorkerState.DEAD, "killed by SIGKILL")
    sup.tick(0.5)
    assert sup.slots[0].proc is None  # still in its 1 s backoff
    sup.tick(0.6)
    second = sup.proc_of(0)
    assert second is not first
    assert (sup.row(0).state, sup.row(0).pid, sup.row(0).restarts) == (WorkerState.STARTING, second.pid, 1)


def test_a_worker_crashing_past_max_restarts_is_failed_on_both_sides(tmp_path):
    sup = started(tmp_path)
    for _ in range(3):
        sup.crash(1, 1)
    assert sup.slots[1].failed and sup.slots[1].proc is None
    assert sup.row(1).state == WorkerState.FAILED
    sup.tick(60.0)
    assert sup.slots[1].proc is None


def test_a_worker_the_router_declared_dead_but_alive_is_killed_and_restarted(tmp_path):
    sup = started(tmp_path)
    hung = sup.proc_of(0)
    sup.admin.pool.mark_lost(0, "no heartbeat for 10s")  # the router's watchdog
    sup.tick()
    assert hung.signals == [signal.SIGKILL]
    sup.tick()
    assert "hung: no heartbeat for 10s" in sup.row(0).exit_reason
    sup.tick(1.1)
    assert sup.proc_of(0) is not hung and sup.row(0).state == WorkerState.STARTING


def test_an_operator_start_request_starts_a_failed_worker_with_history_cleared(tmp_path):
    sup = started(tmp_path)
    for _ in range(3):
        sup.crash(1, 3)
    assert sup.row(1).state == WorkerState.FAILED
    assert sup.admin.pool.request_start(1)
    sup.tick()
    assert sup.slots[1].proc is not None and not sup.slots[1].failed and sup.slots[1].crashes == ()
    assert sup.row(1).state == WorkerState.STARTING and not sup.row(1).start_requested


def test_an_unreadable_table_is_a_warning_once_per_outage(tmp_path, caplog):
    sup = started(tmp_path)
    caplog.set_level(logging.INFO, logger="launcher.supervise.supervisor")
    sup.admin.down = True
    sup.read_table()  # (supervision waits on events; the table is read while shutting down)
    sup.read_table()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "cannot read the router's worker table" in warnings[0].getMessage()
    sup.admin.down = False
    sup.read_table()
    assert "readable again" in caplog.text


def test_a_table_that_breaks_the_contract_is_refused_loudly(tmp_path, caplog):
    sup = started(tmp_path)
    row = msgspec.to_builtins(sup.admin.pool.table())
    row["workers"][0]["state"] = "Ready"  # a renamed state must not silently stop supervision
    sup.admin.table = lambda timeout=2.0: admin_protocol.decode(msgspec.json.encode(row), WorkerTable)
    caplog.set_level(logging.WARNING, logger="launcher.supervise.supervisor")
    assert sup.read_table() is None
    assert "cannot read the router's worker table" in caplog.text and "Ready" in caplog.text


def test_a_failed_report_is_a_warning(tmp_path, caplog):
    sup = started(tmp_path)
    caplog.set_level(logging.WARNING, logger="launcher.supervise.supervisor")
    sup.admin.down = True
    sup.proc_of(0).exit(1)
    sup.tick()
    assert "could not report worker 0 exited to the router" in caplog.text


@pytest.mark.parametrize(
    "msg", [Started(pid=1, restarts=2, device="cpu[0]"), Exited(reason="exit code 1", failed=True)]
)
def test_reports_refuse_unknown_keys(msg):
    body = msgspec.to_builtins(msg) | {"surprise": 1}
    with pytest.raises(msgspec.ValidationError):
        admin_protocol.decode(msgspec.json.encode(body), type(msg))


def test_a_worker_still_loading_at_the_startup_timeout_is_restarted_while_the_others_serve(tmp_path):
    sup = Harness(tmp_path)
    sup.start()
    sup.ready(0)
    slow = sup.proc_of(1)  # says nothing: still loading
    sup.wait_ready(timeout=60.0, pause_s=1.0)  # returns: worker 0 serves
    sup.tick(1.0)
    assert slow.signals == [signal.SIGKILL]
    sup.tick(1.1)
    assert "not ready after 60s" in sup.row(1).exit_reason
    assert sup.proc_of(1) is not slow and sup.row(1).state == WorkerState.STARTING
    assert sup.row(0).state == WorkerState.READY


def test_no_worker_ready_by_the_startup_timeout_fails_the_deployment(tmp_path):
    sup = Harness(tmp_path)
    sup.start()
    with pytest.raises(RuntimeError, match="not ready within 60s"):
        sup.wait_ready(timeout=60.0, pause_s=1.0)


def test_a_dead_router_is_restarted_and_told_about_the_running_workers_which_are_not_restarted(tmp_path):
    sup = started(tmp_path, config={"supervisor": {"router_standby": False}})
    sup.tick(100.0)  # long after start: a re-registering worker is not "slow to load"
    workers = {wid: sup.proc_of(wid) for wid in sup.slots}
    old = sup.router
    old.exit(-signal.SIGKILL)
    sup.admin = PoolAdmin()  # what the new router process will serve: an empty table
    sup.admin.down = True
    sup.tick()
    assert sup.router is None
    sup.tick(1.1)  # the backoff passed: a new router process, on the same addresses
    assert sup.router is not old and sup.router.args[-2:] == ["--restarts", "1"]
    sup.tick()  # not answering yet: nothing reported
    assert sup.admin.pool.workers == {}
    sup.admin.down = False
    sup.tick()
    assert [(r.id, r.pid, r.state) for r in map(sup.row, workers)] == [
        (wid, p.pid, WorkerState.STARTING) for wid, p in workers.items()
    ]
    sup.tick(1.0)
    assert all(p.signals == [] for p in workers.values())  # kept, not killed as slow loaders
    for wid in workers:
        sup.ready(wid)  # Identify -> Hello, Ready
    sup.tick(1.0)
    assert all(sup.row(wid).state == WorkerState.READY and sup.proc_of(wid) is p for wid, p in workers.items())


def test_a_router_crashing_past_max_restarts_stops_the_deployment(tmp_path):
    sup = started(tmp_path)
    for _ in range(2):
        sup.router.exit(1)
        sup.tick()
        sup.tick(31.0)
    sup.router.exit(1)
    with pytest.raises(RuntimeError, match="giving up"):
        sup.tick()


def test_a_standby_router_is_kept_once_serving_and_takes_over_when_the_router_dies(tmp_path):
    sup = started(tmp_path)
    sup.tick()
    assert sup.standby is None  # not while the workers load
    sup.standby_enabled = True  # what run() does once serving
    sup.tick()
    assert sup.standby is None  # not before a quiet second: its load would stall the workers' steps
    sup.tick(1.0)
    standby = sup.standby
    assert standby.args[-1] == "--standby" and standby.stdin.written == ""
    sup.router.exit(-signal.SIGKILL)
    sup.tick()
    sup.tick(1.1)
    assert sup.router is standby and standby.stdin.written == "go 1\n" and standby.stdin.closed
    sup.tick()  # it answers: told about the workers
    sup.tick(1.0)  # and after a quiet second a new standby loads
    assert sup.row(0).pid == sup.proc_of(0).pid and sup.standby not in (None, standby)


def test_a_standby_router_waits_for_a_second_without_requests_or_loads_under_load_at_last(tmp_path):
    sup = started(tmp_path)
    sup.standby_enabled = True
    pool = sup.admin.pool
    first = pool.ledger.register(pool.workers[0], "r1")  # a request in flight on worker 0
    for _ in range(5):
        sup.tick(1.0)
    assert sup.standby is None
    pool.ledger.finish(first, ok=True)
    sup.tick(0.5)  # the first poll that sees no request in flight
    sup.tick(0.9)
    assert sup.standby is None  # quiet for 0.9 s
    sup.tick(0.1)
    assert sup.standby is not None
    sup.standby.exit(1)  # it dies: the next one is due after the backoff, under load this time
    pool.ledger.register(pool.workers[1], "r2")
    sup.tick()
    sup.tick(MAX_BACKOFF_S)  # the backoff passed: due from now
    sup.tick(599.0)
    assert sup.standby is None
    sup.tick(1.0)
    assert sup.standby is not None and sup.standby.poll() is None  # the wait ran out: it loads anyway
