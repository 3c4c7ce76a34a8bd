"""The ``llamadeploy`` command line (typer): up, down, status, restart-worker, apply, plan, doctor, bench."""

from __future__ import annotations

import logging
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import typer

from launcher.bench.command import bench_command
from launcher.config import DeployConfig
from launcher.console import console, fail, load_or_exit, report_console
from launcher.plan.ports import port_problems
from launcher.rollout.command import apply_command
from router.admin_protocol import HAS_NO_PROCESS, WorkerState
from router.policies.registry import POLICIES
from router.settings import connect_host
from worker.contract.logs import setup_logging

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Self-hosted LLaMA inference: one OpenAI-compatible endpoint over per-GPU worker replicas.",
)
log = logging.getLogger("launcher")

CONFIG_ARG = typer.Argument(None, help="deploy.yaml (default: ./deploy.yaml if present, else built-in defaults)")


@app.callback()
def _root() -> None:
    """Self-hosted LLaMA inference: one OpenAI-compatible endpoint over per-GPU worker replicas."""


@app.command()
def up(
    config: Path | None = CONFIG_ARG,
    host: str | None = typer.Option(None, help="router.host"),
    port: int | None = typer.Option(None, help="router.port"),
    admin_port: int | None = typer.Option(None, help="router.admin_port"),
    policy: str | None = typer.Option(None, help=f"router.policy: {' | '.join(POLICIES)}"),
    replicas: int | None = typer.Option(None, help="workers.replicas"),
    devices: str | None = typer.Option(None, help="workers.devices: auto | cpu | 0,1,2"),
    model: str | None = typer.Option(None, help="model.name"),
    log_format: str | None = typer.Option(None, help="logging.format: text | json"),
    force: bool = typer.Option(False, "--force", help="start even when the memory plan says it does not fit"),
) -> None:
    """Start the router and one worker per replica; serve until Ctrl-C or SIGTERM."""
    cfg = load_or_exit(
        config,
        {
            "router.host": host,
            "router.port": port,
            "router.admin_port": admin_port,
            "router.policy": policy,
            "workers.replicas": replicas,
            "workers.devices": devices_option(devices),
            "model.name": model,
            "logging.format": log_format,
        },
    )
    setup_logging("launcher", cfg.logging.format, cfg.logging.level)
    for *_, problem in port_problems(cfg):
        if problem:
            fail(problem)
    if cfg.cluster.backend == "ray":
        from launcher.plan.layouts import tp_refusal

        for k in range(len(cfg.served())):  # each model under its own workers section
            if problem := tp_refusal(cfg.for_model(k)):
                fail(problem)
    sys.exit(up_on_ray(cfg, force) if cfg.cluster.backend == "ray" else up_here(cfg, force))


def devices_option(devices: str | None) -> object:
    """``--devices`` as the config takes it: ``auto``, ``cpu`` or a list of GPU indices (exit 2 otherwise)."""
    if not devices or devices in ("auto", "cpu"):
        return devices
    try:
        return [int(d) for d in devices.split(",")]
    except ValueError:
        fail(f"--devices: expected auto, cpu or GPU indices like 0,1 (got {devices!r})")


def up_on_ray(cfg: DeployConfig, force: bool) -> int:
    """Place the slots on the Ray cluster and serve; exit 2 when the cluster cannot hold them."""
    from launcher.ray.up import ClusterError, prepare_ray

    try:
        ray_launch = prepare_ray(cfg, force)
    except ClusterError as exc:
        fail(str(exc))
    return serve(ray_launch.cfg, ray_launch.specs, ray_launch.model_path, ray_launch.backend, ray_launch.address)


def up_here(cfg: DeployConfig, force: bool) -> int:
    """Place the slots on this machine's devices, check the memory plan (``force``: warn only),
    find the model and serve; exit 2 on a tensor-parallel, placement, plan or model problem
    (:func:`launcher.plan.admit.admit`, the check ``apply`` runs too)."""
    from launcher.plan.admit import NotAdmitted, admit
    from launcher.plan.placement import discover
    from worker.contract.tasks import TaskError

    try:
        admission = admit(cfg, discover())
    except NotAdmitted as exc:
        fail(str(exc))
    cfg = admission.config
    if problem := admission.memory_problem:
        if not force:
            fail(problem + "\n  (or pass --force to start anyway)")
        log.warning("starting despite the memory plan (--force): %s", problem)
    paths = per_model(cfg.served(), _model_path, TaskError)
    return serve(cfg, admission.specs, paths[0] if len(paths) == 1 else paths)


