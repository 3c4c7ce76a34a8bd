"""The CURVE keys of one deployment: made by ``llamadeploy up``, read by the router and workers.

When workers reach the router over ``tcp://`` (any address that is not ``ipc://``), the router's
ROUTER socket is a CURVE server and accepts only the public keys of this deployment's worker
slots (:mod:`router.curve`). :func:`make_keys` writes one key pair for the router and one per
worker slot (``zmq.curve_keypair()``, Z85 text) into ``RUN_DIR/curve`` (mode 0700, every file
0600). Children find that folder through the environment variable :data:`KEYS_ENV`, never a key
on a command line; nothing here logs a key. ``ipc://`` needs none of this: the socket file sits in
the 0700 run directory.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import zmq

from worker.contract.env import KEYS_ENV

ROUTER = "router"


@dataclass(frozen=True)
class ServerKeys:
    """What the router's socket needs: its own pair and the workers' public keys (Z85 bytes)."""

    public: bytes
    secret: bytes
    workers: frozenset[bytes]
    folder: Path | None = None  # where they were read (read again for a slot added later)


@dataclass(frozen=True)
class ClientKeys:
    """What one worker's socket needs: its own pair and the router's public key (Z85 bytes)."""

    public: bytes
    secret: bytes
    server: bytes


def uses_curve(address: str) -> bool:
    """True when ``address`` needs CURVE: everything but ``ipc://`` (file permissions guard that)."""
    return not address.startswith("ipc://")


def worker_name(worker_id: int) -> str:
    return f"worker-{worker_id}"


def _write(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # 0600 from the start, never wider
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def make_keys(run_dir: Path, worker_ids: Iterable[int]) -> dict[str, str]:
    """Write a fresh key pair for the router and for each worker slot into ``run_dir/curve``.

    Returns the environment the router and worker processes need (:data:`KEYS_ENV` → the folder).
    Raises ``FileExistsError`` if the folder exists (keys are made once per deployment)."""
    folder = Path(run_dir) / "curve"
    folder.mkdir(mode=0o700)
    for name in (ROUTER, *map(worker_name, worker_ids)):
        public, secret = zmq.curve_keypair()
        _write(folder / f"{name}.public", public)
        _write(folder / f"{name}.secret", secret)
    return {KEYS_ENV: str(folder)}


def add_worker_keys(folder: Path, worker_id: int) -> None:
    """Write a key pair for slot ``worker_id`` into the deployment's key ``folder`` unless it has
    one (a slot a rollout adds; the router reads the new public key when the slot connects)."""
    name = worker_name(worker_id)
    if (folder / f"{name}.public").exists():
        return
    public, secret = zmq.curve_keypair()
    _write(folder / f"{name}.secret", secret)
    _write(folder / f"{name}.public", public)  # last: a reader that sees it finds the pair complete


def _folder(env: dict[str, str] | None) -> Path:
    value = (os.environ if env is None else env).get(KEYS_ENV)
    if not value:
        raise RuntimeError(
            f"workers connect over tcp:// but {KEYS_ENV} is not set: the CURVE keys are made by "
            "`llamadeploy up`; start the router and workers through it"
        )
    return Path(value)


def server_keys(env: dict[str, str] | None = None) -> ServerKeys:
    """The router's keys from the folder :data:`KEYS_ENV` names. Raises ``RuntimeError`` when it
    is unset, ``OSError`` when a file is missing."""
    folder = _folder(env)
    workers = frozenset(p.read_bytes().strip() for p in folder.glob("worker-*.public"))
    return ServerKeys(
        (folder / f"{ROUTER}.public").read_bytes().strip(),
        (folder / f"{ROUTER}.secret").read_bytes().strip(),
        workers,
        folder,
    )


def client_keys(worker_id: int, env: dict[str, str] | None = None) -> ClientKeys:
    """Worker ``worker_id``'s keys from the folder :data:`KEYS_ENV` names (errors as :func:`server_keys`)."""
    folder = _folder(env)
    name = worker_name(worker_id)
    return ClientKeys(
        (folder / f"{name}.public").read_bytes().strip(),
        (folder / f"{name}.secret").read_bytes().strip(),
        (folder / f"{ROUTER}.public").read_bytes().strip(),
    )
