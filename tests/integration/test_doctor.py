"""``llamadeploy doctor`` as a real subprocess on this machine (GPU or not)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.plan.placement import nvml_gpus
from tests.helpers.deployment import free_port

EXE = Path(sys.executable).with_name("llamadeploy")


def doctor(tmp_path: Path, yaml_text: str) -> subprocess.CompletedProcess:
    (tmp_path / "deploy.yaml").write_text(yaml_text)
    exe = str(EXE) if EXE.exists() else shutil.which("llamadeploy")
    return subprocess.run(
        [exe, "doctor", "deploy.yaml"], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
    )


def ports(router: int | None = None) -> str:
    return f"router: {{port: {router or free_port()}, admin_port: {free_port()}}}\n"


def test_doctor_passes_on_this_machine_and_says_what_it_skipped(tmp_path):
    out = doctor(tmp_path, ports() + "workers: {devices: auto}\n")
    assert out.returncode == 0, out.stdout + out.stderr
    for row in (
        "python",
        "torch",
        "CUDA works",
        "NVIDIA driver",
        "transformers",
        "model",
        "placement",
        "memory plan",
        "router.port",
    ):
        assert row in out.stdout
    if not nvml_gpus():
        assert "no NVIDIA driver" in out.stdout and "skip" in out.stdout
        assert "check(s) skipped" in out.stdout


def test_gpu_index_that_does_not_exist_fails(tmp_path):
    out = doctor(tmp_path, ports() + "workers: {devices: [63]}\n")
    assert out.returncode == 1
    assert "GPU [63]" in out.stdout and "fail" in out.stdout


@pytest.mark.skipif(bool(nvml_gpus()), reason="needs a machine without GPUs")
def test_devices_0_without_gpu_fails_with_a_fix(tmp_path):
    out = doctor(tmp_path, ports() + "workers: {devices: [0]}\n")
    assert out.returncode == 1
    assert "no GPU" in out.stdout and "devices: cpu" in out.stdout


def test_busy_router_port_fails(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        out = doctor(tmp_path, ports(s.getsockname()[1]) + "workers: {devices: cpu}\n")
    assert out.returncode == 1
    assert "router.port" in out.stdout and "cannot listen" in out.stdout


def test_missing_model_fails(tmp_path):
    out = doctor(tmp_path, ports() + f"model: {{name: {tmp_path / 'nothing'}.gguf}}\nworkers: {{devices: cpu}}\n")
    assert out.returncode == 1
    assert "does not exist" in out.stdout


def test_every_model_of_a_models_deployment_gets_its_own_rows(tmp_path):
    models = "models:\n  - {served_name: a}\n  - {served_name: b, quantization: int8}\n"
    out = doctor(tmp_path, ports() + models + "workers: {devices: cpu, replicas: 1}\n")
    assert out.returncode == 0, out.stdout + out.stderr
    text = " ".join(out.stdout.split())
    for name in ("a", "b"):
        for row in ("model", "dtype", "quantization", "kernels"):
            assert f"'{name}': {row}" in text, (name, row)
    assert "model.quantization: int8" in text and "placement" in text and "memory plan" in text