def _model_path(one) -> Path:
    """The folder (or file) of ``one`` served model; raises ``ModelNotFound``, or ``TaskError``
    for a task the model cannot serve (before any process starts)."""
    from launcher.models import resolve_model
    from worker.contract.tasks import check_task

    path = resolve_model(one.model.name, quantization=one.model.quantization)
    check_task(one.model, path)
    return path


def say_ready(cfg: DeployConfig, count: int, failed: list[int]) -> None:
    """The ``ready`` line: the endpoint, the models, how many of ``count`` workers serve (``failed``:
    the slots given up on), the policy; a log line with JSON logs."""
    host = connect_host(cfg.router.host)
    quoted = "', '".join(one.name for one in cfg.served())
    workers = (
        f"{count - len(failed)} of {count} workers, failed: {', '.join(map(str, failed))}"
        if failed
        else f"{count} worker(s)"
    )
    ready = f"http://{host}:{cfg.router.port}/v1  (model '{quoted}', {workers}, policy {cfg.router.policy})"
    if cfg.logging.format == "json":
        log.info("ready: %s", ready)  # one JSON object per line, even for this
    else:
        console.print(f"[bold green]ready[/]: {ready}", highlight=False)


def serve(cfg: DeployConfig, specs, model_path: Path | list[Path], backend=None, address: str | None = None) -> int:
    """Run one deployment in the foreground; returns the process exit code. ``model_path``: the
    model's folder, or one per model of ``cfg.served()``. ``backend`` starts the
    worker slots (None: local processes; :class:`launcher.ray.backend.RayBackend`), ``address`` is
    the router's ZeroMQ endpoint (default ``router.zmq_address``, else ``ipc://`` in the run dir)."""
    from launcher.rollout.begin import begin_apply
    from launcher.supervise.progress import loading_progress
    from launcher.supervise.supervisor import Supervisor
    from worker.contract.keys import make_keys, uses_curve

    run_dir = Path(tempfile.mkdtemp(prefix="llamadeploy-"))  # mode 0700
    address = address or cfg.router.zmq_address or f"ipc://{run_dir}/workers.ipc"
    child_env = make_keys(run_dir, [s.worker_id for s in specs]) if uses_curve(address) else {}
    stop = {"requested": False}

    def on_signal(signum, _frame):
        if stop["requested"]:
            log.warning("second %s: stopping now", signal.Signals(signum).name)
            raise KeyboardInterrupt
        stop["requested"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    sup = Supervisor(cfg, specs, model_path, run_dir, address, child_env=child_env, backend=backend)
    sup.on_apply(begin_apply)  # the supervisor steps the rollout an apply starts
    try:
        sup.start()
        names = [one.name for one in cfg.served()]
        where = ", ".join(s.label + (f" ({names[s.model]})" if len(names) > 1 else "") for s in specs)
        log.info("loading %s on %d worker(s): %s", ", ".join(names), len(specs), where)
        with loading_progress(
            sup.admin.try_table,
            len(specs),
            enabled=cfg.logging.format == "text",
            console=console,
        ):
            longest = max(one.workers.startup_timeout_s for one in cfg.served())
            sup.wait_ready(longest, lambda: stop["requested"])
        if not stop["requested"]:
            say_ready(cfg, len(specs), [wid for wid, slot in sup.slots.items() if slot.failed])
        return sup.run(lambda: stop["requested"])
    except (RuntimeError, KeyboardInterrupt) as exc:
        if isinstance(exc, RuntimeError):
            log.error("%s", exc)
        sup.shutdown(grace=0 if isinstance(exc, KeyboardInterrupt) else None)
        return 1
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        if backend is not None:
            backend.close()


def _admin_client(config: Path | None, admin_url: str | None):
    from launcher.supervise.admin_client import AdminClient

    cfg = load_or_exit(config)
    return AdminClient(admin_url or cfg.router.admin_url, cfg.router.admin_token)


def admin_call(client, method: str, path: str, timeout: float = 5.0) -> dict:
    """One admin API call; exits 1 with a message that says what to check when it fails."""
    return _or_exit(client, lambda: client.call(method, path, timeout=timeout))


def admin_table(client, timeout: float = 5.0):
    """``GET /admin/workers`` as a typed :class:`router.admin_protocol.WorkerTable`; exits 1 with a
    message when the router does not answer, refuses, or answers with something else."""
    return _or_exit(client, lambda: client.table(timeout=timeout))


def _or_exit(client, call):
    from launcher.supervise.admin_client import AdminError

    try:
        return call()
    except AdminError as exc:
        hint = (
            " (the token is router.admin_token or LLAMADEPLOY_ADMIN_TOKEN)" if str(exc).startswith("HTTP 401") else ""
        )
        fail(f"the admin API at {client.base} refused: {exc}{hint}", 1)
    except OSError as exc:
        fail(
            f"no router answers at {client.base} ({exc}); is `llamadeploy up` running? If it was started "
            "with another admin port, pass --admin-url http://127.0.0.1:PORT",
            1,
        )
    except ValueError as exc:  # a table that does not match this launcher's contract (another version)
        fail(f"the admin API at {client.base} answered a table this launcher cannot read: {exc}", 1)


ADMIN_URL = typer.Option(None, "--admin-url", help="the router's admin API (default: from deploy.yaml)")


@app.command()
def status(
    config: Path | None = CONFIG_ARG,
    admin_url: str | None = ADMIN_URL,
    as_json: bool = typer.Option(False, "--json", help="print the raw JSON"),
) -> None:
    """Show every worker: device, pid, state, load, restarts, uptime, memory; and the batch jobs."""
    import json

    import msgspec

    client = _admin_client(config, admin_url)
    info = admin_table(client)
    if as_json:
        typer.echo(json.dumps(msgspec.to_builtins(info), indent=2))
        return
    out = report_console()
    out.print(worker_table(info))
    if info.router is not None:
        r = info.router
        out.print(f"router: pid {r.pid}, restarts {r.restarts}, uptime {r.uptime_s:.0f}s", highlight=False)
    for w in info.workers:
        if w.state in HAS_NO_PROCESS and w.exit_reason:
            out.print(f"worker {w.id} {w.state.value}: {w.exit_reason}", highlight=False)
    if not info.accepting:
        out.print("the router is shutting down: new requests get 503", highlight=False)
    for b in (client.try_call("GET", "/admin/batches") or {}).get("batches", []):
        done = b["completed"] + b["failed"]
        out.print(
            f"batch {b['id']} {b['status']}: {done} of {b['total']} done, {b['failed']} failed ({b['endpoint']})",
            highlight=False,
        )
    if rollout := client.try_call("GET", "/admin/rollout"):
        from launcher.rollout.command import describe

        out.print(describe(rollout), highlight=False)


STATE_COLORS = {
    WorkerState.READY: "green",
    WorkerState.DRAINING: "yellow",
    WorkerState.STARTING: "cyan",
    WorkerState.DEAD: "red",
    WorkerState.FAILED: "bold red",
}
STATUS_COLUMNS = (
    "id",
    "model",
    "node",
    "device",
    "pid",
    "state",
    "in-flight",
    "run/wait",
    "kv cache",
    "served",
    "restarts",
)


def worker_table(info):
    """The rich table ``status`` prints for a :class:`router.admin_protocol.WorkerTable`."""
    from rich.table import Table

    table = Table(title=f"llamadeploy workers (policy {info.policy})")
    for col in (*STATUS_COLUMNS, "uptime", "memory", "rev"):
        table.add_column(col, justify="right" if col not in ("model", "node", "device", "state") else "left")
    for w in info.workers:
        kv = w.kv_used_tokens / w.kv_budget_tokens if w.kv_budget_tokens else 0.0
        table.add_row(
            str(w.id),
            w.model,
            w.node_ip or "local",
            w.device,
            str(w.pid),
            f"[{STATE_COLORS.get(w.state, 'white')}]{w.state.value}[/]",
            str(w.in_flight),
            f"{w.running}/{w.waiting}",
            f"{kv:.0%}",
            str(w.served),
            str(w.restarts),
            f"{w.uptime_s:.0f}s",
            f"{w.mem_bytes / 2**20:.0f} MiB",
            str(w.revision),
        )
    return table


@app.command()
def down(
    config: Path | None = CONFIG_ARG,
    admin_url: str | None = ADMIN_URL,
    timeout: float | None = typer.Option(
        None, help="seconds to wait for it to stop (default: supervisor.shutdown_grace_s + 30)"
    ),
) -> None:
    """Stop a deployment that `llamadeploy up` runs on this machine, as Ctrl-C would.

    In-flight requests get supervisor.shutdown_grace_s to finish, then every process is stopped;
    batches resume at the next `up` on the same state folder. Exit code 0 once it has stopped,
    1 if no router answers, it was not started by `up` here, or it did not stop in time.
    """
    from launcher.stop import StopError, launcher_of, on_this_machine, stop

    cfg = load_or_exit(config)
    client = _admin_client(config, admin_url)
    if not on_this_machine(client.base):
        fail(f"{client.base} is not this machine's: run `llamadeploy down` where the deployment runs", 1)
    info = admin_table(client)
    if info.router is None or not info.router.pid:
        fail(f"the admin API at {client.base} names no router process", 1)
    try:
        pid = launcher_of(info.router.pid)
    except StopError as exc:
        fail(str(exc), 1)
    wait_s = cfg.supervisor.shutdown_grace_s + 30 if timeout is None else timeout
    with console.status(f"stopping the deployment (llamadeploy up, pid {pid})"):
        stopped = stop(pid, wait_s)
    if not stopped:
        fail(f"llamadeploy up (pid {pid}) got SIGTERM but is still stopping after {wait_s:g}s", 1)
    typer.echo(f"stopped: llamadeploy up (pid {pid}) and its router and workers")


@app.command("restart-worker")
def restart_worker(
    worker_id: int = typer.Argument(..., help="the worker's id (see `llamadeploy status`)"),
    drain: bool = typer.Option(False, "--drain", help="stop routing to it and wait for its in-flight requests first"),
    timeout: float | None = typer.Option(None, help="seconds to wait for the drain (supervisor.drain_timeout_s)"),
    wait: bool = typer.Option(True, help="wait until the new process is ready (workers.startup_timeout_s)"),
    config: Path | None = typer.Option(None, "--config", help="deploy.yaml"),
    admin_url: str | None = ADMIN_URL,
) -> None:
    """Restart one worker process (or start a failed one again); with --drain, without dropping a request.

    Exit code 0 once it is ready again (or at once with --no-wait), 1 if it failed or did not
    come back within its model's workers.startup_timeout_s.
    """
    cfg = load_or_exit(config)
    client = _admin_client(config, admin_url)
    drain_s = cfg.supervisor.drain_timeout_s if timeout is None else timeout
    out = admin_call(
        client, "POST", f"/admin/workers/{worker_id}/restart?drain={int(drain)}&timeout={drain_s}", timeout=drain_s + 10
    )
    note = "" if out.get("drained", True) else " (drain timed out: in-flight requests were failed over)"
    model = out["worker"].get("model")
    console.print(f"worker {worker_id}{f' ({model})' if model else ''} restarting{note}", highlight=False)
    if wait:
        with console.status(f"waiting for worker {worker_id} to be ready"):
            startup_s = cfg.workers_for(model or "").startup_timeout_s  # its own model's
            w = wait_rejoined(client, worker_id, out["worker"]["pid"], startup_s)
        if w is None or w.state != WorkerState.READY:
            fail(
                f"worker {worker_id} is {w.state.value if w else 'unreachable'}"
                + (f" ({w.exit_reason})" if w and w.exit_reason else ""),
                1,
            )
        console.print(f"worker {worker_id} ready (pid {w.pid}, restarts {w.restarts})", highlight=False)


def wait_rejoined(client, worker_id: int, old_pid: int, timeout: float):
    """Poll the admin API until worker ``worker_id`` runs a new process that is ready or failed
    (or ``timeout`` passes); returns its last :class:`~router.admin_protocol.WorkerInfo` (None:
    never read)."""
    import time

    deadline = time.monotonic() + timeout
    w = None
    while time.monotonic() < deadline:
        info = client.try_table(timeout=5.0)
        w = next((x for x in (info.workers if info else []) if x.id == worker_id), w)
        if w is not None and w.pid != old_pid and w.state in (WorkerState.READY, WorkerState.FAILED):
            break
        if w is not None and w.state == WorkerState.FAILED and not w.start_requested:
            break  # the start was tried and refused (no room for the slot): no new process is coming
        time.sleep(0.5)
    return w


def ray_layout(cfg: DeployConfig):
    """The Ray cluster's GPUs and the slots ``up`` would place on them: ``(inventory, specs)``;
    exit 2 when the cluster cannot be read or does not report its GPUs' memory."""
    from launcher.ray.up import UNKNOWN_MEMORY, ClusterError, cluster_layout

    try:
        inventory, specs, known = cluster_layout(cfg)  # the cluster's GPUs, as `up` reads them
    except ClusterError as exc:
        fail(str(exc))
    if not known:
        fail(UNKNOWN_MEMORY)
    return inventory, specs


def _plan_inventory(gpus: str | None):
    """This machine's inventory, with ``--gpus`` (idle hypothetical GPUs) in place of its GPUs."""
    from launcher.plan.placement import Inventory, discover
    from launcher.plan.plan import parse_gpus

    inventory = discover()
    if not gpus:
        return inventory
    try:
        return Inventory(parse_gpus(gpus), inventory.cpus, None, inventory.ram_available_bytes)
    except ValueError as exc:
        fail(str(exc))


@app.command()
def plan(
    config: Path | None = CONFIG_ARG,
    model: str | None = typer.Option(None, help="model.name (config only is read, never weights)"),
    gpus: str | None = typer.Option(
        None,
        help="plan for these idle GPUs (numbered 0..n-1, devices: auto) instead of this machine's: 8x80GB, 24GiB,24GiB",
    ),
    dtype: str | None = typer.Option(None, help="auto | float32 | bfloat16 | float16 (default model.dtype)"),
    quantization: str | None = typer.Option(
        None, help="auto | none | int8 | int4: the linear layers' weights (default model.quantization)"
    ),
    max_model_len: int | None = typer.Option(None, help="model.max_model_len"),
    max_num_seqs: int | None = typer.Option(None, help="workers.max_num_seqs"),
    gpus_per_replica: int | None = typer.Option(None, help="workers.gpus_per_replica"),
    tensor_parallel_size: int | None = typer.Option(None, help="workers.tensor_parallel_size"),
    workers_per_gpu: int | None = typer.Option(None, help="workers.workers_per_gpu"),
) -> None:
    """Do the memory arithmetic (weights + KV cache + overhead vs each GPU) and recommend a layout.

    When the configured layout does not fit but another does (tensor parallel, a layer split, a
    lighter model.quantization), that layout's plan and the deploy.yaml keys to set it. Exit code 0
    when the deployment, or the layout recommended, fits; 1 when nothing does; 2 on bad input.
    """
    from launcher.plan.sizing import QUANTIZATIONS
    from worker.contract.shapes import ShapeError
    from worker.contract.tasks import TaskError

    if dtype in QUANTIZATIONS[1:]:
        fail(f"--dtype {dtype}: int8 and int4 are a quantization of the weights; use --quantization {dtype}")
    inventory = _plan_inventory(gpus)
    cfg = load_or_exit(
        config,
        {
            "model.name": model,
            "model.dtype": dtype,
            "model.quantization": quantization,
            "model.max_model_len": max_model_len,
            "workers.max_num_seqs": max_num_seqs,
            "workers.gpus_per_replica": gpus_per_replica,
            "workers.tensor_parallel_size": tensor_parallel_size,
            "workers.workers_per_gpu": workers_per_gpu,
            "workers.devices": "auto" if gpus else None,
        },
    )
    specs = None
    if cfg.cluster.backend == "ray" and not gpus:
        inventory, specs = ray_layout(cfg)
    shapes = per_model(cfg.served(), _planned_shape, ShapeError, TaskError)
    if len(shapes) > 1:
        raise typer.Exit(_plan_several(cfg, inventory, shapes))
    raise typer.Exit(_plan_one(cfg, inventory, shapes[0], specs))


def _plan_one(cfg: DeployConfig, inventory, shape, specs) -> int:
    """Print one model's plan, or the recommended layout's where the configured one does not fit
    (:func:`launcher.plan.advice.advise`); ``plan``'s exit code."""
    from launcher.plan.advice import advise
    from launcher.plan.plan import make_plan
    from launcher.plan.report import render

    result = make_plan(cfg, inventory, shape, specs=specs)
    advice = advise(cfg, inventory, shape, result) if specs is None else None
    if advice is None:
        report_console().print(render(result, cfg))
        return 0 if result.ok else 1
    out = report_console()
    out.print(f"The configured layout does not fit ({result.errors[0]}); this one does:", highlight=False)
    out.print(render(advice.plan, advice.config))
    out.print(f"Set in deploy.yaml:\n{advice.yaml()}", highlight=False)
    return 0


def _planned_shape(one):
    """``plan``'s shape of one served model, read from config only; raises ``TaskError`` for a task
    ``up`` refuses (:func:`worker.contract.tasks.check_task`), so ``plan`` never plans a deployment
    that cannot start (an encoder with ``task: generate`` would be sized as a decoder)."""
    from launcher.plan.shape import config_folder, read_shape
    from worker.contract.tasks import check_task

    shape = read_shape(one.model.name, one.model)
    check_task(one.model, config_folder(shape))
    return shape


def per_model(served, call, *errors: type[Exception]) -> list:
    """``call`` on each served model, in order; exit 2 on ``ModelNotFound`` (or ``errors``), the
    line naming the ``models:`` entry at fault when there are several."""
    from launcher.models import ModelNotFound

    out = []
    for k, one in enumerate(served):
        try:
            out.append(call(one))
        except (ModelNotFound, *errors) as exc:
            fail(f"models[{k}] ({one.name}): {exc}" if len(served) > 1 else str(exc))
    return out


def _plan_several(cfg: DeployConfig, inventory, shapes) -> int:
    """``plan`` of a ``models:`` deployment: each model's tables, the split per worker, one line
    per problem; returns the exit code (0: it fits)."""
    from rich.text import Text

    from launcher.plan.report import render
    from launcher.plan.several import plan_models

    result = plan_models(cfg, inventory, shapes)
    out = report_console()
    for k, (name, one) in enumerate(zip(result.names, result.plans, strict=True)):
        out.print(Text.assemble(("model ", "bold"), (name, "bold cyan")))
        one.errors = []  # said once below, with the model's name
        out.print(render(one, cfg.for_model(k)))
    for line in result.split():
        out.print(line, highlight=False)
    for e in result.errors:
        out.print(Text.assemble(("error: ", "bold red"), e))
    return 0 if result.ok else 1


@app.command()
def doctor(
    config: Path | None = CONFIG_ARG,
    model: str | None = typer.Option(None, help="model.name"),
    port: int | None = typer.Option(None, help="router.port"),
) -> None:
    """Check Python, torch/CUDA/driver versions, GPUs, the model's files, placement, plan and ports.

    Exit code 1 when any check fails; checks that need a GPU are marked skipped without one.
    """
    from launcher.plan.doctor import render, run_checks
    from launcher.plan.placement import discover

    cfg = load_or_exit(config, {"model.name": model, "router.port": port})
    checks = run_checks(cfg, discover())
    report_console().print(render(checks))
    raise typer.Exit(1 if any(c.status == "fail" for c in checks) else 0)


app.command("bench")(bench_command)  # light: torch and transformers load inside
app.command("apply")(apply_command)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
