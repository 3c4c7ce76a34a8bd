"""``llamadeploy bench --suite hold --config deploy.yaml``: the hold targets on a one-replica deployment.

Against the running deployment ``--config`` describes (its router, admin API and admin token), and
under :class:`~launcher.bench.hold_traffic.Traffic` (``--streams`` streaming clients, a steady
request loop and open-loop arrivals) the whole time, its only worker is replaced three ways, one after another:

1. ``llamadeploy apply`` of the file with ``workers.max_num_seqs`` one higher (a rolling apply);
2. ``llamadeploy restart-worker ID`` of the only worker (as typed, no ``--drain``);
3. ``kill -9`` of the worker's process (the supervisor restarts it).

Each event lasts from its start until the replacement is ready and every client has finished one
more request; its figures count every request that ended from its start until the next event's. Per event it prints the requests answered 5xx, the streams cut, the
other failures, the requests held (``llamadeploy_request_hold_seconds``' count), the longest hold
wait (the router's ``held_oldest_s``, sampled every :data:`SAMPLE_S`), the replacement's time and
whether every wait was within it + :data:`SLACK_S`. The replacement's time is the model's time
without a ready replica, from the moment the old one stopped answering to the moment the
replacement is ready (:mod:`launcher.bench.hold_watch`: the restart delay, the new process's start
and imports and its load, each shown; its ``load_seconds`` counts the load only). A benchmark of
one run: it prints and writes ``OUTPUT.json``, asserts nothing. The deployment is left on the new
``max_num_seqs``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import typer
import yaml

from launcher.bench.client import auth_headers, served_model
from launcher.bench.hold_traffic import Traffic
from launcher.bench.hold_watch import SAMPLE_S, Replacement, ReplacementWatch

SLACK_S = 2.0  # the target: every hold ≤ the replacement's load time + this
EVENTS = ("apply max_num_seqs", "restart-worker", "kill -9")


def run_hold_bench(config: Path, streams: int, api_key: str | None, output: Path, timeout: float) -> dict:
    """Run the three events against the deployment of ``config``; print the table, write
    ``OUTPUT.json`` and return the result. ``typer.BadParameter`` (exit 2) unless the deployment
    answers with exactly one worker."""
    from launcher.console import load_or_exit
    from launcher.supervise.admin_client import AdminClient

    cfg = load_or_exit(config)
    root = f"http://{_host(cfg.router.host)}:{cfg.router.port}"
    api_key = api_key or (cfg.router.api_keys[0] if cfg.router.api_keys else None)
    api_key = getattr(api_key, "key", api_key)  # a key with settings of its own
    admin = AdminClient(cfg.router.admin_url, cfg.router.admin_token)
    workers = admin.table().workers
    if len(workers) != 1:
        raise typer.BadParameter(f"--suite hold runs against a one-replica deployment; this one has {len(workers)}")
    probe = Probe(root, api_key)
    model = served_model(root + "/v1", api_key)
    events: list[Event] = []
    with Traffic(root + "/v1", model, api_key, streams=streams, timeout=timeout) as traffic, probe:
        _settle(traffic, streams, time.monotonic(), timeout)
        for n, name in enumerate(EVENTS, start=1):
            probe.phase, held0 = n, probe.hold_count()
            before = admin.table().workers[0]
            typer.echo(f"event {n}: {name} ...", err=True)
            t0 = time.monotonic()
            with ReplacementWatch(admin, before.pid) as watch:
                detail = ACTIONS[name](config, before, watch)
                replaced = watch.wait(timeout)
            _settle(traffic, streams, time.monotonic(), timeout)
            held = probe.hold_count() - held0
            events.append(Event(name, t0, time.monotonic(), held, probe.longest.get(n, 0.0), replaced, detail))
        probe.phase = len(EVENTS) + 1
    # the clients have stopped: every request, also one in flight across an event, is recorded
    steady = [c for c in traffic.calls if events and c.end < events[0].start and not c.failed]
    ends = [e.start for e in events[1:]] + [float("inf")]
    rows = [_row(e, traffic.calls, steady, until) for e, until in zip(events, ends, strict=True)]
    result = {"suite": "hold", "started": time.strftime("%Y-%m-%d %H:%M:%S"), "streams": streams, "events": rows}
    output.parent.mkdir(parents=True, exist_ok=True)
    output.with_suffix(".json").write_text(json.dumps(result, indent=2))
    print_hold(result)
    typer.echo(f"wrote {output.with_suffix('.json')}")
    return result


def _host(host: str) -> str:
    from router.settings import connect_host

    return connect_host(host)


class Probe:
    """Samples the router's ``GET /activity`` (``held_oldest_s``) every :data:`SAMPLE_S` while
    running: the longest hold seen per phase; reads the hold histogram's count from ``/metrics``."""

    def __init__(self, root: str, api_key: str | None):
        self.root, self.headers = root, auth_headers(api_key)
        self.phase, self.longest = 0, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Probe:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        with httpx.Client(timeout=5, headers=self.headers) as http:
            while not self._stop.wait(SAMPLE_S):
                try:
                    oldest = http.get(self.root + "/activity").json().get("held_oldest_s") or {}
                except (httpx.HTTPError, ValueError):
                    continue  # the router is busy or restarting: the next sample
                now = max(oldest.values(), default=0.0)
                self.longest[self.phase] = max(self.longest.get(self.phase, 0.0), now)

    def hold_count(self) -> float:
        """Requests the router has held and then dispatched, all models (the histogram's count)."""
        text = httpx.get(self.root + "/metrics", headers=self.headers, timeout=10).text
        found = re.findall(r'request_hold_seconds_count\{[^}]*outcome="dispatched"\} (\S+)', text)
        return sum(float(v) for v in found)


