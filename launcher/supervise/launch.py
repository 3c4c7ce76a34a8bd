"""How one worker process is started: its command line and environment, built in one place.

The supervisor builds a :class:`WorkerLaunch` per start of a slot (:meth:`WorkerLaunch.for_slot`);
a tensor-parallel slot derives each rank's from it (:meth:`WorkerLaunch.for_rank`: the rank's
cores, its own GPU, the rendezvous), the Ray backend the node's (:meth:`WorkerLaunch.on_node`: the
settings file's path on the node). None of them edits a command line.

What the worker is told travels in its settings file; its command line is a
:class:`worker.contract.args.WorkerArgs` (defined once, read back by ``worker.main``), and the
environment carries what must be set before the child imports torch (``CUDA_VISIBLE_DEVICES``,
:mod:`worker.contract.env`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from launcher.plan.placement import WorkerSpec
from worker.contract.args import PROGRAM, WorkerArgs

WORKER_PROGRAM = PROGRAM


@dataclass(frozen=True)
class WorkerLaunch:
    """One worker process's start: ``python PROGRAM ARGS`` (:class:`WorkerArgs`) with ``env`` added
    to the supervisor's environment. ``program`` is what python runs (a test may replace the worker
    with a stand-in)."""

    args: WorkerArgs
    env: Mapping[str, str] = field(default_factory=dict)
    program: tuple[str, ...] = WORKER_PROGRAM

    @classmethod
    def for_slot(
        cls, spec: WorkerSpec, settings: str | Path, model_path: str | Path, address: str, env: Mapping[str, str]
    ) -> WorkerLaunch:
        """The start of slot ``spec``: its placement's environment (:attr:`WorkerSpec.env`) with
        ``env`` (the deployment's own, e.g. the CURVE keys' folder) over it."""
        args = WorkerArgs(str(settings), spec.worker_id, spec.device, str(model_path), address, cpus=spec.cpus)
        return cls(args, env={**spec.env, **env})

    def for_rank(self, spec: WorkerSpec, rank: int, dist_init: str) -> WorkerLaunch:
        """Rank ``rank`` of tensor-parallel slot ``spec``: its cores (:meth:`WorkerSpec.rank_cpus`),
        its environment (:meth:`WorkerSpec.rank_env`: only its own GPU visible) and the rendezvous."""
        args = replace(self.args, cpus=spec.rank_cpus(rank), rank=rank, world_size=spec.tp, dist_init=dist_init)
        return replace(self, args=args, env={**self.env, **spec.rank_env(rank)})

    def on_node(self, run_dir: str, env: Mapping[str, str], device: str | None = None) -> WorkerLaunch:
        """The same start on another machine: the settings file under ``run_dir`` there, ``env`` in
        place of this one's, and ``device`` when it differs."""
        args = replace(self.args, config=f"{run_dir}/worker.json", device=device or self.args.device)
        return replace(self, args=args, env=dict(env))

    def argv(self) -> list[str]:
        """The arguments after ``python``."""
        return [*self.program, *self.args.to_argv()]
