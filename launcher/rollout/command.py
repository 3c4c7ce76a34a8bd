"""``llamadeploy apply``: change a running deployment through its admin API.

The new file is validated with ``up``'s rules here (exit 2, one line per problem, nothing sent),
then sent to the router (``POST /admin/apply``), which hands it to the supervisor; this command
prints the plan and the rollout's progress as the supervisor posts them (``GET /admin/rollout``)
and exits 0 once it is done (or planned, with ``--dry-run``), 1 when it failed and was rolled back
(the reason in one line) or another apply is in progress (409), 2 when it was refused
(``refused: ...``, with ``up``'s message; nothing changed). The plan, progress and result go to
stdout, errors and refusals to stderr.
"""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import typer
from rich.console import Console
from rich.markup import escape

from launcher.config import ConfigError, DeployConfig, load_config
from launcher.console import config_path, console, fail
from launcher.supervise.admin_client import AdminClient, AdminError
from router import admin_protocol
from router.rollout_protocol import ApplyRequest, RolloutStatus

out = Console(soft_wrap=True)  # the plan, progress and result: stdout (errors and refusals: stderr)
POLL_S = 0.5
SILENT_S = 60.0  # the router unreachable this long while watching: give up watching


def apply_command(
    config: Path = typer.Argument(..., help="the new deploy.yaml"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the plan only; change nothing"),
    rollback: bool = typer.Option(
        False, "--rollback", help="return to the previous revision (the file then only names the admin API)"
    ),
    max_unavailable: int | None = typer.Option(
        None, "--max-unavailable", min=0, help="replicas out of service at once (default 1, 0 for one replica)"
    ),
    admin_url: str | None = typer.Option(None, "--admin-url", help="the router's admin API (default: from the file)"),
    admin_token: str | None = typer.Option(
        None,
        "--admin-token",
        help="the running deployment's admin token when the file rotates it (default: the file's)",
    ),
) -> None:
    """Apply deploy.yaml to the running deployment: router settings live, worker changes rolling, scale."""
    cfg = _read_or_refuse(config, rollback)
    client = AdminClient(admin_url or cfg.router.admin_url, admin_token or cfg.router.admin_token)
    request = ApplyRequest(
        config=request_config(cfg), dry_run=dry_run, rollback=rollback, max_unavailable=max_unavailable
    )
    try:
        rid = client.call("POST", "/admin/apply", msgspec.to_builtins(request))["id"]
    except AdminError as exc:
        fail(f"the admin API at {client.base} refused the apply: {exc}", 1)
    except OSError as exc:
        fail(f"no router answers at {client.base} ({exc}); is `llamadeploy up` running?", 1)
    status = watch(client, rid)
    raise typer.Exit(outcome(status))


def _read_or_refuse(config: Path, rollback: bool) -> DeployConfig:
    """The new file, validated with ``up``'s rules here; exit 2 with ``refused: ...`` (``up``'s
    lines, nothing sent, nothing changed) for a file ``up`` cannot read or split."""
    from launcher.plan.layouts import tp_refusal

    try:
        cfg = load_config(config_path(config))
    except ConfigError as exc:
        raise typer.Exit(refused(str(exc))) from None
    if not rollback and (problem := tp_refusal(cfg)):
        raise typer.Exit(refused(problem))
    return cfg


def refused(reason: str) -> int:
    """Print an apply's refusal on stderr (each line of ``reason`` after ``refused:``, then that
    nothing changed); its exit code, 2."""
    for line in reason.splitlines():
        console.print(f"[bold red]refused:[/] {escape(line.strip())}", highlight=False)
    console.print("(nothing changed)", highlight=False)
    return 2


def request_config(cfg: DeployConfig) -> dict:
    """``cfg`` as JSON for ``POST /admin/apply``. A ``models:`` file goes without the ``model:``
    section that dumping fills with its defaults (parsed again it would read as giving both
    forms), and each entry's ``workers:`` with only the keys the file gives: an entry's keys
    override the top-level ``workers:`` (:func:`launcher.config.merged_workers`), so every default
    dumped there would override the file's top-level keys (``devices: cpu`` read back as ``auto``)."""
    if cfg.models is None:
        return cfg.model_dump(mode="json")
    data = cfg.model_dump(mode="json", exclude={"model"})
    for entry, dumped in zip(cfg.models, data["models"], strict=True):
        if entry.workers is not None:
            dumped["workers"] = entry.workers.model_dump(mode="json", exclude_unset=True)
    return data


def watch(client: AdminClient, rid: str) -> RolloutStatus:
    """Print the plan and each progress line of rollout ``rid`` until it ends; its last status."""
    shown_plan, shown, heard = False, 0, time.monotonic()
    while True:
        try:
            status = admin_protocol.decode(client.request("GET", "/admin/rollout"), RolloutStatus)
        except (OSError, ValueError) as exc:
            if time.monotonic() - heard > SILENT_S:
                fail(f"lost the router while watching the rollout ({exc}); `llamadeploy status` shows where it is", 1)
            time.sleep(POLL_S)
            continue
        heard = time.monotonic()
        if status.id != rid:
            time.sleep(POLL_S)
            continue
        if status.plan and not shown_plan:
            out.print("plan:\n  " + "\n  ".join(status.plan), highlight=False)
            shown_plan = True
        for line in status.progress[shown:]:
            out.print(f"  {line}", highlight=False)
        shown = len(status.progress)
        if not status.active:
            return status
        time.sleep(POLL_S)


def describe(status: dict) -> str:
    """One line on the last apply (``llamadeploy status``): its id, revision, how it ended (with its
    time, from the last progress line) and what it did: the reason it was refused or failed, else
    its plan (the keys changed live or rolling, and each step)."""
    state = status.get("state", "")
    last = (status.get("progress") or [""])[-1]
    ended = last if last.startswith(f"{state} in ") else state  # "done in 12.3s"
    plan = [line for line in status.get("plan") or [] if not line.startswith("warning: ")]
    what = status.get("reason") or "; ".join(plan) or (last if last != ended else "")
    rev = f" revision {status['revision']}" if status.get("revision") else ""
    return f"last apply ({status.get('id', '')}){rev}: {ended}" + (f": {what}" if what else "")


def outcome(status: RolloutStatus) -> int:
    """Print how the apply ended; its exit code."""
    if status.state == "refused":
        return refused(status.reason)
    if status.state == "failed":
        reason = " ".join(status.reason.split())  # one line
        console.print(f"[bold red]error:[/] apply failed, rolled back: {escape(reason)}", highlight=False)
        return 1
    if status.state == "planned":
        out.print("dry run: nothing changed (the real run would go ahead)", highlight=False)
    elif status.revision:
        out.print(
            f"[bold green]applied[/]: revision {status.revision} ({status.hash}) in {status.wall_s:.1f}s",
            highlight=False,
        )
    return 0
