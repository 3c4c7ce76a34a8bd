"""A worker process's command line, defined once for both sides (torch-free).

The launcher (its supervisor, a tensor-parallel slot's ranks, the Ray actor) builds a
:class:`WorkerArgs` and spawns ``python -m worker.main`` with :meth:`WorkerArgs.to_argv`;
``worker.main`` reads it back with :meth:`WorkerArgs.from_argv`. No flag is spelled anywhere else.

What is on the command line and what is in the settings file: every value deploy.yaml sets (the
model's options, the workers' limits, logging...) is configuration and travels in the settings
file (``--config``, a :class:`worker.contract.settings.WorkerSettings`), one file shared by every
slot of a model and revision. The command line says only who this one process is and where its
inputs are: its slot (``--worker-id``), device, CPU cores and tensor-parallel rank (these differ
between the processes that share one settings file; the rendezvous address is picked afresh for
every start of a slot), and where to find its settings file, its model folder (resolved by the
launcher, not a deploy.yaml value) and the router (``--address``, chosen at ``up``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

DEVICES = ("cpu", "cuda")
PROGRAM = ("-m", "worker.main")  # what ``python`` runs for a worker


@dataclass(frozen=True)
class WorkerArgs:
    """One worker process's arguments. Raises ValueError when they cannot run together (a rank
    outside ``0..world_size-1``, several ranks without a rendezvous, an unknown device)."""

    config: str  # its settings file (WorkerSettings as JSON)
    worker_id: int  # its slot
    device: str  # "cpu" | "cuda"
    model_path: str  # the model folder (or GGUF file)
    address: str  # the router's ZeroMQ endpoint
    cpus: tuple[int, ...] = ()  # the cores it is pinned to (CPU workers); () for no pinning
    rank: int = 0  # its tensor-parallel rank
    world_size: int = 1  # the tensor-parallel ranks of its replica
    dist_init: str = ""  # tcp://HOST:PORT where the ranks meet (rank 0 listens); "" with one rank

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"--device {self.device!r} is not one of {', '.join(DEVICES)}")
        if self.world_size > 1 and not self.dist_init:
            raise ValueError("--world-size > 1 needs --dist-init tcp://HOST:PORT")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"--rank {self.rank} is not in 0..{self.world_size - 1}")

    @property
    def role(self) -> str:
        """How its log lines name it: ``worker-3``, ``worker-3 rank 1``."""
        return f"worker-{self.worker_id}" + (f" rank {self.rank}" if self.world_size > 1 else "")

    def to_argv(self) -> list[str]:
        """The flags, in the order :meth:`from_argv` reads them (defaults left out)."""
        out = ["--config", self.config, "--worker-id", str(self.worker_id), "--device", self.device]
        out += ["--model-path", self.model_path, "--address", self.address]
        if self.cpus:
            out += ["--cpus", ",".join(map(str, self.cpus))]
        if self.world_size > 1:
            out += ["--rank", str(self.rank), "--world-size", str(self.world_size), "--dist-init", self.dist_init]
        return out

    @classmethod
    def from_argv(cls, argv: list[str] | None = None) -> WorkerArgs:
        """Parse ``argv`` (default ``sys.argv[1:]``); a bad command line exits with argparse's usage error."""
        ap = _parser()
        ns = ap.parse_args(argv)
        try:
            return cls(
                config=ns.config,
                worker_id=ns.worker_id,
                device=ns.device,
                model_path=ns.model_path,
                address=ns.address,
                cpus=tuple(int(c) for c in ns.cpus.split(",") if c),
                rank=ns.rank,
                world_size=ns.world_size,
                dist_init=ns.dist_init,
            )
        except ValueError as exc:
            ap.error(str(exc))


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m worker.main", description="One worker process (worker.main).")
    ap.add_argument("--config", required=True, help="the worker's settings file (JSON)")
    ap.add_argument("--worker-id", type=int, required=True)
    ap.add_argument("--device", choices=DEVICES, required=True)
    ap.add_argument("--cpus", default="", help="comma-separated core ids (CPU workers)")
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--address", required=True, help="the router's ZeroMQ endpoint")
    ap.add_argument("--rank", type=int, default=0, help="tensor-parallel rank of this process")
    ap.add_argument("--world-size", type=int, default=1, help="tensor-parallel ranks of this replica")
    ap.add_argument("--dist-init", default="", help="tcp://HOST:PORT where the ranks meet (rank 0 listens)")
    return ap
