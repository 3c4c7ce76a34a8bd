"""scripts/gpu_check.sh without a GPU: its syntax, and every Python piece it drives on CPU
(random-weight model folder, copy-bandwidth probe, SSE client and bench summary against a stub
server, the hog's allocation plan, pick-util over plan's rule)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"


def test_gpu_check_parses_and_its_pieces_run_on_cpu():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], check=False).returncode == 0
    out = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PY": sys.executable, "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "dry run: OK" in out.stdout and "floor" in out.stdout
