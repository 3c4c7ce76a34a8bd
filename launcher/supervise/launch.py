"""How one worker process is started: its command line and environment, built in one place.

The supervisor builds a :class:`WorkerLaunch` per start of a slot (:meth:`WorkerLaunch.for_slot`);
a tensor-parallel slot derives each rank's from it (:meth:`WorkerLaunch.for_rank`: the rank's
cores, its own GPU, the rendezvous), the Ray backend the node's (:meth:`WorkerLaunch.on_node`: the
settings file's path on the node). None of them edits a command line.

What the worker is told travels in its settings file (``--config``, a
:class:`worker.contract.settings.WorkerSettings`); the command line carries only where this one
process stands (its slot, device, cores, rank), and the environment what must be set before the
child imports torch (``CUDA_VISIBLE_DEVICES``, :mod:`worker.contract.env`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from launcher.plan.placement import WorkerSpec

WORKER_PROGRAM = ("-m", "worker.main")


@dataclass(frozen=True)
class WorkerLaunch:
    """One worker process's start: ``python PROGRAM --config SETTINGS --worker-id N --device D
    --model-path P --address A [--cpus C] [--rank R --world-size N --dist-init URL]`` with ``env``
    added to the supervisor's environment. ``program`` is what python runs (a test may replace the
    worker with a stand-in)."""

    worker_id: int
    device: str  # "cuda" | "cpu"
    settings: str  # the worker's settings file
    model_path: str
    address: str  # the router's ZeroMQ endpoint
    cpus: tuple[int, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    rank: int | None = None  # a tensor-parallel rank, with world_size and dist_init
    world_size: int = 1
    dist_init: str = ""
    program: tuple[str, ...] = WORKER_PROGRAM

    @classmethod
    def for_slot(
        cls, spec: WorkerSpec, settings: str | Path, model_path: str | Path, address: str, env: Mapping[str, str]
    ) -> WorkerLaunch:
        """The start of slot ``spec``: its placement's environment (:attr:`WorkerSpec.env`) with
        ``env`` (the deployment's own, e.g. the CURVE keys' folder) over it."""
        return cls(
            spec.worker_id,
            spec.device,
            str(settings),
            str(model_path),
            address,
            cpus=spec.cpus,
            env={**spec.env, **env},
        )

    def for_rank(self, spec: WorkerSpec, rank: int, dist_init: str) -> WorkerLaunch:
        """Rank ``rank`` of tensor-parallel slot ``spec``: its cores (:meth:`WorkerSpec.rank_cpus`),
        its environment (:meth:`WorkerSpec.rank_env`: only its own GPU visible) and the rendezvous."""
        return replace(
            self,
            cpus=spec.rank_cpus(rank),
            env={**self.env, **spec.rank_env(rank)},
            rank=rank,
            world_size=spec.tp,
            dist_init=dist_init,
        )

    def on_node(self, run_dir: str, env: Mapping[str, str], device: str | None = None) -> WorkerLaunch:
        """The same start on another machine: the settings file under ``run_dir`` there, ``env`` in
        place of this one's, and ``device`` when it differs."""
        return replace(self, settings=f"{run_dir}/worker.json", env=dict(env), device=device or self.device)

    def argv(self) -> list[str]:
        """The arguments after ``python``."""
        out = [
            *self.program,
            "--config",
            self.settings,
            "--worker-id",
            str(self.worker_id),
            "--device",
            self.device,
            "--model-path",
            self.model_path,
            "--address",
            self.address,
        ]
        if self.cpus:
            out += ["--cpus", ",".join(map(str, self.cpus))]
        if self.rank is not None:
            out += ["--rank", str(self.rank), "--world-size", str(self.world_size), "--dist-init", self.dist_init]
        return out
