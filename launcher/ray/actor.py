"""The Ray actor of one worker slot: on its node, inside the slot's bundle, it runs the worker.

Ray starts the actor with ``CUDA_VISIBLE_DEVICES`` set to the GPUs it granted the bundle. The
actor's :meth:`WorkerActor.start` writes what the worker needs into a private folder on the node
(the worker's settings file, this slot's CURVE keys: handed over as arguments, never on a command
line), then starts ``python -m worker.main`` as its child with the node report in its environment
(:data:`NODE_ID_ENV`, :data:`NODE_IP_ENV`, :data:`GPU_IDS_ENV`), so the worker imports torch only
after all of it is set. The child dies with the actor (``PR_SET_PDEATHSIG`` through
:data:`~worker.contract.env.PARENT_ENV`), so killing the actor, or losing its node, ends the worker.

The worker is the same program as locally: its signals, exit codes and logs (its stderr is the
actor's, which Ray forwards to the launcher's output) do not change.

Import-light: Ray imports this module on every node.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import replace
from pathlib import Path

from worker.contract.args import PROGRAM, WorkerArgs
from worker.contract.env import (
    EXPECTED_GPUS_ENV,
    NODE_ID_ENV,
    NODE_IP_ENV,
    PARENT_ENV,
    SECRET_ENVS,
    expected_gpus_value,
)
from worker.contract.env import RAY_GPU_IDS_ENV as GPU_IDS_ENV

RUN_DIR = "{RUN}"  # in arguments and environment values: the actor's private folder on its node
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def expected_gpus(gpu_ids: list[str], share: float) -> str:
    """``LLAMADEPLOY_EXPECTED_GPUS`` for the GPUs Ray granted (physical indices), from NVML on
    this node; "" when NVML does not list them (the worker then checks nothing)."""
    from launcher.plan.placement import nvml_gpus

    by_index = {str(g.index): g for g in nvml_gpus() if not g.is_mig}
    if not gpu_ids or any(i not in by_index for i in gpu_ids):
        return ""
    return expected_gpus_value([by_index[i] for i in gpu_ids], share)


FOLDER_PREFIX = "llamadeploy-worker-"


def sweep_folders(tmp: Path | None = None) -> list[Path]:
    """Remove the private folders (worker settings, CURVE keys) of actors on this node that died without
    cleaning up (``kill -9``, a raylet that went away): each is named after its actor's pid.
    Returns what was removed."""
    removed = []
    for folder in Path(tmp or tempfile.gettempdir()).glob(f"{FOLDER_PREFIX}*-*"):
        pid = folder.name.removeprefix(FOLDER_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def write_files(folder: Path, files: dict[str, bytes]) -> None:
    """``files`` (relative path → content) under ``folder``: folders 0700, files 0600 from the start."""
    for rel, data in files.items():
        path = folder / rel
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)


class WorkerActor:
    """One worker slot on a Ray node (wrapped with ``ray.remote`` by :mod:`launcher.ray.backend`;
    a threaded actor: :meth:`wait` blocks while :meth:`send_signal` and :meth:`info` answer)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._code: int | None = None
        self._info: dict = {}
        self._started = threading.Event()
        self._exited = threading.Event()
        self._error = ""

    def start(self, args: WorkerArgs, env: dict[str, str], files: dict[str, bytes], share: float, on_cpu: bool) -> dict:
        """Start ``python -m worker.main ARGS`` with ``env`` added (``{RUN}`` in the settings file's
        path and in the environment's values replaced by the private folder holding ``files``).
        ``on_cpu``: the model runs on CPU although Ray granted GPUs (the test switch).
        Returns what the worker was given: pid, node id and IP, GPU ids, CUDA_VISIBLE_DEVICES."""
        import ray

        sweep_folders()
        run = Path(tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-"))  # mode 0700
        write_files(run, files)
        gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        inherited = {k: v for k, v in os.environ.items() if k not in SECRET_ENVS}
        child = {**inherited, **{k: v.replace(RUN_DIR, str(run)) for k, v in env.items()}}
        child.update(
            {
                NODE_ID_ENV: ray.get_runtime_context().get_node_id(),
                NODE_IP_ENV: ray.util.get_node_ip_address(),
                GPU_IDS_ENV: ",".join(gpu_ids),
                "PYTHONUNBUFFERED": "1",
                PARENT_ENV: str(os.getpid()),  # die with this actor
            }
        )
        if gpu_ids:
            child["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # Ray's ids are NVML's physical indices
            child[EXPECTED_GPUS_ENV] = "" if on_cpu else expected_gpus(gpu_ids, share)
        else:
            child["CUDA_VISIBLE_DEVICES"] = ""  # a CPU slot sees no GPU
            child[EXPECTED_GPUS_ENV] = ""
        cpus = str(int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1)) or 1)
        for var in THREAD_VARS:
            child.setdefault(var, cpus)
        argv = [sys.executable, *PROGRAM, *replace(args, config=args.config.replace(RUN_DIR, str(run))).to_argv()]
        # The child is started, and waited for, by a thread of our own that lives as long as it:
        # PR_SET_PDEATHSIG fires when the *thread* that forked the child ends.
        threading.Thread(target=self._run, args=(argv, child, run), daemon=True, name="worker-child").start()
        self._started.wait()
        if self._proc is None:
            raise RuntimeError(f"cannot start the worker on node {child[NODE_IP_ENV]}: {self._error}")
        self._info = {
            "pid": self._proc.pid,
            "actor_pid": os.getpid(),
            "node_id": child[NODE_ID_ENV],
            "node_ip": child[NODE_IP_ENV],
            "gpu_ids": gpu_ids,
            "cuda_visible_devices": child.get("CUDA_VISIBLE_DEVICES", ""),
        }
        return self._info

    def _run(self, argv: list[str], env: dict[str, str], run: Path) -> None:
        try:
            self._proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            self._error, self._code = str(exc), 127
            self._started.set()
            self._exited.set()
            return
        self._started.set()
        self._code = self._proc.wait()
        shutil.rmtree(run, ignore_errors=True)
        self._exited.set()

    def wait(self) -> int:
        """Block until the worker exits; its exit code (negative: the signal that ended it)."""
        self._exited.wait()
        return self._code

    def send_signal(self, sig: int) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(sig)

    def info(self) -> dict:
        return self._info
