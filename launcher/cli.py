"""The ``llamadeploy`` command line (typer): up, status, restart-worker."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from launcher.config import ConfigError, DeployConfig, load_config
from launcher.logs import setup_logging

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Self-hosted LLaMA inference: one OpenAI-compatible endpoint over per-GPU worker replicas.")
console = Console(stderr=True, soft_wrap=True)
log = logging.getLogger("launcher")

CONFIG_ARG = typer.Argument(None, help="deploy.yaml (default: ./deploy.yaml if present, else built-in defaults)")


@app.callback()
def _root() -> None:
    """Self-hosted LLaMA inference: one OpenAI-compatible endpoint over per-GPU worker replicas."""


def _config_path(path: Optional[Path]) -> Optional[Path]:
    if path is None and Path("deploy.yaml").is_file():
        return Path("deploy.yaml")
    return path


def fail(message: str, code: int = 2) -> None:
    console.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)


def port_problem(host: str, port: int, key: str) -> str | None:
    """None if ``host:port`` can be bound now, else a message naming the config key."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return f"{key}: cannot listen on {host}:{port} ({exc.strerror}); stop what uses it or choose another port"
    return None


def load_or_exit(config: Optional[Path], overrides: dict | None = None) -> DeployConfig:
    try:
        return load_config(_config_path(config), overrides)
    except ConfigError as exc:
        fail(str(exc))


@app.command()
def up(
    config: Optional[Path] = CONFIG_ARG,
    host: Optional[str] = typer.Option(None, help="router.host"),
    port: Optional[int] = typer.Option(None, help="router.port"),
    admin_port: Optional[int] = typer.Option(None, help="router.admin_port"),
    policy: Optional[str] = typer.Option(None, help="router.policy: round_robin | least_loaded"),
    replicas: Optional[int] = typer.Option(None, help="workers.replicas"),
    devices: Optional[str] = typer.Option(None, help="workers.devices: auto | cpu | 0,1,2"),
    model: Optional[str] = typer.Option(None, help="model.name"),
    log_format: Optional[str] = typer.Option(None, help="logging.format: text | json"),
) -> None:
    """Start the router and one worker per replica; serve until Ctrl-C or SIGTERM."""
    dev: object = devices
    if devices and devices not in ("auto", "cpu"):
        try:
            dev = [int(d) for d in devices.split(",")]
        except ValueError:
            fail(f"--devices: expected auto, cpu or GPU indices like 0,1 (got {devices!r})")
    cfg = load_or_exit(config, {"router.host": host, "router.port": port, "router.admin_port": admin_port,
                                "router.policy": policy, "workers.replicas": replicas, "workers.devices": dev,
                                "model.name": model, "logging.format": log_format})
    setup_logging("launcher", cfg.logging.format, cfg.logging.level)
    for h, p, key in ((cfg.router.host, cfg.router.port, "router.port"),
                      (cfg.router.admin_host, cfg.router.admin_port, "router.admin_port")):
        if problem := port_problem(h, p, key):
            fail(problem)

    from launcher.models import ModelNotFound, resolve_model
    from launcher.placement import PlacementError, discover, place

    try:
        specs = place(cfg.workers, discover())
    except PlacementError as exc:
        fail(f"workers: {exc}")
    try:
        model_path = resolve_model(cfg.model.name)
    except ModelNotFound as exc:
        fail(str(exc))
    sys.exit(serve(cfg, specs, model_path))


