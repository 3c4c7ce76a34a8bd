"""The hold suite's bookkeeping: what counts as 5xx, a cut stream or another failure per event,
the target's verdict, the table; ``--suite hold`` needs ``--config``."""

from __future__ import annotations

import pytest
import typer

from launcher.bench.command import bench_options
from launcher.bench.hold_suite import SLACK_S, Event, _row, print_hold
from launcher.bench.hold_traffic import Call
from launcher.bench.hold_watch import Replacement, ReplacementWatch
from router.admin_protocol import WorkerInfo, WorkerState


def event(longest_hold_s: float = 3.0, start: float = 10.0, end: float = 20.0) -> Event:
    # down 10 s: 1 s to the new process, 2.5 s to its Hello, 6.5 s of load
    replaced = Replacement(stopped=10.0, spawned=11.0, hello=13.5, ready=20.0, load_s=6.4)
    return Event("kill -9", start, end, 5.0, longest_hold_s, replaced, "pid 1 killed")


CALLS = [
    Call(True, 11.0, 11.5, 12.0, 200),
    Call(True, 9.0, 9.5, 12.0, 200, cut=True, error="the stream ended without data: [DONE]"),  # began before
    Call(False, 19.0, 19.5, 21.0, 503, error="no_ready_worker"),
    Call(False, 12.0, None, 13.0, None, error="ConnectError: refused"),
    Call(True, 21.0, 21.5, 22.0, 502, error="after the event"),  # began after its end, ended in the next one
    Call(True, 1.0, 1.5, 9.9, 502, error="before the event"),
]


def test_an_event_counts_every_request_that_ended_in_it_5xx_cut_streams_and_other_failures_apart():
    row = _row(event(), CALLS, [], until=21.5)  # the request that ended at 22.0 is the next event's
    assert (row["requests"], row["server_errors"], row["streams_cut"], row["other_failures"]) == (4, 1, 1, 1)
    assert row["held"] == 5.0 and row["longest_hold_s"] == 3.0 and row["down_s"] == 10.0
    assert (row["restart_delay_s"], row["start_s"], row["load_s"], row["load_seconds"]) == (1.0, 2.5, 6.5, 6.4)
    assert row["within_target"] and "no_ready_worker" in row["errors"]


@pytest.mark.parametrize("longest, within", [(10.0 + SLACK_S, True), (10.0 + SLACK_S + 0.1, False)])
def test_the_target_is_every_hold_within_the_time_down_plus_the_slack(longest, within):
    assert _row(event(longest), [], [])["within_target"] is within


def test_the_table_has_one_row_per_event_and_says_no_when_the_target_is_missed(capsys):
    print_hold({"events": [_row(event(30.0), CALLS, [], until=21.5)]})
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:2] == ["event", "requests"]
    assert out[1].split()[:7] == ["kill", "-9", "4", "1", "1", "1", "5"] and out[1].split()[-3:-1] == ["NO", "yes"]
    assert any("error: no_ready_worker" in line for line in out)


def test_a_retried_requests_wait_is_its_first_byte_beyond_the_steady_median():
    steady = [Call(True, 0.0, 2.0, 3.0, 200) for _ in range(3)]
    retried = Call(True, 10.0, 10.0 + 2.0 + 10.0 + SLACK_S + 0.5, 30.0, 200)
    row = _row(event(0.0), [retried], steady)
    assert row["steady_first_byte_s"] == 2.0 and row["longest_first_byte_s"] == 14.5
    assert row["within_target"] and not row["client_within_target"]  # no queue wait, a retry's wait


def test_a_surges_clients_wait_is_held_against_the_replacements_load_on_the_serving_cores():
    surge = Replacement(stopped=None, spawned=None, hello=None, ready=None, load_s=30.0)
    steady = [Call(True, 0.0, 2.0, 3.0, 200) for _ in range(3)]
    slowed = Call(True, 10.0, 10.0 + 2.0 + 30.0 + SLACK_S - 0.5, 50.0, 200)
    row = _row(Event("apply", 5.0, 60.0, 0.0, 0.0, surge, "applied"), [slowed], steady)
    assert row["down_s"] == 0.0 and row["client_bound_s"] == 30.0 and row["client_within_target"]
    late = Call(True, 10.0, 10.0 + 2.0 + 30.0 + SLACK_S + 0.5, 50.0, 200)
    assert not _row(Event("apply", 5.0, 60.0, 0.0, 0.0, surge, "applied"), [late], steady)["client_within_target"]


