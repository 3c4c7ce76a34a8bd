"""`llamadeploy up` refuses a layout it cannot run with exit 2 and one line, before anything starts (a real CLI process)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.model_configs import deploy_file


def up(path: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "launcher.cli", "up", path], capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.parametrize(
    "workers, extra, message",
    [
        (
            {"devices": "cpu", "tensor_parallel_size": 2},
            "",
            "workers.tensor_parallel_size: 2 does not divide the model's 9 attention heads, 3 KV heads; use one of 3",
        ),
        (
            {"devices": "cpu", "tensor_parallel_size": 2, "gpus_per_replica": 2},
            "",
            "workers.tensor_parallel_size=2 and workers.gpus_per_replica=2 are exclusive",
        ),
        (
            {"devices": "cpu", "tensor_parallel_size": 3},
            "cluster: {backend: ray}\n",
            "workers.tensor_parallel_size > 1 is not supported with cluster.backend: ray yet",
        ),
    ],
)
def test_up_refuses_with_exit_2_and_one_line(tmp_path, workers, extra, message):
    out = up(deploy_file(tmp_path, workers, extra))
    assert out.returncode == 2, out.stdout + out.stderr
    assert message in " ".join((out.stdout + out.stderr).split())  # rich may wrap the line
    assert "router started" not in out.stderr and "worker 0 started" not in out.stderr
