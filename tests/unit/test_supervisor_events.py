"""The router's events to the supervisor: typed msgpack frames over a ZeroMQ PUSH → PULL channel
(real sockets, no processes), and what the supervisor does with them."""

from __future__ import annotations

import logging
import signal

from launcher.supervise.events import EventInbox
from router.admin_protocol import StartRequested, WorkerDown, WorkerReady, WorkerState
from router.supervisor_events import EventSender
from tests.helpers.supervisor_harness import Harness, started


def test_events_cross_the_channel_typed_and_a_frame_that_breaks_the_contract_is_dropped_loudly(tmp_path, caplog):
    inbox = EventInbox(tmp_path)
    sender = EventSender(inbox.address)
    try:
        sender.send(WorkerReady(worker_id=1, pid=42))
        sender._sock.send(b"\x81\xa4type\xa5Bogus")  # {"type": "Bogus"}: no such event, on the same pipe
        sender.send(WorkerDown(worker_id=0, pid=7, reason="no heartbeat for 10s"))
        sender.send(StartRequested(worker_id=2))
        caplog.set_level(logging.WARNING, logger="launcher.supervise.events")
        got = []
        while len(got) < 3:
            got += inbox.wait(30.0)  # returns as soon as frames are there
    finally:
        sender.close()
        inbox.close()
    assert got == [
        WorkerReady(worker_id=1, pid=42),
        WorkerDown(worker_id=0, pid=7, reason="no heartbeat for 10s"),
        StartRequested(worker_id=2),
    ]
    assert "dropped an event from the router that breaks the contract" in caplog.text


def test_a_start_requested_while_the_hung_process_is_being_killed_starts_it_once_reaped(tmp_path):
    sup = started(tmp_path)
    hung = sup.proc_of(0)
    sup.admin.pool.mark_lost(0, "no heartbeat for 10s")  # the router's watchdog: DEAD, and a WorkerDown event
    assert sup.admin.pool.request_start(0)  # an operator, at once
    sup.tick()
    assert hung.signals == [signal.SIGKILL]
    sup.tick()  # reaped: started again at once, not after the crash backoff
    assert sup.proc_of(0) is not hung and sup.slots[0].crashes == ()
    assert sup.row(0).state == WorkerState.STARTING and not sup.row(0).start_requested


def test_events_about_a_process_that_is_gone_are_ignored(tmp_path):
    sup = started(tmp_path)
    sup.tick()  # the router's WorkerReady events
    current = sup.proc_of(1)
    sup.on_event(WorkerDown(worker_id=1, pid=current.pid + 100, reason="stale"))
    sup.on_event(WorkerDown(worker_id=9, pid=1, reason="no such slot"))
    assert current.signals == [] and sup.slots[1].ready_pid == current.pid


def test_ready_comes_from_the_routers_event(tmp_path):
    sup = Harness(tmp_path)
    sup.start()
    assert not any(s.ready() for s in sup.slots.values())
    sup.ready(0)  # Hello, Ready: the router pushes WorkerReady
    sup.tick()
    assert sup.slots[0].ready() and sup.slots[0].ever_ready and not sup.slots[1].ready()
