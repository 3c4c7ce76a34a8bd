"""Router process entry: ``python -m router.main --config RUN/router.json --model-path DIR --address ZMQ``
(``--model-path`` once per served model, in the settings' ``models`` order)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import uvloop
from aiohttp import web

from router.app import CONNECTIONS, create_admin_app, create_app
from router.args import RouterArgs
from router.connections import raise_file_limit
from router.events import EventLog
from router.served import served_model
from router.settings import RouterSettings
from router.state import GENERATE, Api, ServedModel
from router.supervisor_events import EventSender
from router.tokenizer import load_tokenizer
from router.workers import WorkerPool
from worker.contract import keys
from worker.contract.heap import freeze_startup_heap
from worker.contract.lifeline import die_with_parent
from worker.contract.logs import setup_logging
from worker.contract.pauses import SLOW_TURN_S, TurnWatch

log = logging.getLogger("router")


async def start_servers(api: Api) -> list[web.AppRunner]:
    """Listen with the public and admin apps on the configured addresses; returns their runners
    (public first) for :func:`stop_servers`."""
    r = api.cfg.router
    public = web.AppRunner(
        create_app(api), handler_cancellation=True, access_log=None, keepalive_timeout=r.keepalive_timeout_s
    )
    admin = web.AppRunner(
        create_admin_app(api), handler_cancellation=True, access_log=None, keepalive_timeout=r.keepalive_timeout_s
    )
    await public.setup()
    await admin.setup()
    public.app[CONNECTIONS].attach(public.server)
    await web.TCPSite(public, r.host, r.port).start()
    await web.TCPSite(admin, r.admin_host, r.admin_port).start()
    log.info(
        "listening on http://%s:%d (admin on %s:%d, at most %d public connections), workers connect to %s",
        r.host,
        r.port,
        r.admin_host,
        r.admin_port,
        public.app[CONNECTIONS].cap,
        api.pool.address,
    )
    return [public, admin]


async def stop_servers(api: Api, runners: list[web.AppRunner]) -> None:
    """Stop accepting requests (responses from now on close their connection), then close."""
    api.pool.stop_accepting()
    for runner in reversed(runners):
        await runner.cleanup()


async def wait_for_takeover() -> int | None:
    """A standby router's wait: the supervisor writes ``go <restarts>`` on its stdin when the
    router it stands in for has died. Returns that restart count, or None when stdin closes first."""
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    word, _, count = line.strip().partition(" ")
    return int(count) if word == "go" and count.isdigit() else None


def load_models(cfg: RouterSettings, model_paths: list[str]) -> dict[str, ServedModel]:
    """Every served model with its tokenizer, by served name (``model_paths[k]`` is model ``k``'s
    folder; the one-model form: ``cfg.model`` and one path)."""
    configs = cfg.models or [cfg.model]
    if len(configs) != len(model_paths):
        raise SystemExit(f"{len(configs)} model(s) in the settings but {len(model_paths)} --model-path")
    served = [served_model(c, p, load_tokenizer(p)) for c, p in zip(configs, model_paths, strict=True)]
    return {m.name: m for m in served}


STANDBY_NICE = 10  # a standby router loads while the workers serve: it yields the CPU to them


def _build_at(checkers: list, nice: int) -> None:
    if nice:
        try:  # this thread only (Linux: a thread is a task with a priority of its own)
            me = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, me, min(os.getpriority(os.PRIO_PROCESS, me) + nice, 19))
        except OSError as exc:
            log.debug("grammar compiler thread keeps its priority: %s", exc)
    for checker in checkers:
        checker.build()


async def warm_grammar_checkers(models: dict[str, ServedModel], nice: int = 0) -> None:
    """Build each text model's grammar compiler now, while the workers load (importing xgrammar,
    and torch with it, and walking the vocabulary: about 1.5 s of CPU), rather than at the first
    structured request: there, on a 2-core box, it took a core from the worker for 1.8 s and its
    steps went from about 30 ms to up to 1 s. ``nice``: the priority of the thread that builds
    them, on its own thread (a standby router's: :data:`STANDBY_NICE`). Then freezes what it
    allocated out of the garbage collector's full collections, as start-up's own objects are. A
    failure is logged: the first structured request then builds it (and says why it cannot)."""
    checkers = [m.grammar_checker for m in models.values() if m.task == GENERATE]
    if not checkers:
        return
    builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-warm")
    try:
        await asyncio.get_running_loop().run_in_executor(builder, _build_at, checkers, nice)
    except Exception as exc:  # noqa: BLE001 (xgrammar's own errors: a structured request reports them)
        log.warning("grammar compiler not built at start: %s", exc)
        return
    finally:
        builder.shutdown(wait=False)
    freeze_startup_heap()


async def run_router(cfg: RouterSettings, args: RouterArgs) -> None:
    """Serve the public and admin apps until SIGTERM/SIGINT. A standby router (``args.standby``)
    loads what takes time (imports, tokenizers), then binds nothing until :func:`wait_for_takeover`
    says so. ``args.events``: the supervisor's event address (:mod:`router.supervisor_events`; ""
    without one); ``args.event_log``: the file that keeps the status page's worker events across
    router processes (:class:`router.events.EventLog`; "": in memory only)."""
    raise_file_limit()  # before create_app, which sizes the connection cap from it
    models = load_models(cfg, list(args.model_paths))
    warming = asyncio.create_task(warm_grammar_checkers(models, STANDBY_NICE if args.standby else 0))
    address, restarts, events, started = args.address, args.restarts, args.events, args.started
    if args.standby:
        log.info("standby router loaded; waiting to take over")
        taken = await wait_for_takeover()
        if taken is None:
            log.info("standby router not needed; exiting")
            return
        restarts = taken
        log.info("standby router taking over (restart %d)", restarts)
    curve = keys.server_keys() if keys.uses_curve(address) else None
    pool = WorkerPool(
        address,
        cfg.router.policy,
        cfg.workers.heartbeat_timeout_s,
        restarts=restarts,
        stall_timeout_s=cfg.workers.stall_timeout_s,
        curve=curve,
        model_timeouts=cfg.model_timeouts(),
    )
    if args.event_log:
        pool.events = EventLog(path=Path(args.event_log))
        if restarts:
            pool.events.router_restarted(os.getpid(), restarts)
    sender = EventSender(events) if events else None
    if sender is not None:
        pool.tell_supervisor = sender.send
    api = Api(cfg, pool, models=models, **({"started": started} if started else {}))
    pool.hold.limits = lambda model: api.cfg.hold_limits(model)  # api.cfg: replaced by a live apply
    runners = await start_servers(api)
    freeze_startup_heap()  # a full collection would stop the event loop, and with it every stream
    lag = asyncio.create_task(watch_event_loop())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, lambda: None)  # the launcher decides when we stop
    await stop.wait()
    lag.cancel()
    warming.cancel()
    await stop_servers(api, runners)
    if sender is not None:
        sender.close()


async def watch_event_loop(tick_s: float = 0.1) -> None:
    """Log every tick of the event loop that comes over :data:`~worker.contract.pauses.SLOW_TURN_S`
    late (a blocking call or a collection held every stream this router relays), with the CPU the
    router used meanwhile (:class:`~worker.contract.pauses.TurnWatch`). Runs until cancelled."""
    watch = TurnWatch(f"a {1e3 * tick_s:.0f} ms tick of the router's event loop", slow_s=tick_s + SLOW_TURN_S)
    while True:
        watch.begin()
        await asyncio.sleep(tick_s)
        watch.end()


def main(argv: list[str] | None = None) -> None:
    die_with_parent()  # first: a launcher killed from here on takes this process with it
    args = RouterArgs.from_argv(argv)
    with open(args.config) as f:
        cfg = RouterSettings.model_validate_json(f.read())
    setup_logging("router", cfg.logging.format, cfg.logging.level)
    uvloop.run(run_router(cfg, args))


if __name__ == "__main__":
    main()