def _apply(config: Path, before, _watch) -> str:
    data = yaml.safe_load(config.read_text()) or {}
    workers = data.setdefault("workers", {})
    workers["max_num_seqs"] = before.max_num_seqs + 1
    new = config.with_name(f".{config.stem}-hold-bench.yaml")
    new.write_text(yaml.safe_dump(data))
    done = _cli("apply", str(new))
    return f"max_num_seqs {before.max_num_seqs} -> {before.max_num_seqs + 1}: " + _last_line(done)


def _restart(config: Path, before, _watch) -> str:
    return f"worker {before.id}: " + _last_line(_cli("restart-worker", str(before.id), "--config", str(config)))


def _kill(_config: Path, before, watch: ReplacementWatch) -> str:
    watch.mark_stopped(time.monotonic())  # it answers nothing from here on; the table shows it later
    os.kill(before.pid, signal.SIGKILL)
    return f"pid {before.pid} killed"


ACTIONS = {"apply max_num_seqs": _apply, "restart-worker": _restart, "kill -9": _kill}


def _cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "launcher.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)


def _last_line(done: subprocess.CompletedProcess) -> str:
    lines = (done.stdout + done.stderr).strip().splitlines()
    return f"exit {done.returncode}" + (f", {lines[-1].strip()}" if lines else "")


def _settle(traffic: Traffic, streams: int, since: float, timeout: float) -> None:
    """Wait until the clients completed one request each after ``since`` (the load is back) and no
    arrival sent before ``since`` is still in flight: the next event then meets no request that this
    one already made retry (``router.max_retries`` counts a request's losses, whichever event)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (
        traffic.completed_since(since) < streams + 1 or traffic.arrivals_in_flight(since)
    ):
        time.sleep(0.2)


@dataclass(frozen=True)
class Event:
    """One replacement: its name, from its start to its end (the replacement ready and every
    client answered again; monotonic seconds), the requests the router held and dispatched meanwhile,
    the longest hold it showed, the replacement's times and what the command said."""

    name: str
    start: float
    end: float
    held: float
    longest_hold_s: float
    replaced: Replacement
    detail: str


def first_byte_s(calls) -> list[float]:
    """Each answered request's seconds from sending to its first byte, in order."""
    return [c.first - c.start for c in calls if c.first is not None]


