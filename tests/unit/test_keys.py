"""The deployment's CURVE key files: who needs them, their modes, and what a child reads back."""

from __future__ import annotations

import stat

import pytest
import zmq

from worker.contract.env import KEYS_ENV
from worker.contract.keys import client_keys, make_keys, server_keys, uses_curve


def test_every_address_but_ipc_uses_curve():
    assert not uses_curve("ipc:///tmp/run/workers.ipc")
    assert uses_curve("tcp://127.0.0.1:5555") and uses_curve("tcp://10.0.0.2:5555")


def test_keys_are_private_pairs_that_match(tmp_path):
    env = make_keys(tmp_path, [0, 3])
    folder = tmp_path / "curve"
    assert env == {KEYS_ENV: str(folder)} and stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in folder.iterdir())
    server = server_keys(env)
    assert zmq.curve_public(server.secret) == server.public
    clients = [client_keys(wid, env) for wid in (0, 3)]
    assert server.workers == {c.public for c in clients} and all(c.server == server.public for c in clients)
    assert all(zmq.curve_public(c.secret) == c.public for c in clients)
    with pytest.raises(FileExistsError):  # made once per deployment
        make_keys(tmp_path, [0])


def test_a_child_without_the_keys_folder_is_told_where_keys_come_from():
    with pytest.raises(RuntimeError, match=f"{KEYS_ENV} is not set.*llamadeploy up"):
        server_keys({})
    with pytest.raises(OSError):
        client_keys(7, {KEYS_ENV: "/nonexistent"})
