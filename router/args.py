"""The router process's command line, defined once for both sides.

The supervisor builds a :class:`RouterArgs` and spawns ``python -m router.main`` with
:meth:`RouterArgs.to_argv`; ``router.main`` reads it back with :meth:`RouterArgs.from_argv`.

Every value deploy.yaml sets travels in the settings file (``--config``, a
:class:`router.settings.RouterSettings`, which also holds the API keys: never a command line).
The command line says where the inputs are (the settings file, each served model's folder, the
workers' ZeroMQ endpoint, the supervisor's event socket, the event log) and what only this one
process of the deployment's routers is: its restart count, whether it starts as a standby, and the
deployment's start time it shows.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

PROGRAM = ("-m", "router.main")  # what ``python`` runs for the router


@dataclass(frozen=True)
class RouterArgs:
    """One router process's arguments."""

    config: str  # its settings file (RouterSettings as JSON)
    model_paths: tuple[str, ...]  # one model folder per served model, in the settings' ``models`` order
    address: str  # the ZeroMQ endpoint the workers connect to
    events: str = ""  # the supervisor's event socket (ZeroMQ), where it pushes; "": none
    started: int = 0  # Unix seconds the deployment started (/v1/models' created); 0: this process's start
    event_log: str = ""  # the file that keeps worker events across router restarts; "": in memory
    restarts: int = 0  # times the supervisor has restarted the router
    standby: bool = False  # load, then wait for ``go <restarts>`` on stdin before binding

    def to_argv(self) -> list[str]:
        """The flags, in the order :meth:`from_argv` reads them."""
        out = ["--config", self.config]
        out += [arg for path in self.model_paths for arg in ("--model-path", path)]
        out += ["--address", self.address, "--events", self.events, "--started", str(self.started)]
        out += ["--event-log", self.event_log]
        out += ["--standby"] if self.standby else ["--restarts", str(self.restarts)]
        return out

    @classmethod
    def from_argv(cls, argv: list[str] | None = None) -> RouterArgs:
        """Parse ``argv`` (default ``sys.argv[1:]``); a bad command line exits with argparse's usage error."""
        ns = _parser().parse_args(argv)
        return cls(
            config=ns.config,
            model_paths=tuple(ns.model_path),
            address=ns.address,
            events=ns.events,
            started=ns.started,
            event_log=ns.event_log,
            restarts=ns.restarts,
            standby=ns.standby,
        )


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m router.main", description="The router process (router.main).")
    ap.add_argument("--config", required=True, help="the router's settings file (JSON)")
    ap.add_argument("--model-path", required=True, action="append", help="once per served model")
    ap.add_argument("--address", required=True, help="the ZeroMQ endpoint the workers connect to")
    ap.add_argument("--restarts", type=int, default=0, help="times the supervisor has restarted the router")
    ap.add_argument(
        "--standby", action="store_true", help="load, then wait for `go <restarts>` on stdin before binding"
    )
    ap.add_argument("--events", default="", help="the supervisor's event socket (ZeroMQ), where this router pushes")
    ap.add_argument("--event-log", default="", help="the file that keeps worker events across router restarts")
    ap.add_argument("--started", type=int, default=0, help="Unix seconds the deployment started (/v1/models)")
    return ap
