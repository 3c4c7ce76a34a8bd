"""``llamadeploy down``'s choice of the process to signal (launcher/stop.py), on a fake /proc."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from launcher.stop import StopError, alive, is_launcher, launcher_of, on_this_machine, parent_pid, stop


def fake_proc(tmp_path, pid: int, ppid: int, comm: str, argv: list[str]):
    folder = tmp_path / str(pid)
    folder.mkdir()
    (folder / "stat").write_text(f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1 4194560\n")
    (folder / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")


def test_parent_read_past_a_command_name_with_spaces_and_parentheses(tmp_path):
    fake_proc(tmp_path, 40, 7, "odd) name (x", ["x"])
    assert parent_pid(40, tmp_path) == 7


@pytest.mark.parametrize(
    "argv",
    [
        ["/work/.venv/bin/python", "/work/.venv/bin/llamadeploy", "up", "deploy.yaml"],
        ["llamadeploy", "up"],
        ["/usr/bin/python3", "-m", "launcher.cli", "up", "/tmp/d.yaml", "--log-format", "json"],
    ],
)
def test_router_started_by_up_names_its_launcher(tmp_path, argv):
    fake_proc(tmp_path, 10, 1, "python", argv)
    fake_proc(tmp_path, 11, 10, "python", ["python", "-m", "router.main", "--config", "r.json"])
    assert is_launcher(10, tmp_path)
    assert launcher_of(11, tmp_path) == 10


@pytest.mark.parametrize(
    "argv",
    [
        ["bash"],
        ["/work/.venv/bin/llamadeploy", "status"],
        ["python", "-m", "launcher.cli", "apply", "up"],  # "up" is not the command here
        ["python", "-m", "pytest", "tests/e2e"],
    ],
)
def test_anything_else_is_refused_and_not_signalled(tmp_path, argv):
    fake_proc(tmp_path, 20, 1, "x", argv)
    fake_proc(tmp_path, 21, 20, "python", ["python", "-m", "router.main"])
    assert not is_launcher(20, tmp_path)
    with pytest.raises(StopError, match="not started by `llamadeploy up`"):
        launcher_of(21, tmp_path)


def test_a_router_pid_not_on_this_machine_is_refused(tmp_path):
    with pytest.raises(StopError, match="not on this machine"):
        launcher_of(12345, tmp_path)


def test_stop_waits_for_the_process_to_exit():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert alive(child.pid)
        assert stop(child.pid, timeout=10)  # a zombie (not yet reaped) counts as stopped
        assert child.wait(timeout=5) == -15
    finally:
        if child.poll() is None:
            os.kill(child.pid, 9)
            child.wait()


def test_a_zombie_or_a_missing_process_is_not_alive(tmp_path):
    fake_proc(tmp_path, 30, 1, "llamadeploy", ["llamadeploy", "up"])
    assert alive(30, tmp_path)
    (tmp_path / "30" / "stat").write_text("30 (llamadeploy) Z 1 30 30 0 -1\n")
    assert not alive(30, tmp_path)
    assert not alive(31, tmp_path)


@pytest.mark.parametrize(
    ("url", "here"),
    [
        ("http://127.0.0.1:8001", True),
        ("http://127.0.0.5:8001/", True),
        ("http://localhost:8001", True),
        ("http://[::1]:8001", True),
        ("http://10.0.0.7:8001", False),
        ("http://gpu-node-3:8001", False),
        ("http://0.0.0.0:8001", False),
    ],
)
def test_only_a_loopback_admin_url_is_stopped_from_here(url, here):
    assert on_this_machine(url) is here


def test_this_machines_own_lan_address_counts_as_here():
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))  # a UDP connect picks the outgoing address, sends nothing
        except OSError:
            pytest.skip("no IPv4 route on this machine")
        own = probe.getsockname()[0]
    if own.startswith("127."):
        pytest.skip("only loopback here")
    assert on_this_machine(f"http://{own}:8001")
