"""The router's server: loads the served models' tokenizers, builds their grammar compilers, binds
the public and admin apps and serves until SIGTERM. :mod:`router.main` (the process entry) runs it,
a standby router after loading it on a thread of lower priority."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
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


def load_models(cfg: RouterSettings, model_paths: list[str]) -> dict[str, ServedModel]:
    """Every served model with its tokenizer, by served name (``model_paths[k]`` is model ``k``'s
    folder; the one-model form: ``cfg.model`` and one path)."""
    configs = cfg.models or [cfg.model]
    if len(configs) != len(model_paths):
        raise SystemExit(f"{len(configs)} model(s) in the settings but {len(model_paths)} --model-path")
    served = [served_model(c, p, load_tokenizer(p)) for c, p in zip(configs, model_paths, strict=True)]
    return {m.name: m for m in served}


def build_grammar_checkers(models: dict[str, ServedModel]) -> None:
    """Build each text model's grammar compiler (importing xgrammar, and torch with it, and walking
    the vocabulary: seconds of CPU), then freeze what that allocated out of the garbage collector's
    full collections, as start-up's own objects are. Built at the first structured request instead,
    it took a core from a worker serving beside it and stretched its steps many times over
    (docs/benchmarks/results.md, 2026-12-04). A failure is logged: the first structured request
    then builds it (and says why it cannot)."""
    try:
        for model in models.values():
            if model.task == GENERATE:
                model.grammar_checker.build()
    except Exception as exc:  # noqa: BLE001 (xgrammar's own errors: a structured request reports them)
        log.warning("grammar compiler not built at start: %s", exc)
        return
    freeze_startup_heap()


async def warm_grammar_checkers(models: dict[str, ServedModel]) -> None:
    """:func:`build_grammar_checkers` on a thread of its own, so that the serving router's event
    loop answers meanwhile (it starts while the workers load)."""
    builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-warm")
    try:
        await asyncio.get_running_loop().run_in_executor(builder, build_grammar_checkers, models)
    finally:
        builder.shutdown(wait=False)


def read_settings(path: str) -> RouterSettings:
    """The router's settings file (``RouterArgs.config``), validated; sets up logging from it."""
    with open(path) as f:
        cfg = RouterSettings.model_validate_json(f.read())
    setup_logging("router", cfg.logging.format, cfg.logging.level)
    return cfg


async def run_router(
    cfg: RouterSettings, args: RouterArgs, models: dict[str, ServedModel] | None = None, restarts: int | None = None
) -> None:
    """Serve the public and admin apps until SIGTERM/SIGINT. ``models``: loaded already, their
    grammar compilers built (a standby router's, :mod:`router.main`); None: loaded here, the
    compilers built on a thread while the event loop serves. ``restarts``: the count a standby was
    given at takeover (None: ``args.restarts``). ``args.events``: the supervisor's event address
    (:mod:`router.supervisor_events`; "" without one); ``args.event_log``: the file that keeps the
    status page's worker events across router processes (:class:`router.events.EventLog`; "": in
    memory only)."""
    raise_file_limit()  # before create_app, which sizes the connection cap from it
    warming = None
    if models is None:
        models = load_models(cfg, list(args.model_paths))
        warming = asyncio.create_task(warm_grammar_checkers(models))
    address, events, started = args.address, args.events, args.started
    restarts = args.restarts if restarts is None else restarts
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
    if warming is not None:
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


def serve(
    cfg: RouterSettings, args: RouterArgs, models: dict[str, ServedModel] | None = None, restarts: int | None = None
) -> None:
    """:func:`run_router` on uvloop's event loop, until SIGTERM (the arguments as there)."""
    uvloop.run(run_router(cfg, args, models, restarts))