def row(pid: int, state: str, uptime_s: float = 0.0, load_seconds: float = 0.0) -> WorkerInfo:
    return WorkerInfo(id=0, state=WorkerState(state), pid=pid, uptime_s=uptime_s, load_seconds=load_seconds)


def test_the_watch_times_a_kill_from_the_kill_to_the_replacement_ready():
    watch = ReplacementWatch(admin=None, old_pid=7)
    watch.mark_stopped(100.0)  # the bench's kill: the table still shows it ready
    watch.observe(100.2, [row(7, "ready", 50.0)])
    watch.observe(100.4, [row(7, "dead")])
    watch.observe(100.6, [row(8, "starting")])  # the supervisor's start report
    watch.observe(103.0, [row(8, "starting")])
    watch.observe(110.0, [row(8, "ready", uptime_s=7.0, load_seconds=6.8)])
    done = watch.wait(1.0)
    assert done.down_s == 10.0 and done.parts() == {"restart_delay_s": 0.6, "start_s": 2.4, "load_s": 7.0}
    assert done.load_s == 6.8


def test_a_surge_is_never_down():
    watch = ReplacementWatch(admin=None, old_pid=7)
    watch.observe(1.0, [row(7, "ready"), row(8, "starting")])
    watch.observe(9.0, [row(7, "ready"), row(8, "ready", uptime_s=7.0)])
    watch.observe(9.2, [row(7, "draining"), row(8, "ready", uptime_s=7.2)])
    watch.observe(12.0, [row(8, "ready", uptime_s=10.0)])
    done = watch.wait(1.0)
    assert done.down_s == 0.0 and set(done.parts().values()) == {None}


def test_the_hold_suite_needs_the_deployments_file():
    given = {"suite": "hold", "scenario": ["chat"], "extra_body": "{}", "response_format": None, "compare": []}
    with pytest.raises(typer.BadParameter, match="--config"):
        bench_options({**given, "concurrency": "1", "config": None})
    assert bench_options({**given, "concurrency": "1", "config": "d.yaml"}).config == "d.yaml"


def answered(status: int, body: bytes):
    """One request of the hold suite's traffic against a server answering ``status`` and ``body``."""
    import httpx

    from launcher.bench.hold_traffic import Traffic

    traffic = Traffic("http://127.0.0.1:9/v1", "m", None)
    http = httpx.Client(transport=httpx.MockTransport(lambda _req: httpx.Response(status, content=body)))
    call = Call(True, 0.0)
    traffic._stream(http, {}, call)
    return call


CHUNK = b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'


@pytest.mark.parametrize(
    "status, body, cut, failed, server_error",
    [
        (200, CHUNK + b"data: [DONE]\n\n", False, False, False),
        (200, CHUNK, True, True, False),  # the connection ended before [DONE]
        (200, CHUNK + b'data: {"error": {"message": "worker lost"}}\n\ndata: [DONE]\n\n', True, True, False),
        (503, b'{"error": {"message": "no worker"}}', False, True, True),
    ],
)
def test_a_stream_is_complete_cut_or_answered_5xx(status, body, cut, failed, server_error):
    call = answered(status, body)
    assert (call.cut, call.failed, call.server_error) == (cut, failed, server_error), call


def test_an_event_settles_only_once_the_arrivals_sent_before_it_ended():
    from launcher.bench.hold_traffic import Traffic

    traffic = Traffic("http://127.0.0.1:9/v1", "m", None, streams=0)
    traffic._open.update({1: 5.0, 2: 12.0})  # sent at 5 s and 12 s, not answered yet
    assert traffic.arrivals_in_flight(10.0) == 1 and traffic.arrivals_in_flight(4.0) == 0
