"""scripts/setup.sh's torch choice, run by bash with a fake ``nvidia-smi`` and a recording ``python``."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SETUP = Path(__file__).resolve().parents[2] / "scripts" / "setup.sh"

SMI = """+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 550.54.15              Driver Version: 550.54.15      CUDA Version: {cuda}     |
|-----------------------------------------+------------------------+----------------------+
"""


def bash(script: str, path_dirs: list[Path] = (), **env) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **env, "PATH": os.pathsep.join([*map(str, path_dirs), "/usr/bin", "/bin"])}
    return subprocess.run(
        ["bash", "-c", f"source {SETUP}; {script}"],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=30,
        check=False,
    )


def test_setup_script_parses():
    assert subprocess.run(["bash", "-n", str(SETUP)], check=False).returncode == 0


@pytest.mark.parametrize(
    "driver, build",
    [
        ("12.6", "cu126"),
        ("12.8", "cu128"),
        ("12.9", "cu129"),
        ("13.0", "cu130"),
        ("13.2", "cu130"),
        ("12.7", "cu126"),
    ],
)
def test_newest_build_the_driver_can_run(driver, build):
    out = bash(f"torch_cuda_build {driver}")
    assert out.returncode == 0 and out.stdout.strip() == build


def test_a_driver_older_than_every_build_is_refused():
    out = bash("torch_cuda_build 11.8")
    assert out.returncode == 1 and "upgrade the NVIDIA driver" in out.stderr
    assert bash("torch_cuda_build 11.8", TORCH_CUDA_BUILDS="cu118 cu126").stdout.strip() == "cu118"


def test_driver_cuda_version_from_nvidia_smi():
    out = subprocess.run(
        ["bash", "-c", f"source {SETUP}; driver_cuda_version"],
        input=SMI.format(cuda="12.8"),
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.stdout.strip() == "12.8"
    empty = subprocess.run(
        ["bash", "-c", f"source {SETUP}; driver_cuda_version"],
        input="no header\n",
        capture_output=True,
        text=True,
        check=False,
    )
    assert empty.stdout == ""


def fake_bin(tmp_path: Path, name: str, body: str) -> None:
    exe = tmp_path / name
    exe.write_text(f"#!/bin/bash\n{body}\n")
    exe.chmod(0o755)


def test_install_picks_the_cuda_index_and_says_so(tmp_path):
    fake_bin(tmp_path, "nvidia-smi", f"cat <<'X'\n{SMI.format(cuda='12.8')}X")
    fake_bin(tmp_path, "python", f'echo "$@" >> {tmp_path}/pip.log')
    out = bash("install_torch", [tmp_path])
    assert out.returncode == 0, out.stderr
    assert "supports CUDA 12.8: installing torch==2.13.0 from https://download.pytorch.org/whl/cu128" in out.stdout
    assert (tmp_path / "pip.log").read_text().split() == [
        "-m",
        "pip",
        "install",
        "-q",
        "torch==2.13.0",
        "--index-url",
        "https://download.pytorch.org/whl/cu128",
    ]


def test_install_without_a_gpu_keeps_the_cpu_pin(tmp_path):
    fake_bin(tmp_path, "python", f'echo "$@" >> {tmp_path}/pip.log')
    out = bash("install_torch", [tmp_path])
    assert out.returncode == 0 and "CPU build torch==2.13.0" in out.stdout
    assert (tmp_path / "pip.log").read_text().split() == ["-m", "pip", "install", "-q", "torch==2.13.0"]
