"""The status page's worker events outlive a router process: kept in a file of the supervisor's
run directory, which the router that replaces a dead one starts from (numbering on), bounded,
and robust to a line cut short by a kill."""

from __future__ import annotations

from router.events import ROUTER, EventLog


def test_a_new_router_starts_from_the_events_the_dead_one_kept(tmp_path):
    path = tmp_path / "events.jsonl"
    first = EventLog(path=path)
    first.process_started(0, 101, 0)
    first.add(0, "died", "killed by SIGKILL")
    second = EventLog(path=path)  # the router that takes over
    second.router_restarted(202, 1)
    shown = second.recent()
    assert [(e["seq"], e["worker_id"], e["kind"]) for e in shown] == [
        (3, ROUTER, "router"),
        (2, 0, "died"),
        (1, 0, "started"),
    ]
    assert shown[1:] == first.recent()  # the same events, times included
    assert "restart 1" in shown[0]["detail"]


def test_the_file_stays_bounded_and_keeps_the_last_events(tmp_path):
    path = tmp_path / "events.jsonl"
    log = EventLog(size=4, path=path)
    for i in range(25):
        log.add(i, "started", f"pid {i}")
    assert len(path.read_text().splitlines()) <= 8
    assert [e["worker_id"] for e in EventLog(size=4, path=path).recent()] == [24, 23, 22, 21]


def test_a_line_cut_short_by_a_kill_is_skipped(tmp_path):
    path = tmp_path / "events.jsonl"
    EventLog(path=path).add(3, "ready", "loaded in 2.0s")
    with path.open("a") as f:
        f.write('{"seq": 2, "ts": 1.0, "worker_')
    log = EventLog(path=path)
    assert [e["kind"] for e in log.recent()] == ["ready"]
    assert log.add(1, "started").seq == 2


def test_without_a_file_the_log_is_in_memory_only(tmp_path):
    log = EventLog()
    log.add(0, "started", "pid 1")
    assert [e["kind"] for e in log.recent()] == ["started"] and not list(tmp_path.iterdir())


def test_the_supervisor_gives_every_router_the_same_file_in_its_run_directory(tmp_path):
    from pathlib import Path

    from launcher.config import parse_config
    from launcher.supervise.supervisor import Supervisor

    args = Supervisor(parse_config({}), [], Path("/model"), tmp_path, "ipc:///unused")._router_args()
    assert args[args.index("--event-log") + 1] == str(tmp_path / "events.jsonl")
