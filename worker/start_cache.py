"""What a worker measures at start and keeps for its next start on this machine
(:func:`worker.contract.env.tuning_dir`, default ``~/.cache/llamadeploy/tuning``): a model's kernel
table (:func:`kernel_table_path`, read and extended by :func:`worker.quant.autotune.load_or_measure`)
and the CPU step costs that size ``max_prefill_tokens: auto`` (:func:`cached_step_cost`).

Both are timings, true of the machine they were taken on, so each file is named by the machine
(:func:`worker.quant.autotune.machine_digest`: the CPU's model and flags, torch's version, the ggml
operator's build) and by what the timing depends on: another CPU, torch, model or setting measures
again, and so does the first start after the folder is deleted. A restart, a second replica, a
rolling ``apply`` or the next ``up`` of the same model on the same machine read them instead of
measuring (each read or measurement is logged, with its time).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from worker.contract.env import tuning_dir
from worker.step_cost import StepCost

log = logging.getLogger(__name__)


def digest(value) -> str:
    """16 hex digits of sha256 over ``value`` as canonical JSON (sorted keys)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def kernel_table_path(model_path: str) -> Path:
    """The kernel table shared by the deterministic replicas of the model at ``model_path`` on this
    machine. Its entries are keyed by a weight's shape and format, the row buckets and the candidate
    kernels (:class:`worker.quant.linear.Linears`), so replicas with other settings (another
    ``max_num_seqs``, dtype or quantization) share the file and add their own entries; an entry once
    written is never changed, so every replica runs the same kernels for the same weight."""
    from worker.quant import autotune

    return tuning_dir() / autotune.table_name(f"{Path(model_path).name}-{digest(model_path)[:12]}")


def cached_step_cost(key: dict, measure: Callable[[], StepCost | None]) -> StepCost | None:
    """The step costs saved under ``key`` (JSON: everything they depend on, the machine included),
    else ``measure()``'s, saved for the next start. The replicas of a deployment start together: the
    first measures under a file lock while the others wait for it and read (so it measures alone,
    and they spend no CPU on the same figures). None (a KV cache too small to calibrate) is not
    saved: finding it again costs nothing. An unreadable file is measured again and replaced; a
    folder that cannot be written only logs a warning (and nothing is locked)."""
    path = tuning_dir() / f"step-cost-{digest(key)}.json"
    with locked(path):
        try:
            cost = StepCost(**json.loads(path.read_text())["cost"])
        except FileNotFoundError:
            pass
        except (OSError, ValueError, TypeError, KeyError) as exc:
            log.warning("step costs %s unreadable (%s): measuring again", path, exc)
        else:
            log.info("step costs read from %s (measured at an earlier start here)", path)
            return cost
        began = time.perf_counter()
        cost = measure()
        if cost is not None:
            log.info("step costs measured in %.1fs; kept in %s", time.perf_counter() - began, path)
            write_atomically(path, json.dumps({"key": key, "cost": dataclasses.asdict(cost)}, indent=1, default=str))
        return cost


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` + ``.lock`` for the block (none when it cannot be made)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_name(path.name + ".lock"), "w")
    except OSError:
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def write_atomically(path: Path, text: str) -> None:
    """``text`` into ``path`` through a temporary file and a rename (a reader never sees half of it);
    on an ``OSError`` (a read-only cache) a warning: the worker starts without keeping it."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        tmp.replace(path)
    except OSError as exc:
        log.warning("could not keep %s (%s): the next start measures again", path, exc)
