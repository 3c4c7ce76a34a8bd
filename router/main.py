"""Router process entry: ``python -m router.main --config RUN/config.json --model-path DIR --address ZMQ``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

import uvloop
from aiohttp import web

from launcher.config import DeployConfig
from launcher.lifeline import die_with_parent
from launcher.logs import setup_logging
from router.app import create_admin_app, create_app
from router.openai_api import Api
from router.workers import WorkerPool

log = logging.getLogger("router")


async def run_router(cfg: DeployConfig, model_path: str, address: str) -> None:
    """Serve the public and admin apps until SIGTERM/SIGINT."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    pool = WorkerPool(address, cfg.router.policy, cfg.workers.heartbeat_timeout_s)
    api = Api(cfg, pool, tokenizer)
    public = web.AppRunner(create_app(api), handler_cancellation=True, access_log=None)
    admin = web.AppRunner(create_admin_app(api), handler_cancellation=True, access_log=None)
    await public.setup()
    await admin.setup()
    await web.TCPSite(public, cfg.router.host, cfg.router.port).start()
    await web.TCPSite(admin, cfg.router.admin_host, cfg.router.admin_port).start()
    log.info("listening on http://%s:%d (admin on %s:%d), workers connect to %s", cfg.router.host, cfg.router.port,
             cfg.router.admin_host, cfg.router.admin_port, address)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, lambda: None)  # the launcher decides when we stop
    await stop.wait()
    await admin.cleanup()
    await public.cleanup()


def main(argv: list[str] | None = None) -> None:
    die_with_parent()  # first: a launcher killed from here on takes this process with it
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", required=True)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--address", required=True)
    args = ap.parse_args(argv)
    with open(args.config) as f:
        cfg = DeployConfig.model_validate_json(f.read())
    setup_logging("router", cfg.logging.format, cfg.logging.level)
    uvloop.run(run_router(cfg, args.model_path, args.address))


if __name__ == "__main__":
    main()