def _row(event: Event, calls: list, steady_calls: list, until: float = float("inf")) -> dict:
    """``event``'s figures over the requests of ``calls`` that ended from its start until ``until``
    (the next event's start: a request fails when it ends, whenever it began), against the median
    time to first byte of ``steady_calls`` (before the first event)."""
    calls = [c for c in calls if event.start <= c.end < until]
    steady = sorted(first_byte_s(steady_calls)) or [0.0]
    median, waits = steady[len(steady) // 2], first_byte_s(calls) or [0.0]
    down = event.replaced.down_s
    # a surge is never down, but its replacement loads on the serving cores: the clients' wait is held
    # against that load, the issue's own bound ("the replacement's load time + 2 s")
    bound = down or event.replaced.load_s
    return {
        "event": event.name,
        "detail": event.detail,
        "requests": len(calls),
        "server_errors": sum(c.server_error for c in calls),
        "streams_cut": sum(c.cut for c in calls if c.stream),
        "other_failures": sum(c.failed and not c.server_error and not c.cut for c in calls),
        "errors": sorted({c.error for c in calls if c.failed})[:3],
        "held": event.held,
        "longest_hold_s": round(event.longest_hold_s, 2),
        "down_s": round(down, 2),  # the model without a ready replica: what a held request may wait
        **event.replaced.parts(),
        "load_seconds": round(event.replaced.load_s, 2),  # the worker's own figure: its load only
        "within_target": event.longest_hold_s <= down + SLACK_S,
        # a request in flight when the worker died is retried, not queued: its wait shows in the client's
        # time to first byte only (beyond the steady median: prefill and queueing behind the others)
        "longest_first_byte_s": round(max(waits), 2),
        "steady_first_byte_s": round(median, 2),
        "client_bound_s": round(bound, 2),
        "client_within_target": max(waits) - median <= bound + SLACK_S,
        "wall_s": round(event.end - event.start, 1),
    }


def print_hold(result: dict) -> None:
    """The table: one row per event, then each event's errors (if any) and what the command said."""
    head = f"{'event':<18} {'requests':>8} {'5xx':>4} {'cut':>4} {'other':>5} {'held':>5} {'longest hold s':>14} "
    head += f"{'first byte s':>12} {'down s':>7} {'delay s':>7} {'start s':>7} {'load s':>7} "
    head += f"{'hold <= down+2s':>15} {'wait <= bound+2s':>16} {'wall s':>7}"
    typer.echo(head)
    for r in result["events"]:
        typer.echo(
            f"{r['event']:<18} {r['requests']:>8} {r['server_errors']:>4} {r['streams_cut']:>4} "
            f"{r['other_failures']:>5} {r['held']:>5.0f} {r['longest_hold_s']:>14.1f} "
            f"{r['longest_first_byte_s']:>12.1f} {r['down_s']:>7.1f} {_part(r['restart_delay_s'])} "
            f"{_part(r['start_s'])} {_part(r['load_s'])} {'yes' if r['within_target'] else 'NO':>15} "
            f"{'yes' if r['client_within_target'] else 'NO':>16} {r['wall_s']:>7.1f}"
        )
    steady = result["events"][0]["steady_first_byte_s"] if result["events"] else 0.0
    typer.echo(
        "longest hold: the router's queue (held_oldest_s); first byte: the clients' longest time to first byte, "
        f"which includes a retried request's wait; wait: first byte less the steady median ({steady:.1f}s); "
        "down: the model without a ready replica (the old one stopped answering -> the replacement ready) = "
        "delay (to the new process) + start (its start and imports, to its Hello) + load (Hello -> ready); "
        "- where nothing was down (a surge); bound: down, or for a surge the replacement's load (its "
        "load_seconds, on the serving cores)"
    )
    for r in result["events"]:
        typer.echo(f"  {r['event']}: {r['detail']}")
        for e in r["errors"]:
            typer.echo(f"    error: {e}")


def _part(value: float | None) -> str:
    return f"{'-':>7}" if value is None else f"{value:>7.1f}"