def serve(cfg: DeployConfig, specs, model_path: Path) -> int:
    """Run one deployment in the foreground; returns the process exit code."""
    from launcher.supervisor import Supervisor

    run_dir = Path(tempfile.mkdtemp(prefix="llamadeploy-"))
    address = cfg.router.zmq_address or f"ipc://{run_dir}/workers.ipc"
    stop = {"requested": False}

    def on_signal(signum, _frame):
        if stop["requested"]:
            log.warning("second %s: stopping now", signal.Signals(signum).name)
            raise KeyboardInterrupt
        stop["requested"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    sup = Supervisor(cfg, specs, model_path, run_dir, address)
    try:
        sup.start()
        log.info("loading %s on %d worker(s): %s", cfg.model.public_name, len(specs), ", ".join(s.label for s in specs))
        sup.wait_ready(cfg.workers.startup_timeout_s, lambda: stop["requested"])
        if not stop["requested"]:
            host = "127.0.0.1" if cfg.router.host in ("0.0.0.0", "::") else cfg.router.host
            console.print(f"[bold green]ready[/]: http://{host}:{cfg.router.port}/v1  (model "
                          f"'{cfg.model.public_name}', {len(specs)} worker(s), policy {cfg.router.policy})",
                          highlight=False)
        return sup.run(lambda: stop["requested"])
    except (RuntimeError, KeyboardInterrupt) as exc:
        if isinstance(exc, RuntimeError):
            log.error("%s", exc)
        sup.shutdown()
        return 1
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _admin_client(config: Optional[Path], admin_url: Optional[str]):
    from launcher.supervisor import AdminClient

    cfg = load_or_exit(config)
    host = "127.0.0.1" if cfg.router.admin_host in ("0.0.0.0", "::") else cfg.router.admin_host
    return AdminClient(admin_url or f"http://{host}:{cfg.router.admin_port}", cfg.router.admin_token)


ADMIN_URL = typer.Option(None, "--admin-url", help="the router's admin API (default: from deploy.yaml)")


@app.command()
def status(config: Optional[Path] = CONFIG_ARG, admin_url: Optional[str] = ADMIN_URL,
           as_json: bool = typer.Option(False, "--json", help="print the raw JSON")) -> None:
    """Show every worker: device, pid, state, load, restarts, uptime, memory."""
    import json

    from rich.table import Table

    client = _admin_client(config, admin_url)
    try:
        info = client.call("GET", "/admin/workers")
    except OSError as exc:
        fail(f"no router answers at {client.base} ({exc}); is `llamadeploy up` running?", 1)
    if as_json:
        typer.echo(json.dumps(info, indent=2))
        return
    table = Table(title=f"llamadeploy workers (policy {info['policy']})")
    for col in ("id", "device", "pid", "state", "in-flight", "served", "restarts", "uptime", "memory"):
        table.add_column(col, justify="right" if col not in ("device", "state") else "left")
    colors = {"ready": "green", "draining": "yellow", "starting": "cyan", "dead": "red", "failed": "bold red"}
    for w in info["workers"]:
        state = f"[{colors.get(w['state'], 'white')}]{w['state']}[/]"
        table.add_row(str(w["id"]), w["device"], str(w["pid"]), state, str(w["in_flight"]), str(w["served"]),
                      str(w["restarts"]), f"{w['uptime_s']:.0f}s", f"{w['mem_bytes'] / 2**20:.0f} MiB")
    Console().print(table)


@app.command("restart-worker")
def restart_worker(worker_id: int = typer.Argument(..., help="the worker's id (see `llamadeploy status`)"),
                   drain: bool = typer.Option(False, "--drain", help="stop routing to it and wait for its in-flight requests first"),
                   timeout: float = typer.Option(60.0, help="seconds to wait for the drain"),
                   config: Optional[Path] = typer.Option(None, "--config", help="deploy.yaml"),
                   admin_url: Optional[str] = ADMIN_URL) -> None:
    """Restart one worker process; with --drain, without dropping a request."""
    client = _admin_client(config, admin_url)
    try:
        out = client.call("POST", f"/admin/workers/{worker_id}/restart?drain={int(drain)}&timeout={timeout}",
                          timeout=timeout + 10)
    except OSError as exc:
        fail(f"restart of worker {worker_id} failed: {exc}", 1)
    note = "" if out.get("drained", True) else " (drain timed out: in-flight requests were failed over)"
    console.print(f"worker {worker_id} restarting{note}", highlight=False)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
